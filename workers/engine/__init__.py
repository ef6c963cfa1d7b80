"""The engine core: schedule -> forward -> sample -> finish checks, over the paged KV cache.

In a cluster it runs in a process of its own, one per worker, started and fed by the worker actor;
offline (``LLM``) and in tests it runs in the caller's process."""
