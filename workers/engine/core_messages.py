"""The messages between a worker actor and its engine core process: msgpack frames over ZMQ.

Two sockets, one each way (``workers.actor.core_client`` binds them, the core connects). Every
message is a ZMQ multipart message: a one-byte kind, a msgpack body, and raw frames for bulk
data (a KV transfer's payload, a step's packed ``StreamBatch``), so that nothing on the path is
pickled and the bytes of a step's outputs are never copied into a Python object on the way.

Actor -> core (``ToCore``): a request to add (``AddRequest``), aborts, a utility call
(``stats``, ``check_integrity``, ... answered by ``FromCore.REPLY``), the reply to a KV
transport operation the core asked for, the answer to a blocking ask, and stop.

Core -> actor (``FromCore``): ready (the engine's description), a channel's outputs, a
migrated request's KV export, a prefill's KV export, a call's reply, a KV transport
operation, a blocking ask (the central preemption decision, tensor-parallel ranks), and
dead (the engine loop failed).

Torch-free: the actor's process never loads torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ..lora.lora_request import LoRARequest
from ..sample.sampling_params import SamplingParams, StructuredOutputsParams


# Frames from this size on (a KV transfer's payload) are sent without a copy; smaller ones are
# copied, which costs less than a zero-copy frame's release callback (pyzmq's advice: 64 kB).
ZERO_COPY_BYTES = 1 << 16


class ToCore:
    ADD = b"a"
    ABORT = b"x"
    CALL = b"c"
    KV_ENDED = b"k"
    ANSWER = b"q"
    STOP = b"s"


class FromCore:
    STARTED = b"s"   # the core has its spec and its progress file: the paths between them can go
    READY = b"r"
    OUTPUTS = b"o"
    MIGRATED = b"m"
    CHANNEL_GONE = b"g"   # a socket channel's reader disconnected: its requests were aborted
    EXPORT = b"p"
    REPLY = b"c"
    KV_SEND = b"k"
    ASK = b"q"
    DEAD = b"d"


def pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def unpack(data) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---- sampling parameters ------------------------------------------------------------------
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def params_to_wire(params: SamplingParams) -> dict:
    """``params`` as plain data (its fields; structured outputs as their dict)."""
    wire = {name: getattr(params, name) for name in _PARAM_FIELDS}
    if params.structured_outputs is not None:
        wire["structured_outputs"] = dataclasses.asdict(params.structured_outputs)
    return wire


def params_from_wire(wire: dict) -> SamplingParams:
    structured = wire.get("structured_outputs")
    if structured is not None:
        wire = {**wire, "structured_outputs": StructuredOutputsParams(**structured)}
    return SamplingParams(**wire)


# ---- KV transfers as frames ------------------------------------------------------------------
# numpy has no bfloat16: such payloads travel as their raw 16-bit patterns (``engine.kv_transfer``).
_WIRE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def payload_from_frame(header: bytes, frame) -> np.ndarray:
    """A KV transfer's payload array from its raw frame (``header`` names its layout and dtype);
    a view of the frame's buffer, not a copy."""
    meta = msgpack.unpackb(header)
    return np.frombuffer(frame, dtype=_WIRE_DTYPES[meta["dtype"]]).reshape(meta["layout"])


# ---- typed messages -----------------------------------------------------------------------
@dataclass
class AddRequest:
    """Start a request, its outputs into channel ``channel_id`` under the handle's ``key``.

    ``kv_header`` (and a payload frame after the body) bring a KV transfer to import;
    ``transfer_s`` its (fetch, local copy) seconds, for the request's metrics.
    ``lora_request``: the LoRA adapter to generate with.
    """

    channel_id: str
    key: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    export_kv: bool = False
    kv_header: bytes | None = None
    transfer_s: tuple[float, float] | None = None
    lora_request: LoRARequest | None = None

    def body(self) -> bytes:
        lora = self.lora_request
        return pack([self.channel_id, self.key, self.request_id, self.prompt_token_ids,
                     params_to_wire(self.params), self.priority, self.prompt, self.output_token_ids,
                     self.export_kv, self.kv_header, self.transfer_s,
                     None if lora is None else [lora.lora_name, lora.lora_int_id, lora.lora_path]])

    @classmethod
    def from_body(cls, body) -> "AddRequest":
        (channel_id, key, request_id, prompt_token_ids, params, priority, prompt, output_token_ids, export_kv,
         kv_header, transfer_s, lora) = unpack(body)
        return cls(channel_id, key, request_id, prompt_token_ids, params_from_wire(params), priority, prompt,
                   output_token_ids, export_kv, kv_header, tuple(transfer_s) if transfer_s else None,
                   None if lora is None else LoRARequest(*lora))


@dataclass
class CoreInfo:
    """What the core says of its engine once it is ready (the worker's ``info``)."""

    engine_id: str
    model: str
    max_model_len: int
    eos_token_ids: list[int]
    block_size: int
    num_device_blocks: int
    num_parameters: int
    device: str
    dtype: str
    dtype_reason: str
    tensor_parallel_size: int
    ranks: list[dict]
    pid: int
    tokenizer_class: str   # ``module:qualname`` of the tokenizer's class (``tokenizer_loading``)

    def body(self) -> bytes:
        return pack(dataclasses.astuple(self))

    @classmethod
    def from_body(cls, body) -> "CoreInfo":
        return cls(*unpack(body))


# Errors a reply may carry, rebuilt as their own type on the other side (others: RuntimeError).
def error_to_wire(error: BaseException) -> list:
    return [type(error).__name__, str(error)]


def error_from_wire(wire: list, known: dict[str, type] | None = None) -> BaseException:
    kind, message = wire
    known = {**_BUILTIN_ERRORS, **(known or {})}
    if kind in known:
        return known[kind](message)
    return RuntimeError(f"{kind}: {message}")


_BUILTIN_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError,
                   "TimeoutError": TimeoutError, "PermissionError": PermissionError}


__all__ = ["ZERO_COPY_BYTES", "AddRequest", "CoreInfo", "FromCore", "ToCore", "error_from_wire", "error_to_wire", "pack",
           "params_from_wire", "params_to_wire", "payload_from_frame", "unpack"]
