"""Development tools: ``make-model``'s random-weight checkpoints (``model_factory``), the
model-family matrix (``model_matrix``), and the audit of calls that would make the host
wait for a GPU (``device_waits``).

Nothing here serves requests; tests, benchmarks and the default configuration
use it to build small models offline and to check the step path without a GPU.
"""
