"""From sampled token ids to what callers see: the output processor (text, stop strings), the
incremental detokenizer, and the accumulator that rebuilds cumulative outputs from deltas."""
