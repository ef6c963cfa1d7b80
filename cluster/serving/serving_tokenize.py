"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` over the frontend's tokenizer.

``/tokenize`` takes a prompt (with ``add_special_tokens``, default true, as a
completion's prompt is tokenized) or chat messages (rendered by the same chat
template, tools and ``chat_template_kwargs`` as a chat completion, and refused
for the same reasons); it returns the token ids, their count, the model's
context length and, with ``return_token_strs``, the tokenizer's token strings.
A prompt longer than the context is counted, not refused: saying how long it
is is the point. ``/detokenize`` decodes token ids (special tokens kept, as
the tokenizer's ``decode`` does by default); an id outside the vocabulary is a
400 naming ``tokens``.
"""

from __future__ import annotations

from .errors import APIError
from .frontend import Frontend, check_unicode
from .protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest, TokenizeCompletionRequest,
                       TokenizeResponse)


class TokenizeRequest:
    """``/tokenize``'s body: vLLM's two forms, told apart by ``messages``."""

    @staticmethod
    def model_validate(data: dict) -> TokenizeCompletionRequest | TokenizeChatRequest:
        form = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
        return form.model_validate(data)


class ServingTokenize:
    """Answers ``/tokenize`` and ``/detokenize`` for one ``Frontend``."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        frontend = self.frontend
        frontend.resolve_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            token_ids = frontend.render_chat(request).token_ids
        else:
            check_unicode(request.prompt, "prompt")
            token_ids = frontend.prompt_encoder.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        token_strs = frontend.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(token_ids), max_model_len=frontend.max_model_len, tokens=token_ids,
                                token_strs=token_strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        frontend = self.frontend
        frontend.resolve_model(request.model)
        outside = [t for t in request.tokens if t >= frontend.vocab_size]
        if outside:
            raise APIError(400, f"tokens must be token ids in [0, {frontend.vocab_size}); got {outside[:5]}",
                           param="tokens")
        return DetokenizeResponse(prompt=frontend.tokenizer.decode(request.tokens))
