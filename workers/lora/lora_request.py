"""A request's adapter, as vLLM names it: ``LoRARequest(lora_name, lora_int_id, lora_path)``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Generate with the LoRA adapter at ``lora_path`` (a PEFT directory:
    ``adapter_config.json`` and ``adapter_model.safetensors``).

    ``lora_int_id`` (a positive int) identifies the adapter in the engine's caches, and
    with ``lora_name`` in the prefix cache (``cache_key``): one engine takes each id with one
    name and path. A name may take another id once its first is removed (a server unloads
    an adapter and loads another under its name): their cached blocks never mix. A bad
    field raises ValueError naming it.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name or "\x00" in self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string without NUL characters, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory, got {self.lora_path!r}")

    @property
    def cache_key(self) -> str:
        """What keys the adapter's blocks in the prefix cache: its id and name."""
        return f"{self.lora_int_id}:{self.lora_name}"
