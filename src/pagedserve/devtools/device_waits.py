"""Find, without a GPU, the calls that would make the host wait for one.

On CUDA a step launches its work and returns; the host should wait only where it
reads results (overlapped scheduling depends on it, and a CUDA graph cannot
capture a wait at all). ``torch.cuda.set_sync_debug_mode`` finds waits, but only
on a GPU. ``DeviceWaitAudit`` finds them from the calls themselves, on any
device, while the audited code runs:

* **reads**: an op whose result needs a value of a tensor on ``device``:
  ``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``, ``.numpy()``, ``.cpu()``,
  and the ops whose output shape depends on the values (``nonzero``,
  ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``);
* **blocking copies**: a copy between the host and ``device`` without
  ``non_blocking=True`` (``Tensor.to``, ``Tensor.copy_``, ``Tensor.cuda``);
  ``torch.tensor``/``torch.as_tensor`` of Python data made on ``device``; and
  indexing a tensor on ``device`` with a Python list or a host tensor, which
  torch uploads with a blocking copy (upload the index without blocking first).

Watching ``device="meta"`` is exact: tensors that would live on the GPU live on
meta, host tensors on the CPU. Watching ``device="cpu"`` treats every tensor as
a device tensor, which fits code that only touches device tensors (a model's
forward); there a copy "to the device" is any ``.to``/``torch.tensor`` that
pagedserve code points at ``device`` explicitly. Ops that Triton's CPU
interpreter runs on a kernel's behalf are not the audited code's and are skipped.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that read values of their input on the host (the first two back .item()/bool()),
# or whose output's size depends on those values.
_READING_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero", "aten::nonzero_static",
    "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
})
_READING_METHODS = frozenset({"tolist", "numpy", "cpu"})
_COPY_METHODS = frozenset({"to", "cuda", "copy_"})
_FACTORIES = frozenset({"tensor", "as_tensor"})
_INDEXING = frozenset({"__getitem__", "__setitem__"})


@dataclass(frozen=True)
class DeviceWait:
    """One call that would wait for the device: ``kind`` is "read" or "blocking copy",
    ``op`` the op or method, ``where`` the innermost pagedserve frame (module:line) that
    led to it, or the innermost frame outside torch when none did."""

    kind: str
    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind} {self.op} at {self.where}"


class DeviceWaitAudit:
    """``with DeviceWaitAudit(device) as audit: ...``; then ``audit.waits`` lists what
    would have waited for ``device``. ``reads=False`` records blocking copies only: for
    code that also works on host tensors, which on the CPU look like device ones."""

    def __init__(self, device: torch.device | str, reads: bool = True) -> None:
        self.device = torch.device(device)
        self.reads = reads
        self.waits: list[DeviceWait] = []
        self._function_mode = _CopyAndReadCalls(self)
        self._dispatch_mode = _ReadingOps(self)

    def __enter__(self) -> "DeviceWaitAudit":
        self._function_mode.__enter__()
        self._dispatch_mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._dispatch_mode.__exit__(*exc)
        self._function_mode.__exit__(*exc)

    def summary(self) -> list[str]:
        """Each distinct wait once, with how often it happened, most frequent first."""
        counts: dict[DeviceWait, int] = {}
        for wait in self.waits:
            counts[wait] = counts.get(wait, 0) + 1
        return [f"{n}x {wait}" for wait, n in sorted(counts.items(), key=lambda item: -item[1])]

    # ---- used by the modes -----------------------------------------------------------------
    def is_watched(self, device: torch.device | str | None) -> bool:
        if device is None:
            return False
        device = torch.device(device)
        return device.type == self.device.type and (self.device.index is None or device.index == self.device.index)

    def record(self, kind: str, op: str) -> None:
        """Note a wait of the audited code (what Triton's interpreter runs is not its own)."""
        if kind == "read" and not self.reads:
            return
        ours, in_triton, outside = _callers()
        if not in_triton:
            self.waits.append(DeviceWait(kind, op, ours or outside or "?"))


def _callers() -> tuple[str | None, bool, str | None]:
    """(innermost pagedserve frame, whether Triton's interpreter is on the stack, innermost
    frame outside torch and this module)."""
    frame = sys._getframe(1)
    ours = outside = None
    in_triton = False
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("triton"):
            in_triton = True
        elif ours is None and module.startswith("pagedserve") and module != __name__:
            ours = f"{module}:{frame.f_lineno}"
        if outside is None and not module.startswith(("torch", "triton", __name__)):
            outside = f"{module}:{frame.f_lineno}"
        frame = frame.f_back
    return ours, in_triton, outside


def _called_from_pagedserve() -> bool:
    """Whether the innermost frame outside torch (the call's own caller) is pagedserve code."""
    outside = _callers()[2]
    return outside is not None and outside.startswith("pagedserve")


def _tensor_devices(values) -> list[torch.device]:
    devices = []
    for value in values:
        if isinstance(value, torch.Tensor):
            devices.append(value.device)
        elif isinstance(value, (list, tuple)):
            devices.extend(_tensor_devices(value))
    return devices


def _target_device(args, kwargs) -> torch.device | None:
    """The device a ``Tensor.to``/``torch.tensor`` call names, if it names one."""
    device = kwargs.get("device")
    if device is None:
        for value in args:
            if isinstance(value, (torch.device, str)):
                try:
                    device = torch.device(value)
                except RuntimeError:
                    continue
                break
            if isinstance(value, torch.Tensor):  # .to(other): other's device
                device = value.device
                break
    return torch.device(device) if device is not None else None


def _indexes_from_host(index) -> bool:
    """Whether an index holds a list or a host tensor (torch uploads it, blocking)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, list) or (isinstance(part, torch.Tensor) and part.device.type == "cpu"
                                          and part.dim() > 0) for part in parts)


class _ReadingOps(TorchDispatchMode):
    def __init__(self, audit: DeviceWaitAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        reads = name in _READING_OPS or (name == "aten::repeat_interleave" and kwargs.get("output_size") is None
                                         and isinstance(args[0], torch.Tensor) and len(args) == 1)
        if reads and any(self.audit.is_watched(d) for d in _tensor_devices([*args, *kwargs.values()])):
            self.audit.record("read", name.removeprefix("aten::"))
        return func(*args, **kwargs)


class _CopyAndReadCalls(TorchFunctionMode):
    def __init__(self, audit: DeviceWaitAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READING_METHODS or name in _COPY_METHODS or name in _FACTORIES or name in _INDEXING:
            kind = self._classify(func, name, args, kwargs)
            if kind is not None:
                self.audit.record(kind, name)
        return func(*args, **kwargs)

    def _classify(self, func, name: str, args, kwargs) -> str | None:
        audit = self.audit
        watching_host = audit.device.type == "cpu"
        if name in _FACTORIES:
            if func not in (torch.tensor, torch.as_tensor):
                return None
            target = _target_device(args[1:], kwargs)
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if target is None or not audit.is_watched(target) or (source is not None and source.device == target):
                return None
            if watching_host and not _called_from_pagedserve():
                return None
            return "blocking copy"
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is None:
            return None
        if name in _INDEXING:
            if watching_host or not audit.is_watched(tensor.device) or len(args) < 2:
                return None
            return "blocking copy" if _indexes_from_host(args[1]) else None
        if name in _READING_METHODS:
            if name == "cpu" and watching_host:
                return None
            return "read" if audit.is_watched(tensor.device) else None
        non_blocking = kwargs.get("non_blocking", False) or any(a is True for a in args[1:])
        if non_blocking:
            return None
        if name == "copy_":
            source = args[1] if len(args) > 1 else kwargs.get("src")
            if not isinstance(source, torch.Tensor) or source.device == tensor.device:
                return None
            return "blocking copy" if audit.is_watched(source.device) or audit.is_watched(tensor.device) else None
        target = torch.device("cuda") if name == "cuda" else _target_device(args[1:], kwargs)
        if target is None:
            return None
        if target.type != tensor.device.type:
            return "blocking copy" if audit.is_watched(target) or audit.is_watched(tensor.device) else None
        # Watching the host: an explicit .to(device) in pagedserve code is meant as an upload.
        if watching_host and audit.is_watched(target) and _called_from_pagedserve():
            return "blocking copy"
        return None


__all__ = ["DeviceWait", "DeviceWaitAudit"]
