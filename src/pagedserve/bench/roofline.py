"""A run's roofline: the least time its own steps could take on this device.

Each forward the engine runs is recorded by shape (tokens computed, rows sampled,
every chunk's context). A step cannot take less than the larger of its FLOPs at the
measured matmul rate and its bytes at the measured copy rate; the roofline is the sum
of that over the run's steps. FLOPs: 2 x decoder linear weights per token, 2 x LM head
weights per sampled row, 4 x attention width x layers per (query, key) pair attended.
Bytes: every weight read once a step, each chunk's context of K/V read once, and the
step's new K/V written. The decode steps (one new token per sequence) and the steps with
a prompt chunk are also summed apart, to set against the time the engine spent in each.

The roofline lets a step's matmuls (FLOP-bound from a few hundred tokens) overlap its
attention (bound by its K/V bytes), which kernels run one after another never do. The
serial floor bounds the two parts apart and adds them: per step, the larger of the
linear layers' FLOPs and the weights' bytes, plus the larger of the attention's FLOPs and
its K/V bytes. No engine that runs the parts as separate kernels goes below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepShapes:
    """Per recorded forward: sequences, tokens, sampled rows, (query, key) pairs, K/V
    positions read, and whether every sequence computed one token (a decode step)."""

    num_seqs: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_sampled: list[int] = field(default_factory=list)
    num_attended_pairs: list[int] = field(default_factory=list)
    num_kv_read: list[int] = field(default_factory=list)
    is_decode: list[bool] = field(default_factory=list)

    def add(self, model_input) -> None:
        starts = model_input.starts
        counts = model_input.num_tokens or [1] * len(starts)
        pairs = kv_read = 0
        for start, num in zip(starts, counts):
            end = start + num
            pairs += num * end - num * (num - 1) // 2   # query at position p sees p + 1 keys
            kv_read += end
        self.num_seqs.append(len(starts))
        self.num_tokens.append(sum(counts))
        self.num_sampled.append(len(starts) if model_input.logits_indexes is None
                                else len(model_input.logits_indexes))
        self.num_attended_pairs.append(pairs)
        self.num_kv_read.append(kv_read)
        self.is_decode.append(bool(model_input.is_decode_only))


def record_steps(runner) -> StepShapes:
    """Record the shape of every forward ``runner`` executes from now on."""
    shapes = StepShapes()
    execute = runner.execute

    def recording(model_input, *args, **kwargs):
        shapes.add(model_input)
        return execute(model_input, *args, **kwargs)

    runner.execute = recording
    return shapes


def roofline_seconds(shapes: StepShapes, *, num_linear: int, num_lm_head: int, num_layers: int,
                     attention_width: int, kv_bytes_per_token: int, weight_bytes: int,
                     matmul_flops_per_s: float, copy_bytes_per_s: float) -> dict:
    """The roofline of the recorded steps, how much of it is bound by FLOPs, and its share
    in the decode steps (with their mean sequences and K/V positions read) and the rest;
    the serial floor likewise."""
    total = flop_bound = decode = serial = serial_decode = 0.0
    for tokens, sampled, pairs, kv_read, is_decode in zip(
            shapes.num_tokens, shapes.num_sampled, shapes.num_attended_pairs, shapes.num_kv_read,
            shapes.is_decode):
        linear_flops = 2 * num_linear * tokens + 2 * num_lm_head * sampled
        attention_flops = 4 * attention_width * num_layers * pairs
        kv_bytes = kv_bytes_per_token * (kv_read + tokens)
        flop_seconds = (linear_flops + attention_flops) / matmul_flops_per_s
        byte_seconds = (weight_bytes + kv_bytes) / copy_bytes_per_s
        step = max(flop_seconds, byte_seconds)
        total += step
        decode += step if is_decode else 0.0
        flop_bound += flop_seconds if flop_seconds >= byte_seconds else 0.0
        serial_step = (max(linear_flops / matmul_flops_per_s, weight_bytes / copy_bytes_per_s)
                       + max(attention_flops / matmul_flops_per_s, kv_bytes / copy_bytes_per_s))
        serial += serial_step
        serial_decode += serial_step if is_decode else 0.0
    decode_steps = [i for i, is_decode in enumerate(shapes.is_decode) if is_decode]
    return {"seconds": total, "num_steps": len(shapes.num_tokens),
            "flop_bound_fraction": flop_bound / total if total else 0.0,
            "decode_seconds": decode, "mixed_seconds": total - decode,
            "serial_seconds": serial, "serial_decode_seconds": serial_decode,
            "serial_mixed_seconds": serial - serial_decode,
            "num_decode_steps": len(decode_steps),
            "decode_mean_seqs": _mean(shapes.num_seqs[i] for i in decode_steps),
            "decode_mean_kv_read": _mean(shapes.num_kv_read[i] for i in decode_steps)}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
