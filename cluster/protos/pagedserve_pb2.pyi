from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    reasoning: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function: str
    def __init__(self, mode: _Optional[str] = ..., function: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed", "logprobs", "ignore_eos", "priority", "presence_penalty", "frequency_penalty", "repetition_penalty", "request_id", "structured_outputs", "response_format", "prompt_logprobs", "min_tokens", "include_stop_str_in_output", "truncate_prompt_tokens", "use_beam_search", "length_penalty", "early_stopping", "cache_salt", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "token_by_token")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USE_BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    n: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    logprobs: int
    ignore_eos: bool
    priority: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    request_id: str
    structured_outputs: str
    response_format: str
    prompt_logprobs: int
    min_tokens: int
    include_stop_str_in_output: bool
    truncate_prompt_tokens: int
    use_beam_search: bool
    length_penalty: float
    early_stopping: str
    cache_salt: str
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    token_by_token: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., n: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., priority: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., request_id: _Optional[str] = ..., structured_outputs: _Optional[str] = ..., response_format: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., use_beam_search: _Optional[bool] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[str] = ..., cache_salt: _Optional[str] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., token_by_token: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class PromptTokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason", "stop_string", "stop_token_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    stop_string: str
    stop_token_id: int
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "model", "choices", "usage", "time_to_first_token_s", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    usage: Usage
    time_to_first_token_s: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptTokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., time_to_first_token_s: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptTokenLogprob, _Mapping]]] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed", "logprobs", "top_logprobs", "ignore_eos", "priority", "presence_penalty", "frequency_penalty", "repetition_penalty", "request_id", "structured_outputs", "response_format", "prompt_logprobs", "min_tokens", "include_stop_str_in_output", "truncate_prompt_tokens", "chat_template_kwargs", "add_generation_prompt", "cache_salt", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "token_by_token", "include_reasoning", "reasoning_effort", "documents")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_REASONING_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    n: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    logprobs: bool
    top_logprobs: int
    ignore_eos: bool
    priority: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    request_id: str
    structured_outputs: str
    response_format: str
    prompt_logprobs: int
    min_tokens: int
    include_stop_str_in_output: bool
    truncate_prompt_tokens: int
    chat_template_kwargs: str
    add_generation_prompt: bool
    cache_salt: str
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    token_by_token: bool
    include_reasoning: bool
    reasoning_effort: str
    documents: str
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., n: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., priority: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., request_id: _Optional[str] = ..., structured_outputs: _Optional[str] = ..., response_format: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., chat_template_kwargs: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., token_by_token: _Optional[bool] = ..., include_reasoning: _Optional[bool] = ..., reasoning_effort: _Optional[str] = ..., documents: _Optional[str] = ...) -> None: ...

class ChatLogprob(_message.Message):
    __slots__ = ("token", "logprob", "bytes", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    bytes: bytes
    top_logprobs: _containers.RepeatedCompositeFieldContainer[ChatLogprob]
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ..., bytes: _Optional[bytes] = ..., top_logprobs: _Optional[_Iterable[_Union[ChatLogprob, _Mapping]]] = ...) -> None: ...

class ChatChoice(_message.Message):
    __slots__ = ("index", "role", "content", "tool_calls", "logprobs", "finish_reason", "stop_string", "stop_token_id", "reasoning")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    index: int
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    logprobs: _containers.RepeatedCompositeFieldContainer[ChatLogprob]
    finish_reason: str
    stop_string: str
    stop_token_id: int
    reasoning: str
    def __init__(self, index: _Optional[int] = ..., role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[ChatLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., reasoning: _Optional[str] = ...) -> None: ...

class PromptCandidate(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "decoded_token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DECODED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    decoded_token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., decoded_token: _Optional[str] = ...) -> None: ...

class PromptPosition(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[PromptCandidate]
    def __init__(self, candidates: _Optional[_Iterable[_Union[PromptCandidate, _Mapping]]] = ...) -> None: ...

class ChatResponse(_message.Message):
    __slots__ = ("request_id", "model", "choices", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[ChatChoice]
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptPosition]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[ChatChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptPosition, _Mapping]]] = ...) -> None: ...
