"""``deltacast bench mm --quick --json``: row schema, formats, store_hit byte bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine_side.bench.rows import ROW_KEYS, row_problems

REPO_ROOT = Path(__file__).resolve().parent.parent
CORE = ("memcpy", "pickle_torch", "pickle_numpy", "frames", "store_first", "store_hit")


@pytest.mark.integration
def test_quick_json_rows() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engine_side.cli", "bench", "mm", "--quick", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert rows
    for row in rows:
        assert list(row)[: len(ROW_KEYS)] == list(ROW_KEYS)
        assert row_problems(row) == [], row
    cases = {(r["batch"], r["workers"]) for r in rows}
    for batch, workers in cases:
        formats = {r["format"] for r in rows if (r["batch"], r["workers"]) == (batch, workers)}
        assert set(CORE) <= formats
    for row in rows:
        images, image_bytes = row["batch"], row["image_bytes"]
        if row["format"] == "store_hit":
            assert row["bytes"] <= 100 * images
        if row["format"] in ("store_first", "vllm_shm"):
            assert row["bytes"] < image_bytes  # only handles on the control channel
        if row["format"] in ("frames", "pickle_numpy", "pickle_torch", "memcpy"):
            assert row["bytes"] >= images * image_bytes  # the data itself travels
