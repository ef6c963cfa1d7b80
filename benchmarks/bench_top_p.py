"""Top-p sampling per step: this checkout's sampler against a baseline revision's.

A step of ``--rows`` random rows (temperature 0.8) samples with top-p, alone and with
top-k, from logits of two shapes: peaked (the 0.9 nucleus holds a few tokens, as a
trained model's mostly does) and flat (it holds thousands: random weights). The
baseline's ``workers/sample/sampler.py`` and ``sampling_params.py`` are extracted from
``--baseline`` into a temporary package; the contenders run in this process,
alternating, on the same logits with the same generator seed, and must sample the
same tokens (checked, reported as ``same_tokens``):

- ``before``: the baseline's ``Sampler.sample_tokens``;
- ``after``: this checkout's, as it runs on this device (on the CPU the search widens
  from 64 candidates, reading the logits as the baseline does);
- ``one_pass``: this checkout's with the one-pass search every other device runs (no
  read of the logits: a full sort, or the top-k's candidates), timed here too.

Two times per step, medians over ``--repeats``: ``launch`` is the host's time until
``sample_tokens`` returns (on a GPU a wait for the device shows here: the overlapped
engine plans the next step only after it), ``total`` adds waiting for the device to
finish (on the CPU the two are the same).

    python benchmarks/bench_top_p.py --baseline HEAD~1 [--device cuda] [--rows 256 --vocab 32000]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parent.parent


def load_baseline(revision: str, directory: Path):
    """The sampler module of ``revision``, imported as a package of its own."""
    package = directory / "baseline_sampler"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("sampler.py", "sampling_params.py"):
        text = subprocess.run(["git", "show", f"{revision}:workers/{name}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout
        (package / name).write_text(text)
    sys.path.insert(0, str(directory))
    return (importlib.import_module("baseline_sampler.sampler"),
            importlib.import_module("baseline_sampler.sampling_params"))


def make_logits(shape: str, rows: int, vocab: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    scale = {"peaked": 8.0, "flat": 1.0}[shape]
    return (torch.randn(rows, vocab, generator=generator) * scale).to(device)


def one_pass(module, is_on: bool):
    """Within it (if ``is_on``), ``module``'s top-p search takes one pass on every device."""
    if not is_on:
        return contextlib.nullcontext()
    return mock.patch.object(module, "_widening_top_p_thresholds", module.top_p_thresholds)


def time_step(sampler, logits: torch.Tensor, batch, device: str) -> tuple[float, float, torch.Tensor]:
    """(launch seconds, total seconds, ids) of one ``sample_tokens`` call."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    ids = sampler.sample_tokens(logits, batch)
    launch = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.synchronize()
    return launch, time.perf_counter() - start, ids


def nucleus_size(module, logits: torch.Tensor, params) -> float:
    """The mean number of tokens a row of ``logits`` samples from."""
    probs = module.processed_probs(logits.cpu(), [params] * logits.shape[0])
    return float((probs > 0).sum(dim=-1).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision whose sampler is the baseline")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedserve.workers.sample import sampler as current
    from pagedserve.workers.sample.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as directory:
        old, old_params = load_baseline(args.baseline, Path(directory))
        settings = {"top_p=0.9": {"temperature": 0.8, "top_p": 0.9},
                    "top_k=50, top_p=0.9": {"temperature": 0.8, "top_k": 50, "top_p": 0.9}}
        results = []
        for shape in ("peaked", "flat"):
            logits = make_logits(shape, args.rows, args.vocab, args.device)
            for label, options in settings.items():
                contenders = {}
                for name, module, params_cls in (("before", old, old_params.SamplingParams),
                                                 ("after", current, SamplingParams),
                                                 ("one_pass", current, SamplingParams)):
                    batch = module.SamplingBatch.from_params([params_cls(**options)] * args.rows)
                    contenders[name] = (module, batch)
                times = {name: ([], []) for name in contenders}
                same = True
                for repeat in range(args.repeats + 2):
                    ids = {}
                    for name, (module, batch) in contenders.items():
                        with one_pass(current, name == "one_pass"):
                            launch, total, ids[name] = time_step(module.Sampler(seed=repeat), logits, batch,
                                                                 args.device)
                        if repeat >= 2:   # warm-up
                            times[name][0].append(launch)
                            times[name][1].append(total)
                    same = same and all(torch.equal(ids["before"].cpu(), other.cpu()) for other in ids.values())
                row = {"logits": shape, "params": label, "rows": args.rows, "vocab": args.vocab,
                       "mean_nucleus": nucleus_size(current, logits[:16], SamplingParams(**options)),
                       "same_tokens": same}
                for name, (launches, totals) in times.items():
                    row[f"{name}_launch_ms"] = 1e3 * statistics.median(launches)
                    row[f"{name}_total_ms"] = 1e3 * statistics.median(totals)
                for name in ("after", "one_pass"):
                    row[f"{name}_total_ratio"] = row["before_total_ms"] / row[f"{name}_total_ms"]
                    row[f"{name}_launch_ratio"] = row["before_launch_ms"] / row[f"{name}_launch_ms"]
                results.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
