"""pagedserve: LLM serving on a Ray cluster, built around a paged KV cache.

``from pagedserve import LLM, SamplingParams`` is the offline API; both load
lazily so that ``import pagedserve`` stays cheap.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from pagedserve.workers.offline.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedserve.workers.sample.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
