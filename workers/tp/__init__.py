"""Tensor parallelism: one worker spanning several devices. Rank 0's runner lives in the engine core
process and drives ranks 1 and up, each a process (or Ray actor) of its own."""
