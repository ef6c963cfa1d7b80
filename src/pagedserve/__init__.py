"""pagedserve: LLM serving on a Ray cluster, built around a paged KV cache."""

__version__ = "0.1.0"
