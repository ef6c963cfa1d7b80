"""The cluster layer: config, Ray actors, routing, and the entry point ``start``."""

from .config import ClusterConfig, load_config

__all__ = ["ClusterConfig", "ClusterHandle", "load_config", "start"]


def __getattr__(name):
    if name == "start":
        from .bootstrap import start

        return start
    if name == "ClusterHandle":
        from .handle import ClusterHandle

        return ClusterHandle
    raise AttributeError(f"module 'pagedserve.cluster' has no attribute {name!r}")
