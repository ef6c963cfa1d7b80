"""Shared output helpers: percentile summaries, JSON files, tables, progress bars."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

SUMMARY_PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, as numpy's default.

    NaN for an empty sequence, so a run without data shows as missing, not zero.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{"mean", "std", "p50", "p90", "p99"}`` of ``values`` (NaN when empty)."""
    values = list(values)
    if not values:
        return {"mean": math.nan, "std": math.nan, **{f"p{q}": math.nan for q in SUMMARY_PERCENTILES}}
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return {"mean": mean, "std": std, **{f"p{q}": percentile(values, q) for q in SUMMARY_PERCENTILES}}


def _json_safe(value):
    """NaN and infinities become null: they are not valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str | os.PathLike | None, data: dict) -> Path | None:
    """Write ``data`` as indented, strictly valid JSON (NaN becomes null); no-op for None."""
    if path is None:
        return None
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(data), indent=2, allow_nan=False) + "\n")
    return path


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain-text table with left-aligned columns (floats to 3 significant places)."""
    def cell(value: object) -> str:
        if isinstance(value, float):
            return "-" if not math.isfinite(value) else f"{value:.3g}"
        return str(value)

    text_rows = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text_rows)) if text_rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in text_rows]
    return "\n".join(lines)


def progress_bar(total: int | None, desc: str, unit: str = "req", disable: bool = False):
    """A tqdm progress bar on stderr; use it as a context manager and call ``update(n)``."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable,
                dynamic_ncols=True, leave=True)


@contextlib.contextmanager
def torch_threads(num_threads: int | None):
    """Run the block with torch's intra-op threads set to ``num_threads`` (0 or None:
    unchanged), then restore the previous count. Yields the count in use.

    Every engine in one benchmark runs with the same count. On a small shared
    machine one thread avoids OpenMP spin-waiting when other processes hold
    the cores, which otherwise slows a step many times over.
    """
    import torch

    if num_threads is not None and num_threads < 0:
        raise ValueError(f"num_threads must be >= 0, got {num_threads}")
    previous = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
