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


def _grid(n: int) -> tuple[Any, list[Any]]:
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def bytes_per_step(replays: list[Replay], path: Path, cumulative: bool = False) -> Path:
    """One panel per workload: bytes per step (or cumulative bytes) of every format, log y."""
    fig, axes = _grid(len(replays))
    for ax, rep in zip(axes, replays, strict=True):
        for fmt in FORMATS:
            sizes = np.array([s.bytes for s in rep.steps[fmt]], dtype=float)
            ax.plot(np.cumsum(sizes) if cumulative else sizes, label=fmt, color=_COLORS[fmt],
                    linewidth=1.2, linestyle="--" if fmt == "msgspec_full" else "-")
        ax.set_yscale("log")
        ax.set_title(f"{rep.name} (batch {rep.batch})")
        ax.set_xlabel("step")
        ax.set_ylabel("cumulative bytes" if cumulative else "bytes per step")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].legend(loc="best", fontsize=8)
    fig.suptitle("Cumulative bytes sent" if cumulative else "Bytes per step (log scale)")
    fig.tight_layout()
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
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for fmt in ("deltacast", "pickle_v1", "pickle"):
        pts = sorted((r["batch"], r["total_us"]) for r in rows if r["format"] == fmt)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=fmt, color=_COLORS[fmt])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch size (running requests)")
    ax.set_ylabel("encode + decode µs per step (median)")
    ax.set_title("steady decode: CPU time per step vs batch size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
