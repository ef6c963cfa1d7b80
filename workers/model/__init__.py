"""Model execution on the device: the runner, attention, CUDA graphs, the persistent batch,
block tables and KV cache tensors. Runs in the engine core's process."""
