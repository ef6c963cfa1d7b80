"""The LoRA adapters a server offers by name (``LoRAAdapters``).

Three sources, as vLLM and Ray Serve LLM name them: the configuration's ``model.lora_modules``
(vLLM's ``--lora-modules``; ids 1, 2, ... in its order); with
``model.dynamic_lora_loading_path`` (Ray Serve LLM's key: a directory, a hub repo or a URI
such as ``s3://bucket/adapters``; ``workers/lora/adapter_source.py``), any folder of it named
after the adapter that holds a PEFT adapter, found on its first request; and adapters loaded at run time
(vLLM's ``/v1/load_lora_adapter``), which the cluster controller holds for every replica.
A dynamic adapter's id is derived from its name, so every ingress replica gives it the same
one without asking anybody: the engines take each id with one name and path. A run-time
adapter's id is drawn at random once per load (``runtime_id``), so an adapter unloaded and
loaded again from another path never meets the first one's cached blocks or host copy.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading

from pagedserve.workers.lora.adapter_source import DynamicAdapters
from pagedserve.workers.lora.lora_request import LoRARequest

# Dynamic adapters' ids start here, past any configured list's; run-time ones past those.
DYNAMIC_IDS_FROM = 1 << 32
RUNTIME_IDS_FROM = 1 << 56
# A dynamic adapter's name is one directory's name: no separators, no "..", no hidden entries.
_DYNAMIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def dynamic_id(name: str) -> int:
    """The id of dynamic adapter ``name``: the same in every process."""
    return DYNAMIC_IDS_FROM + int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "big")


class AdapterNotFound(LookupError):
    """No adapter by that name (vLLM's wording, its 404)."""


class AdapterNameError(ValueError):
    """A name an adapter cannot take: another adapter's, or the base model's."""


def runtime_id() -> int:
    """A fresh id for an adapter loaded at run time."""
    return RUNTIME_IDS_FROM + secrets.randbits(48)


class LoRAAdapters:
    """The adapters requests may name: ``get(name)`` their ``LoRARequest`` (None: no such
    adapter), ``known()`` the configured ones, the run-time ones and the dynamic ones found
    so far. Run-time adapters come as the controller's whole set (``set_runtime``)."""

    def __init__(self, modules: list = (), dynamic_path: str | None = None) -> None:
        self._configured: dict[str, LoRARequest] = {module.name: LoRARequest(module.name, index + 1, module.path)
                                                    for index, module in enumerate(modules)}
        self._dynamic: dict[str, LoRARequest] = {}
        self._runtime: dict[str, LoRARequest] = {}
        self.runtime_version = -1
        self.dynamic = DynamicAdapters(dynamic_path) if dynamic_path else None
        self._lock = threading.Lock()   # set_runtime runs on the controller view's thread

    def __bool__(self) -> bool:
        return bool(self._configured) or bool(self._runtime) or self.dynamic is not None

    def known(self) -> dict[str, LoRARequest]:
        with self._lock:
            known = dict(self._configured)
            for adapters in (self._runtime, self._dynamic):
                known.update({name: adapter for name, adapter in adapters.items() if name not in known})
            return known

    def source(self, name: str) -> str | None:
        """Where adapter ``name`` comes from: "lora_modules", "runtime", "dynamic_lora_loading_path"
        or None (unknown, or not yet found in the dynamic directory)."""
        for source, adapters in (("lora_modules", self._configured), ("runtime", self._runtime),
                                 ("dynamic_lora_loading_path", self._dynamic)):
            if name in adapters:
                return source
        return None

    def get(self, name: str) -> LoRARequest | None:
        adapter = self._configured.get(name) or self._runtime.get(name) or self._dynamic.get(name)
        if adapter is None and self.dynamic is not None and _DYNAMIC_NAME.fullmatch(name) and ".." not in name:
            lora_path = self.dynamic.lora_path(name)   # AdapterSourceError: the place cannot be read
            if lora_path is not None:
                adapter = self._dynamic[name] = LoRARequest(name, dynamic_id(name), lora_path)
        return adapter

    def set_runtime(self, version: int, adapters: dict[str, tuple[int, str]]) -> None:
        """The run-time adapters as of the controller's ``version``: name -> (id, path). An
        older version than the one held changes nothing."""
        with self._lock:
            if version < self.runtime_version:
                return
            self._runtime = {name: LoRARequest(name, lora_int_id, path)
                             for name, (lora_int_id, path) in adapters.items()}
            self.runtime_version = version


__all__ = ["DYNAMIC_IDS_FROM", "RUNTIME_IDS_FROM", "AdapterNameError", "AdapterNotFound", "LoRAAdapters", "dynamic_id", "runtime_id"]
