"""The two-checkout A/B (engine_side/bench/tree_ab.py): both load orders run, each in a
process of its own, and the ratios combine them.  Two copies of this checkout on a
small synthetic stream; the figures themselves are the machine's, so only their shape
and sanity are checked."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_side.bench.tree_ab import FIGURES, combine

ROOT = Path(__file__).resolve().parents[1]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed")


def test_combine_takes_the_geometric_mean_of_both_orders() -> None:
    run = {"trees": {"a": dict.fromkeys(FIGURES, 10.0), "b": dict.fromkeys(FIGURES, 8.0)}}
    other = {"trees": {"a": dict.fromkeys(FIGURES, 10.0), "b": dict.fromkeys(FIGURES, 12.5)}}
    got = combine(run, other, "a", "b")
    assert set(got) == set(FIGURES)
    assert got["median"]["a_first"] == 0.8 and got["median"]["b_first"] == 1.25
    assert got["median"]["geometric_mean"] == pytest.approx(1.0)


@needs_vllm
def test_two_checkouts_in_both_orders(tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    for package in ("protocol", "engine_side", "worker_side"):
        shutil.copytree(ROOT / package, copy / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab.json"
    done = subprocess.run(
        [sys.executable, "-m", "engine_side.bench.tree_ab", "synthetic-8", str(ROOT),
         str(copy), "--passes", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    first, second = doc["runs"]
    assert first["order"] == [str(ROOT), str(copy)] and second["order"] == [str(copy), str(ROOT)]
    for run in (first, second):
        assert run["steps"] == {"F": 0, "N": 1, "S": 19}  # synthetic decode: no finishes
        for name, figures in run["trees"].items():
            assert figures["median"] > 0 and figures["summed"] >= figures["median"], name
            assert math.isnan(figures["finish"])
    for figure in ("median", "same_batch", "summed"):
        ratio = doc["ratios"][figure]["geometric_mean"]
        assert 0 < ratio < 10  # the same code twice: near 1 on a quiet machine
    assert "| median |" in done.stdout
