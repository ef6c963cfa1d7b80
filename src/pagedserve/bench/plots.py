"""PNG plots for benchmark results: CDFs, lines over time, comparison bars.

Each function draws one figure with a subplot per panel and writes it to
``path``. They use matplotlib's object API (``Figure``) with the Agg
renderer, so no display and no pyplot global state are involved.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

Series = Mapping[str, Sequence[float]]


def _figure(num_panels: int, title: str, panel_width: float = 4.8, height: float = 3.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(panel_width * num_panels, height), layout="constrained")
    axes = fig.subplots(1, num_panels, squeeze=False)[0]
    fig.suptitle(title)
    return fig, axes


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def plot_cdfs(panels: Mapping[str, Series], path: str | os.PathLike, title: str,
              xlabel: str = "seconds") -> Path:
    """Empirical CDFs: per panel, one step line per labelled sample (NaNs dropped)."""
    fig, axes = _figure(len(panels), title)
    for ax, (panel, series) in zip(axes, panels.items()):
        for label, values in series.items():
            ordered = sorted(v for v in values if v is not None and math.isfinite(v))
            if not ordered:
                continue
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.step(ordered, fractions, where="post", label=label)
        ax.set_title(panel)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


def plot_lines(panels: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
               path: str | os.PathLike, title: str, xlabel: str = "time (s)",
               ylabels: Mapping[str, str] | None = None) -> Path:
    """Lines ``(xs, ys)`` per label, one panel each (e.g. KV utilisation over time)."""
    fig, axes = _figure(len(panels), title)
    for ax, (panel, series) in zip(axes, panels.items()):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, label=label, linewidth=1.2)
        ax.set_title(panel)
        ax.set_xlabel(xlabel)
        if ylabels and panel in ylabels:
            ax.set_ylabel(ylabels[panel])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


def plot_bars(panels: Mapping[str, Mapping[str, float]], path: str | os.PathLike, title: str,
              reference: Mapping[str, Mapping[str, float]] | None = None) -> Path:
    """Bars per label, one panel per metric, each bar annotated with its value.

    ``reference`` (panel -> label -> value) draws a hollow bar beside each,
    e.g. the figure a source document reports.
    """
    fig, axes = _figure(len(panels), title, panel_width=3.6)
    for ax, (panel, values) in zip(axes, panels.items()):
        labels = list(values)
        positions = list(range(len(labels)))
        ref = (reference or {}).get(panel)
        width = 0.4 if ref else 0.7
        heights = [values[label] if math.isfinite(values[label]) else 0.0 for label in labels]
        bars = ax.bar([p - (width / 2 if ref else 0) for p in positions], heights, width, label="measured")
        ax.bar_label(bars, labels=[f"{h:.3g}" for h in heights], fontsize="small")
        if ref:
            ref_heights = [ref.get(label, math.nan) for label in labels]
            ref_bars = ax.bar([p + width / 2 for p in positions], [0 if math.isnan(h) else h for h in ref_heights],
                              width, fill=False, hatch="//", label="seed")
            ax.bar_label(ref_bars, labels=["" if math.isnan(h) else f"{h:.3g}" for h in ref_heights],
                         fontsize="small")
            ax.legend(fontsize="small")
        ax.set_xticks(positions, labels, rotation=15)
        ax.set_title(panel)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)
