"""Speculative decoding: proposals verified by the target model in one forward pass.

``config`` (the validated ``speculative_config``, torch-free: the cluster's schema loads it),
``ngram_proposer`` (prompt lookup over a request's own tokens), ``verifier`` (acceptance:
greedy, and the rejection sampler for point-mass proposals) and ``speculator`` (the engine's
side: who proposes, the step's verification, the rollback of rejected tokens, the counters).
Runs in the engine core's process."""
