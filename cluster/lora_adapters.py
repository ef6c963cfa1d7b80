"""The LoRA adapters a server offers by name (``LoRAAdapters``).

Two sources, as vLLM and Ray Serve LLM name them: the configuration's ``model.lora_modules``
(vLLM's ``--lora-modules``; ids 1, 2, ... in its order) and, with
``model.dynamic_lora_loading_path`` (Ray Serve LLM's key), any subdirectory of that directory
that holds a PEFT adapter, found on its first request. A dynamic adapter's id is derived from
its name, so every ingress replica gives it the same one without asking anybody: the engines
take each id with one name and path.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from pagedserve.workers.lora.lora_request import LoRARequest

# Dynamic adapters' ids start here, past any configured list's.
DYNAMIC_IDS_FROM = 1 << 32
# A dynamic adapter's name is one directory's name: no separators, no "..", no hidden entries.
_DYNAMIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
CONFIG_FILE = "adapter_config.json"


def dynamic_id(name: str) -> int:
    """The id of dynamic adapter ``name``: the same in every process."""
    return DYNAMIC_IDS_FROM + int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "big")


class LoRAAdapters:
    """The adapters requests may name: ``get(name)`` their ``LoRARequest`` (None: no such
    adapter), ``known()`` the configured ones and the dynamic ones found so far."""

    def __init__(self, modules: list = (), dynamic_path: str | None = None) -> None:
        self._known: dict[str, LoRARequest] = {module.name: LoRARequest(module.name, index + 1, module.path)
                                               for index, module in enumerate(modules)}
        self.dynamic_path = Path(dynamic_path) if dynamic_path else None

    def __bool__(self) -> bool:
        return bool(self._known) or self.dynamic_path is not None

    def known(self) -> dict[str, LoRARequest]:
        return dict(self._known)

    def get(self, name: str) -> LoRARequest | None:
        adapter = self._known.get(name)
        if adapter is None and self.dynamic_path is not None and _DYNAMIC_NAME.fullmatch(name) and ".." not in name:
            directory = self.dynamic_path / name
            if (directory / CONFIG_FILE).is_file():
                adapter = self._known[name] = LoRARequest(name, dynamic_id(name), str(directory))
        return adapter


__all__ = ["DYNAMIC_IDS_FROM", "LoRAAdapters", "dynamic_id"]
