"""Host (Python) cost of a decode step's engine side, before vs after persistent block tables.

B sequences decode at context L (block size 16): each step every sequence adds
one token, and the 1/16 of them that cross a block boundary gain a block. Both
variants run in the same process, interleaved step by step:

- ``before``: the forward's inputs as ``ModelRunner.execute`` built them up to
  commit 8a55c33 (every table padded and copied into a new tensor each step,
  kept here verbatim as the reference);
- ``after``: ``model_runner.flatten_chunks`` over persistent ``BlockTableRows``,
  given the KV manager's ``first_changed_block`` hint.

No model runs: this is the input building only (CPU tensors; on CUDA the
``after`` variant also updates the device copy).

    python benchmarks/bench_step_host.py [--batch 256] [--contexts 1024 4096 16384] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from pagedserve.workers.block_tables import BlockTableRows
from pagedserve.workers.model_runner import SeqChunk, flatten_chunks

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    results = {"load_average": os.getloadavg(), "device": str(device), "runs": []}
    for context in args.contexts:
        result = measure(args.batch, context, args.steps, device)
        results["runs"].append(result)
        print(f"B={result['batch']} L={context}: before {result['before_us']} us, after {result['after_us']} us "
              f"per step ({result['ratio']}x); table entries written per step: "
              f"{result['entries_written_per_step']:.0f} of {result['total_entries']}")
    print(f"load average {results['load_average']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
