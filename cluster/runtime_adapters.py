"""The LoRA adapters loaded at run time (vLLM's ``/v1/load_lora_adapter``), as the cluster
controller holds them for every ingress replica.

One registry per cluster: name -> (lora_int_id, path), and a version that grows with every
change. Replicas read the version in the controller's health report and fetch the set when it
moved (``controller.HealthView``). The registry is stored in Ray's GCS key-value store on
every change, so a restarted controller (a restartable actor) starts from it.
"""

from __future__ import annotations

import json
import logging
import threading

logger = logging.getLogger("pagedserve.cluster")

STORE_KEY = "pagedserve:runtime_lora_adapters"


class RuntimeAdapterRegistry:
    """Names of run-time adapters, their ids and paths. ``store``: persist to Ray's GCS
    (``namespace`` its key's namespace); off, the registry lives only in this process."""

    def __init__(self, namespace: str | None = None, store: bool = True) -> None:
        self._namespace = namespace
        self._store = store
        self._lock = threading.Lock()
        self.version = 0
        self._adapters: dict[str, tuple[int, str]] = {}
        if store:
            self._restore()

    def snapshot(self) -> tuple[int, dict[str, tuple[int, str]]]:
        with self._lock:
            return self.version, dict(self._adapters)

    def add(self, name: str, lora_int_id: int, path: str) -> tuple[int, dict[str, tuple[int, str]]] | None:
        """Register ``name``; None (nothing changed) if it is registered already."""
        with self._lock:
            if name in self._adapters:
                return None
            self._adapters[name] = (lora_int_id, path)
            self.version += 1
            self._persist()
            return self.version, dict(self._adapters)

    def remove(self, name: str) -> tuple[int, dict[str, tuple[int, str]], int] | None:
        """Forget ``name``: (version, adapters, its id); None if it is not registered."""
        with self._lock:
            entry = self._adapters.pop(name, None)
            if entry is None:
                return None
            self.version += 1
            self._persist()
            return self.version, dict(self._adapters), entry[0]

    def _persist(self) -> None:
        if not self._store:
            return
        from ray.experimental.internal_kv import _internal_kv_put

        body = json.dumps({"version": self.version, "adapters": self._adapters})
        try:
            _internal_kv_put(STORE_KEY, body, overwrite=True, namespace=self._namespace)
        except Exception as exc:   # kept in memory; a controller restart would forget the change
            logger.warning("could not store the run-time LoRA adapters in Ray's GCS: %r", exc)

    def _restore(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_get

        try:
            body = _internal_kv_get(STORE_KEY, namespace=self._namespace)
        except Exception as exc:
            logger.warning("could not read the run-time LoRA adapters from Ray's GCS: %r", exc)
            return
        if body:
            stored = json.loads(body)
            self.version = stored["version"]
            self._adapters = {name: (int(lora_int_id), path) for name, (lora_int_id, path) in stored["adapters"].items()}
            logger.info("%d run-time LoRA adapter(s) restored (version %d)", len(self._adapters), self.version)


__all__ = ["RuntimeAdapterRegistry"]
