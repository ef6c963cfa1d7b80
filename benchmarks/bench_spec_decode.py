"""Speculative decoding: output tok/s against the acceptance it gets, side by side on the CPU.

Acceptance is a property of trained models, and the random-weight ones here accept little.
So the mechanism is measured against a set acceptance: for each batch size of ``--batches``,
greedy requests (prompts of ``--prompt`` random tokens, ``--max-tokens`` outputs, EOS ignored)
run to the end

- on an engine without speculation (the baseline; its outputs are each request's output);
- on an engine with ``speculative_config`` (k = ``--k``) whose proposer is a
  ``ScriptedProposer`` with ``j`` of k tokens right, for each j of ``--right`` (mean
  acceptance length 1 + j, fewer where an output ends);
- on the same engine with its own n-gram proposer, on the random model's own output (greedy
  random models fall into loops that prompt lookup finds);
- on engines with a draft model (method "draft_model"), one per entry of ``--drafts``:
  "self" is the target as its own draft (every proposal right: the mechanism's cost and its
  ceiling), a size such as "small-draft" a random draft model of that size, and
  "small-eagle" a random EAGLE head (method "eagle") (nothing right: the proposer's cost,
  cut by the back-off).

Then the adaptive rule: ``--large-batch`` sequences with nothing right (acceptance 0), with
``disable_by_batch_size`` at ``--disable-at`` and without it, against the baseline; and a
random draft model of ``<size>-draft`` with ``disable_by_batch_size`` (its KV is computed only
for sequences that propose, so a batch that proposes nothing should not pay for it).

The contenders run in turns, ``--rounds`` times; each row is one run: output tok/s, its ratio
to the baseline's run of the same round, and the mean acceptance length it measured (vLLM's
``spec_decode`` counters: 1 + accepted / drafts). A scripted run with j >= 1 right verifies
every step, so its mean acceptance length over its speedup is what a verification step of
k + 1 tokens costs against a one-token step (the "verify step" column; on CUDA both replay CUDA
graphs, the verification step's padded to k + 1 query rows a sequence). Every run's outputs are
checked equal to the baseline's on the CPU in float32 (greedy speculation is exact); in half
precision on a GPU, where batching changes the rounding, the outputs are not compared.

    python benchmarks/bench_spec_decode.py [--size small --batches 1,4 --k 4 --right 0,1,2,3,4
                                            --drafts self,small-draft]
    python benchmarks/bench_spec_decode.py --size 1b --device cuda --dtype bfloat16 --batches 1,4,16
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.bench.scripted_proposer import ScriptedProposer
from pagedserve.devtools.model_factory import ensure_model

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens")


DEVICE = {"device": "cpu", "dtype": "float32"}   # set by --device and --dtype


def _engine(path: str, batch: int, prompt: int, max_tokens: int, speculative: dict | None) -> LLM:
    blocks = batch * -(-(prompt + max_tokens + 16) // 16) + 16
    options = dict(**DEVICE, swap_space_gb=0.01, max_num_seqs=max(batch, 1), block_size=16,
                   num_device_blocks=blocks, enable_prefix_caching=False, async_scheduling=False)
    if speculative is not None:
        options["speculative_config"] = speculative
    return LLM(path, **options)


def _run(llm: LLM, prompts, max_tokens: int, expected=None) -> tuple[float, float, list]:
    """(output tok/s, mean acceptance length (0: no drafts), outputs) of one run to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = llm.stats()
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.stats()
    outputs = [list(result.outputs[0].token_ids) for result in results]
    if expected is not None and DEVICE["dtype"] == "float32" and outputs != expected:
        raise AssertionError("speculative decoding changed a greedy output")
    llm.check_integrity()
    assert llm.engine.num_used_blocks() == 0
    drafts, accepted = (after.get(c, 0) - before.get(c, 0) for c in COUNTERS)
    return len(prompts) * max_tokens / elapsed, (1 + accepted / drafts) if drafts else 0.0, outputs


def _report(label: str, batch: int, rows: list[tuple[str, float, float, float]]) -> None:
    print(f"\n{label}, batch {batch}")
    print(f"{'contender':>28} {'tok/s':>9} {'vs baseline':>12} {'mean acceptance length':>23} {'verify step':>12}")
    for name, rate, ratio, acceptance in rows:
        shown = f"{acceptance:.2f}" if acceptance else "-"
        # Every step verifies (j >= 1 right, no back-off): acceptance / speedup = a verify step's cost.
        verify = f"{acceptance / ratio:.2f}x" if name.startswith("scripted") and acceptance > 1 else ""
        print(f"{name:>28} {rate:9.1f} {ratio:11.2f}x {shown:>23} {verify:>12}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--right", default="0,1,2,3,4", help="scripted proposals: right tokens of k")
    parser.add_argument("--large-batch", type=int, default=256, help="the adaptive rule's batch (0: skip)")
    parser.add_argument("--large-max-tokens", type=int, default=32)
    parser.add_argument("--disable-at", type=int, default=32, help="disable_by_batch_size at the large batch")
    parser.add_argument("--drafts", default=None,
                        help="draft models: self, or make-model sizes: <size>-draft, <size>-eagle, <size>-eagle3 "
                             "(default: self,<size>-draft,<size>-eagle)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    DEVICE.update(device=args.device, dtype=args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(ensure_model("llama", args.size))
    rng = random.Random(0)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    print(f"llama-{args.size} on {args.device} ({args.dtype}), prompts of {args.prompt} tokens, greedy, EOS ignored, "
          f"k = {args.k}, torch threads {torch.get_num_threads()}, {args.rounds} rounds, contenders in turns")

    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [[rng.randrange(5, 1024) for _ in range(args.prompt)] for _ in range(batch)]
        base = _engine(path, batch, args.prompt, args.max_tokens, None)
        speculating = _engine(path, batch, args.prompt, args.max_tokens, ngram)
        own = speculating.engine.speculator.proposer
        verify_graphs = speculating.engine.runner.verify_graphs
        print(f"batch {batch}: verification steps " + (
            f"replay CUDA graphs ({len(verify_graphs.graphs)} sizes up to {verify_graphs.max_size} sequences)"
            if verify_graphs is not None and verify_graphs.graphs else "run eagerly"))
        drafts = {}
        for draft in (args.drafts or f"self,{args.size}-draft,{args.size}-eagle").split(","):
            model = path if draft == "self" else str(ensure_model("llama", draft))
            method = next((m for m in ("eagle3", "eagle") if draft.endswith(f"-{m}")), "draft_model")
            drafts[draft] = _engine(path, batch, args.prompt, args.max_tokens,
                                    {"method": method, "model": model, "num_speculative_tokens": args.k})
        for llm in (base, speculating, *drafts.values()):
            _run(llm, prompts, 4)  # warm
        for round_index in range(args.rounds):
            base_rate, _, expected = _run(base, prompts, args.max_tokens)
            rows = [("no speculation", base_rate, 1.0, 0.0)]
            scripted = {tuple(p): o for p, o in zip(prompts, expected)}
            for right in [int(r) for r in args.right.split(",")]:
                speculating.engine.speculator.proposer = ScriptedProposer(
                    scripted, args.k, right, speculating.engine.runner.vocab_size, seed=round_index)
                rate, acceptance, _ = _run(speculating, prompts, args.max_tokens, expected)
                rows.append((f"scripted, {right} of {args.k} right", rate, rate / base_rate, acceptance))
            speculating.engine.speculator.proposer = own
            rate, acceptance, _ = _run(speculating, prompts, args.max_tokens, expected)
            rows.append(("n-gram, the model's output", rate, rate / base_rate, acceptance))
            for draft, llm in drafts.items():
                rate, acceptance, _ = _run(llm, prompts, args.max_tokens, expected)
                rows.append((f"draft model: {draft}", rate, rate / base_rate, acceptance))
            _report(f"round {round_index + 1}", batch, rows)
        del base, speculating, drafts

    if args.large_batch:
        batch, max_tokens = args.large_batch, args.large_max_tokens
        prompts = [[rng.randrange(5, 1024) for _ in range(args.prompt)] for _ in range(batch)]
        base = _engine(path, batch, args.prompt, max_tokens, None)
        always = _engine(path, batch, args.prompt, max_tokens, ngram)
        adaptive = _engine(path, batch, args.prompt, max_tokens, {**ngram, "disable_by_batch_size": args.disable_at})
        draft = _engine(path, batch, args.prompt, max_tokens,
                        {"method": "draft_model", "model": str(ensure_model("llama", f"{args.size}-draft")),
                         "num_speculative_tokens": args.k, "disable_by_batch_size": args.disable_at})
        for llm in (base, always, adaptive, draft):
            _run(llm, prompts, 4)
        for round_index in range(args.rounds):
            base_rate, _, expected = _run(base, prompts, max_tokens)
            rows = [("no speculation", base_rate, 1.0, 0.0)]
            scripted = {tuple(p): o for p, o in zip(prompts, expected)}
            for name, llm in ((f"disable_by_batch_size {args.disable_at}", adaptive), ("always on", always)):
                llm.engine.speculator.proposer = ScriptedProposer(scripted, args.k, 0, llm.engine.runner.vocab_size)
                rate, acceptance, _ = _run(llm, prompts, max_tokens, expected)
                rows.append((f"0 right, {name}", rate, rate / base_rate, acceptance))
            rate, acceptance, _ = _run(draft, prompts, max_tokens, expected)
            rows.append((f"draft model, disable_by_batch_size {args.disable_at}", rate, rate / base_rate, acceptance))
            _report(f"adaptive rule, round {round_index + 1}", batch, rows)


if __name__ == "__main__":
    main()
