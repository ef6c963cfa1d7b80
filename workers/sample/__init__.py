"""Sampling: parameters, the batched sampler, per-row features (penalties, grammars, logprobs),
and beam search. Runs in the engine core's process."""
