"""vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

Open only with ``model.allow_runtime_lora_updating`` (vLLM opens them with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; closed, they answer 404 naming the key), and behind
the API key like every route. A load has every routable worker check the adapter against
its model and read it, then registers it with the cluster controller: the replica that
answered serves it at once, the others from their next health report (a quarter of a
second). Answers are vLLM's: plain-text success lines; a 400 for a taken name or an adapter
that cannot be served (the reason named), a 404 for an unload of an unknown name.
"""

from __future__ import annotations

from pagedserve.workers.lora.lora_request import LoRARequest

from ..lora_adapters import AdapterNameError, AdapterNotFound
from .errors import APIError
from .frontend import Frontend
from .protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

RUNTIME_UPDATING_KEY = "model.allow_runtime_lora_updating"


class ServingLoRA:
    """Answers the adapter routes for one ``Frontend``."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        model = getattr(getattr(frontend.handle, "config", None), "model", None)
        self.is_open = bool(getattr(model, "allow_runtime_lora_updating", False))

    def _check_open(self) -> None:
        if not self.is_open:
            raise APIError(404, f"runtime LoRA updating is off: set {RUNTIME_UPDATING_KEY} "
                                "(--allow-runtime-lora-updating) to load and unload adapters",
                           "NotFoundError", code="not_found")

    async def load(self, request: LoadLoRAAdapterRequest) -> str:
        self._check_open()
        try:
            await self.frontend.handle.load_lora_adapter(request.lora_name, request.lora_path)
        except ValueError as exc:
            param = "lora_name" if isinstance(exc, AdapterNameError) else "lora_path"
            raise APIError(400, str(exc), "InvalidUserInput", param=param) from None
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload(self, request: UnloadLoRAAdapterRequest) -> str:
        self._check_open()
        adapter: LoRARequest | None = self.frontend.adapters.get(request.lora_name)
        if request.lora_int_id is not None and adapter is not None and adapter.lora_int_id != request.lora_int_id:
            raise APIError(400, f"lora_int_id {request.lora_int_id} is not adapter '{request.lora_name}''s "
                                f"({adapter.lora_int_id})", "InvalidUserInput", param="lora_int_id")
        try:
            await self.frontend.handle.unload_lora_adapter(request.lora_name)
        except AdapterNotFound as exc:
            raise APIError(404, str(exc), "NotFoundError", param="lora_name", code="not_found") from None
        except ValueError as exc:
            raise APIError(400, str(exc), "InvalidUserInput", param="lora_name") from None
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."


__all__ = ["ServingLoRA"]
