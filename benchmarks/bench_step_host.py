"""Host (Python) cost of a decode step's engine side, before vs after: O(total blocks and
tokens) per step vs O(what changed).

B sequences decode at context L (block size 16): each step every sequence adds
one token, and the 1/16 of them that cross a block boundary gain a block. Both
variants run in the same process, interleaved step by step. Two parts:

- inputs: ``before`` is the forward's input building of ``ModelRunner.execute``
  up to commit 8a55c33 (every table padded and copied into a new tensor each
  step, kept here verbatim); ``after`` is ``model_runner.flatten_chunks`` over
  persistent ``BlockTableRows`` with the KV manager's ``first_changed_block``.
  No model runs (CPU tensors; on CUDA ``after`` also updates the device copy).
- outputs (L output tokens each, logprobs on): the engine's per-step outputs
  and the handle's ``OutputAccumulator`` fed through ``DeltaEncoder``.
  ``before`` copies what the code up to 8a55c33 copied per output (the output
  tokens sliced from the sequence's tokens six times, logprobs, the streamed
  text; the accumulator's cumulative lists and text); ``after`` runs the real
  ``LLMEngine._make_output``, ``DeltaEncoder`` and ``OutputAccumulator``.

    python benchmarks/bench_step_host.py [--batch 256] [--contexts 1024 4096 16384] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from pagedserve.workers.accumulator import OutputAccumulator
from pagedserve.workers.block_tables import BlockTableRows
from pagedserve.workers.engine import LLMEngine
from pagedserve.workers.model_runner import SeqChunk, flatten_chunks
from pagedserve.workers.protocol import DeltaEncoder
from pagedserve.workers.request import Request, Sequence
from pagedserve.workers.sampler import SampleLogprobs
from pagedserve.workers.sampling_params import SamplingParams

BLOCK_SIZE = 16


def inputs_before(chunks: list[SeqChunk], block_size: int):
    """The input building of ``ModelRunner.execute`` at 8a55c33 (reference copy)."""
    input_ids: list[int] = []
    positions: list[int] = []
    cu_seqlens = [0]
    seq_lens = []
    logits_rows = []
    max_blocks = max(len(c.block_table) for c in chunks)
    padded_tables = []
    for chunk in chunks:
        num = len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start, chunk.start + num))
        cu_seqlens.append(cu_seqlens[-1] + num)
        seq_lens.append(chunk.start + num)
        padded_tables.append(list(chunk.block_table) + [0] * (max_blocks - len(chunk.block_table)))
        if chunk.needs_logits:
            logits_rows.append(cu_seqlens[-1] - 1)
    tables = torch.tensor(padded_tables, dtype=torch.int32)
    pos = torch.tensor(positions, dtype=torch.int64)
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    seq_index = torch.repeat_interleave(torch.arange(len(chunks)), cu[1:] - cu[:-1])
    slot_mapping = tables[seq_index, pos // block_size].to(torch.int64) * block_size + pos % block_size
    return tables, slot_mapping, torch.tensor(input_ids), torch.tensor(seq_lens)


class DecodingBatch:
    """B sequences at about ``context`` tokens, with lengths staggered so that
    1/16 of them gain a block each step."""

    def __init__(self, batch: int, context: int) -> None:
        self.lengths = [context - BLOCK_SIZE + 1 + i % BLOCK_SIZE for i in range(batch)]
        self.tables = [list(range(i * 4096, i * 4096 + -(-n // BLOCK_SIZE))) for i, n in enumerate(self.lengths)]
        self.first_changed = [0] * batch

    def next_step(self) -> list[SeqChunk]:
        chunks = []
        for i, table in enumerate(self.tables):
            self.lengths[i] += 1
            num_blocks = len(table)
            if self.lengths[i] > num_blocks * BLOCK_SIZE:
                table.append(table[-1] + 1)
            chunks.append(SeqChunk([7], self.lengths[i] - 1, table, True, f"s{i}", self.first_changed[i]))
            self.first_changed[i] = len(table)  # unchanged next step unless a block is added
        return chunks


def measure(batch: int, context: int, steps: int, device: torch.device) -> dict:
    before_batch, after_batch = DecodingBatch(batch, context), DecodingBatch(batch, context)
    rows = BlockTableRows(device)
    flatten_chunks(after_batch.next_step(), rows, BLOCK_SIZE)  # rows filled once (admission)
    before_batch.next_step()
    num_admission_entries = rows.num_entries_written
    times = {"before": [], "after": []}
    for _ in range(steps):
        chunks = before_batch.next_step()
        start = time.perf_counter()
        tables, *_ = inputs_before(chunks, BLOCK_SIZE)
        tables.to(device)
        times["before"].append(time.perf_counter() - start)
        chunks = after_batch.next_step()
        start = time.perf_counter()
        flatten_chunks(chunks, rows, BLOCK_SIZE)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times["after"].append(time.perf_counter() - start)
    before, after = (1e6 * statistics.median(times[k]) for k in ("before", "after"))
    return {"batch": batch, "context": context, "before_us": round(before), "after_us": round(after),
            "ratio": round(before / after, 1), "entries_written_per_step": (rows.num_entries_written - num_admission_entries) / steps,
            "total_entries": sum(len(t) for t in after_batch.tables)}


class _Detokenizer:
    """The fields ``_make_output`` reads of a ``StreamingDetokenizer``."""

    finish_reason = None
    stop_reason = None

    def __init__(self) -> None:
        self.output_text = ""

    @property
    def streamed_text(self) -> str:
        return self.output_text[:len(self.output_text)]


class DecodingOutputs:
    """B single-sample requests with ``num_outputs`` tokens, text and logprobs each."""

    PROMPT = list(range(16))

    def __init__(self, batch: int, num_outputs: int) -> None:
        params = SamplingParams(max_tokens=1 << 20, logprobs=1)
        self.logprob = SampleLogprobs(7, -0.5, [(7, -0.5)])
        self.requests = []
        for i in range(batch):
            request = Request(f"r{i}", None, self.PROMPT, params)
            seq = Sequence(f"r{i}#0", request, 0, list(self.PROMPT), _Detokenizer())
            request.seqs.append(seq)
            for _ in range(num_outputs):
                self._sample(seq)
            seq.streamed_text_pieces.append(seq.detokenizer.output_text)
            seq.num_streamed_tokens = len(seq.output_token_ids)
            self.requests.append(request)
        self.encoders = [DeltaEncoder() for _ in self.requests]
        self.accumulators = [OutputAccumulator(r.request_id, None, self.PROMPT) for r in self.requests]
        self.old_accumulated = [([], "", []) for _ in self.requests]

    def _sample(self, seq: Sequence) -> None:
        seq.append_token(7)
        seq.logprobs.append(self.logprob)
        seq.detokenizer.output_text += "abcd"
        seq.delta_text += "abcd"

    def next_step(self) -> None:
        for request in self.requests:
            self._sample(request.seqs[0])

    def outputs_before(self) -> None:
        """What the code up to 8a55c33 copied per step and sequence (engine, then handle)."""
        for i, request in enumerate(self.requests):
            seq = request.seqs[0]
            num_prompt = seq.num_prompt_tokens
            for _ in range(3):  # _postprocess: SamplingState, _banned_token_ids, the metrics' count
                seq.token_ids[num_prompt:]
            new_tokens = seq.token_ids[num_prompt:][seq.num_streamed_tokens:]
            seq.num_streamed_tokens = len(seq.token_ids[num_prompt:])
            token_ids, logprobs = list(seq.token_ids[num_prompt:]), list(seq.logprobs)
            text = seq.detokenizer.streamed_text
            delta_logprobs = seq.logprobs[len(seq.logprobs) - len(new_tokens):]
            seq.delta_text = ""
            accumulated_ids, accumulated_text, accumulated_logprobs = self.old_accumulated[i]
            accumulated_ids.extend(new_tokens)
            accumulated_logprobs.extend(delta_logprobs)
            accumulated_text += "abcd"
            self.old_accumulated[i] = (accumulated_ids, accumulated_text, accumulated_logprobs)
            list(accumulated_ids), list(accumulated_logprobs)
            del token_ids, logprobs, text

    def outputs_after(self) -> None:
        for request, encoder, accumulator in zip(self.requests, self.encoders, self.accumulators):
            seq = request.seqs[0]
            request.metrics.num_generated_tokens = len(seq.output_token_ids)
            accumulator.add(encoder.encode(LLMEngine._make_output(None, request)))


def measure_outputs(batch: int, num_outputs: int, steps: int) -> dict:
    before_state, after_state = DecodingOutputs(batch, num_outputs), DecodingOutputs(batch, num_outputs)
    times = {"before": [], "after": []}
    for _ in range(steps):
        before_state.next_step()
        start = time.perf_counter()
        before_state.outputs_before()
        times["before"].append(time.perf_counter() - start)
        after_state.next_step()
        start = time.perf_counter()
        after_state.outputs_after()
        times["after"].append(time.perf_counter() - start)
    before, after = (1e6 * statistics.median(times[k]) for k in ("before", "after"))
    return {"batch": batch, "output_tokens": num_outputs, "before_us": round(before), "after_us": round(after),
            "ratio": round(before / after, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--parts", nargs="+", default=["inputs", "outputs"], choices=["inputs", "outputs"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    results = {"load_average_start": os.getloadavg(), "device": str(device), "inputs": [], "outputs": []}
    for context in args.contexts if "inputs" in args.parts else []:
        result = measure(args.batch, context, args.steps, device)
        results["inputs"].append(result)
        print(f"inputs  B={result['batch']} L={context}: before {result['before_us']} us, after "
              f"{result['after_us']} us per step ({result['ratio']}x); table entries written per step: "
              f"{result['entries_written_per_step']:.0f} of {result['total_entries']}")
    for context in args.contexts if "outputs" in args.parts else []:
        result = measure_outputs(args.batch, context, args.steps)
        results["outputs"].append(result)
        print(f"outputs B={result['batch']} L={context}: before {result['before_us']} us, after "
              f"{result['after_us']} us per step ({result['ratio']}x)")
    results["load_average_end"] = os.getloadavg()
    print(f"load average at start {results['load_average_start']}, at end {results['load_average_end']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
