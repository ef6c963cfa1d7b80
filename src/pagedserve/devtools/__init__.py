"""Development tools: ``make-model``'s random-weight checkpoints (``model_factory``).

Nothing here serves requests; tests, benchmarks and the default configuration
use it to build small models offline.
"""
