"""The worker actor: one per GPU (or CPU slot), the worker's face to the cluster.

Runs in the Ray actor's process: Ray calls, the output channels to handles, KV events to the
central manager, health, drain, migration and stats. The model runs in the worker's engine core
process (``workers.engine``), which this process starts and talks to in bulk."""
