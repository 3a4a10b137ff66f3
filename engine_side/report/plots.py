"""Report plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from engine_side.report.accounting import CATEGORIES  # noqa: E402
from engine_side.report.replay import FORMATS, Replay  # noqa: E402

_COLORS = {"deltacast": "tab:green", "msgspec_full": "tab:purple", "pickle_v1": "tab:blue",
           "pickle": "tab:red"}
#: how each format is drawn, so that series with (nearly) equal values stay visible: the
#: ones drawn first are wide and pale, the ones on top thin, dashed or dotted, with markers
_STYLES: dict[str, dict[str, Any]] = {
    "pickle": {"linewidth": 4.0, "alpha": 0.45, "linestyle": "-", "marker": "s", "zorder": 1},
    "msgspec_full": {"linewidth": 1.4, "alpha": 1.0, "linestyle": "--", "marker": "x",
                     "zorder": 3},
    "pickle_v1": {"linewidth": 4.0, "alpha": 0.45, "linestyle": "-", "marker": "^",
                  "zorder": 2},
    "deltacast": {"linewidth": 1.4, "alpha": 1.0, "linestyle": ":", "marker": "o",
                  "zorder": 4},
}
_CLOSE = 0.1  # two series whose last values differ by less than this share are noted


def _grid(n: int) -> tuple[Any, list[Any]]:
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows + 0.6), squeeze=False,
                             layout="constrained")
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _shared_legend(fig: Any, axes: list[Any]) -> None:
    """One legend for the whole figure, under the panels."""
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=9)


def _overlaps(series: dict[str, Any]) -> list[str]:
    """'a ≈ b' for the pairs of series whose last values are within _CLOSE of each other."""
    last = {k: float(v[-1]) for k, v in series.items() if len(v)}
    names = list(last)
    return [f"{a} ≈ {b}" for i, a in enumerate(names) for b in names[i + 1:]
            if max(last[a], last[b]) > 0
            and abs(last[a] - last[b]) / max(last[a], last[b]) < _CLOSE]


def bytes_per_step(replays: list[Replay], path: Path, cumulative: bool = False) -> Path:
    """One panel per workload: bytes per step (or cumulative bytes) of every format, log y.
    Series that end up close are drawn so both stay visible, and named in the panel."""
    fig, axes = _grid(len(replays))
    for ax, rep in zip(axes, replays, strict=True):
        series = {}
        for fmt in FORMATS:
            sizes = np.array([s.bytes for s in rep.steps[fmt]], dtype=float)
            series[fmt] = np.cumsum(sizes) if cumulative else sizes
            ax.plot(series[fmt], label=fmt, color=_COLORS[fmt],
                    markevery=max(1, len(sizes) // 10), markersize=5, **_STYLES[fmt])
        close = _overlaps(series)
        ax.set_yscale("log")
        ax.set_title(f"{rep.name} (batch {rep.batch})"
                     + ("\n(overlapping: " + ", ".join(close) + ")" if close else ""),
                     fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("cumulative bytes" if cumulative else "bytes per step")
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle("Cumulative bytes sent (log scale)" if cumulative
                 else "Bytes per step (log scale)")
    _shared_legend(fig, axes)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def us_per_workload(summaries: list[dict[str, Any]], path: Path) -> Path:
    """Grouped bars: encode + decode µs per step (p50) of each format on each workload, log
    y, the deltacast ÷ pickle_v1 ratio above each group (above 1: deltacast is slower)."""
    fig, ax = plt.subplots(figsize=(10, 4.8), layout="constrained")
    names = [s["workload"] for s in summaries]
    x, width = np.arange(len(names)), 0.8 / len(FORMATS)
    for i, fmt in enumerate(FORMATS):
        values = [s["formats"][fmt]["total_us"]["p50"] for s in summaries]
        ax.bar(x + (i - (len(FORMATS) - 1) / 2) * width, values, width, label=fmt,
               color=_COLORS[fmt], hatch="//" if fmt == "msgspec_full" else None)
    for j, s in enumerate(summaries):
        ours, v1 = (s["formats"][f]["total_us"]["p50"] for f in ("deltacast", "pickle_v1"))
        top = max(s["formats"][f]["total_us"]["p50"] for f in FORMATS)
        word = "slower" if ours > v1 else "faster"
        ratio = ours / v1 if ours > v1 else v1 / max(ours, 1e-9)
        ax.annotate(f"deltacast {ratio:.2g}× {word}\nthan pickle_v1", (j, top * 1.15),
                    ha="center", fontsize=7, color="tab:red" if ours > v1 else "tab:green")
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 4)
    ax.set_xticks(x, names, rotation=15)
    ax.set_ylabel("encode + decode µs per step (p50)")
    ax.set_title("CPU time per step on each workload (lower is better)")
    fig.legend(loc="outside upper center", ncols=len(FORMATS), fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def breakdown(replays: list[Replay], path: Path) -> Path:
    """100%-stacked bars: share of deltacast's bytes per field category, per workload,
    with the mean message size written above each bar (workloads differ by 100×)."""
    fig, ax = plt.subplots(figsize=(10, 5))
    names = [r.name for r in replays]
    means = {cat: np.array([np.mean([s.breakdown[cat] for s in r.steps["deltacast"]])  # type: ignore[index]
                            for r in replays]) for cat in CATEGORIES}
    totals = np.sum(list(means.values()), axis=0)
    bottom = np.zeros(len(replays))
    cmap = plt.get_cmap("tab10")
    for i, cat in enumerate(CATEGORIES):
        share = 100 * means[cat] / np.maximum(totals, 1)
        if share.any():
            ax.bar(names, share, bottom=bottom, label=cat, color=cmap(i % 10))
            bottom += share
    for x, total in enumerate(totals):
        ax.annotate(f"{total:,.0f} B", (x, 101), ha="center", fontsize=8)
    ax.set_ylim(0, 110)
    ax.set_ylabel("share of deltacast bytes per step (%)")
    ax.set_xlabel("workload (mean message size above each bar)")
    ax.set_title("Where deltacast's bytes go (per-field accounting)")
    ax.legend(fontsize=8, ncols=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def us_vs_batch(rows: list[dict[str, Any]], path: Path) -> Path:
    """encode+decode µs per step versus batch size, one line per format (log-log)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8), layout="constrained")
    for fmt in ("deltacast", "pickle_v1", "pickle"):
        pts = sorted((r["batch"], r["total_us"]) for r in rows if r["format"] == fmt)
        if pts:
            ax.plot(*zip(*pts, strict=True), label=fmt, color=_COLORS[fmt], markersize=6,
                    **{**_STYLES[fmt], "linestyle": "-"})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch size (running requests)")
    ax.set_ylabel("encode + decode µs per step (median)")
    ax.set_title("steady decode only (every request decodes one token, none arrives or "
                 "leaves):\nCPU time per step vs batch size; the workloads' times are in "
                 "us_per_workload.png", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
