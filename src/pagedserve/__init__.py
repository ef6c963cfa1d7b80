"""pagedserve: LLM serving on a Ray cluster, built around a paged KV cache.

``from pagedserve import LLM, SamplingParams, BeamSearchParams, LoRARequest`` is the offline API; the
names load lazily so that ``import pagedserve`` stays cheap.
"""

from pagedserve import shadowing

shadowing.install()

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "LoRARequest", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from pagedserve.workers.offline.llm import LLM

        return LLM
    if name in ("SamplingParams", "BeamSearchParams"):
        from pagedserve.workers.sample import sampling_params

        return getattr(sampling_params, name)
    if name == "LoRARequest":
        from pagedserve.workers.lora.lora_request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
