"""The output processor's CPU per engine step: served streams against offline final outputs.

``--streams`` greedy requests, each with one sample, decode ``--steps`` steps of one token; each
step's ``EngineStep`` goes through ``OutputProcessor.process``, as the engine core's loop does.
Served: every request has a ``StreamTarget`` (one output channel, text decoded by the handle,
as a served request's), and each step's ``StreamBatch`` is packed, as the core sends it.
Offline: ``output_kind="final"`` and no text, what ``LLM.generate`` asks. The two alternate
``--rounds`` times in this process; reported: µs per step and per token of each, and what
serving adds per step.

    python benchmarks/bench_output_processor.py [--streams 256] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from pagedserve import SamplingParams
from pagedserve.workers.engine.request import Request, Sequence
from pagedserve.workers.outputs.output_processor import EngineStep, OutputProcessor, StepTokens
from pagedserve.workers.outputs.sequence_stream import SequenceStream, UndecodedText
from pagedserve.workers.outputs.stream_batch import StreamTarget

PROMPT = [5, 6, 7, 8]
TOKEN = 7


def _sequences(num_streams: int, served: bool) -> list[Sequence]:
    seqs = []
    for i in range(num_streams):
        params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True, detokenize=False)
        request = Request(f"r{i}", None, list(PROMPT), params)
        if served:
            request.stream_target = StreamTarget("channel", i)
        else:
            request.output_kind = "final"
        seq = Sequence(f"r{i}#0", request, 0, list(PROMPT))
        seq.stream = SequenceStream(UndecodedText([]), 0)
        request.seqs.append(seq)
        seqs.append(seq)
    return seqs


def run(num_streams: int, num_steps: int, served: bool) -> tuple[float, int]:
    """µs of CPU per step (``time.thread_time``) of processing, and packing where served; and
    the rows the channel's batches carried (a stream's news of a step is a row)."""
    seqs = _sequences(num_streams, served)
    processor = OutputProcessor()
    token_ids = [TOKEN] * num_streams
    seconds, num_rows = 0.0, 0
    for _ in range(num_steps):
        for seq in seqs:   # the engine's part: not measured
            seq.append_token(TOKEN)
        start = time.thread_time()
        processor.process(EngineStep([StepTokens(seqs, token_ids)]))
        batches = processor.take_batches().values()
        for batch in batches:
            batch.pack()
        seconds += time.thread_time() - start
        num_rows += sum(len(batch) for batch in batches)
    return 1e6 * seconds / num_steps, num_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for round_index in range(args.rounds):
        offline, _ = run(args.streams, args.steps, served=False)
        served, _ = run(args.streams, args.steps, served=True)
        print(f"round {round_index + 1}: {args.streams} streams, per step (per token): served "
              f"{served:.0f} us ({served / args.streams:.2f}), offline {offline:.0f} us "
              f"({offline / args.streams:.2f}); serving adds {served - offline:.0f} us a step", flush=True)


if __name__ == "__main__":
    main()
