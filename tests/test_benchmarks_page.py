"""BENCHMARKS.md is generated from docs/benchmarks/*.json (``python -m engine_side.bench.page``).

The committed page must be what the generator writes, small, and free of scratch paths;
every figures file must be a complete envelope whose command names a real option.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from engine_side.bench import figures, page, page_tables

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
PAGE = ROOT / "BENCHMARKS.md"
ENVELOPES = sorted(DOCS.glob("*.json"))


def test_there_are_figures() -> None:
    assert ENVELOPES, "docs/benchmarks/ holds no figures"


def test_generator_is_deterministic() -> None:
    assert page.render(DOCS) == page.render(DOCS)


def test_committed_page_is_up_to_date() -> None:
    done = subprocess.run([sys.executable, "-m", "engine_side.bench.page", "--check"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "BENCHMARKS.md"
    stale.write_text(PAGE.read_text() + "\nhand edit\n")
    assert page.main(["--check", "--out", str(stale)]) == 1
    assert page.main(["--out", str(stale)]) == 0
    assert page.main(["--check", "--out", str(stale)]) == 0


def test_page_is_small() -> None:
    assert len(PAGE.read_bytes()) <= 60 * 1024


def test_page_has_no_scratch_paths_or_history_words() -> None:
    text = PAGE.read_text()
    assert "/tmp/" not in text
    assert "session" not in text.lower()


@pytest.mark.parametrize("path", ENVELOPES, ids=lambda p: p.stem)
def test_envelope_has_the_required_keys(path: Path) -> None:
    env = json.loads(path.read_text())
    for key in figures.REQUIRED:
        assert key in env, f"{path.name}: missing {key!r}"
    assert figures.envelope_problems(env) == []
    assert env["name"] == path.stem
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", env["date"])
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?", env["commit"])


@pytest.mark.parametrize("path", ENVELOPES, ids=lambda p: p.stem)
def test_envelope_command_runs_from_a_clone(path: Path) -> None:
    """Repository paths, the venv's executables, and an option each entry point has (in
    its own source or a bench module it imports from)."""
    command = json.loads(path.read_text())["command"]
    words = shlex.split(command)
    assert "/work/" not in command and str(ROOT) not in command
    assert any(w.startswith(".venv/bin/") for w in words)
    writes = {"--figures", "--import-report"} & set(words)
    assert writes, f"{path.name}: the command does not write its figures"
    if "-m" in words:  # the module it runs defines the option
        module = words[words.index("-m") + 1]
    else:  # deltacast bench KIND: the shared options
        assert words[words.index(".venv/bin/deltacast") + 1] == "bench"
        module = "engine_side.bench.cli"
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    helpers = re.findall(r"^from engine_side\.bench\.(\w+) import", source, re.M)
    source += "".join((ROOT / "engine_side" / "bench" / f"{h}.py").read_text()
                      for h in helpers)  # (options a shared helper adds)
    assert any(f'"{opt}"' in source for opt in writes), f"{module} lacks {writes}"


def test_envelope_problems_catch_bad_envelopes() -> None:
    good = {"name": "x", "title": "X", "what": "w", "command": ".venv/bin/x --figures f",
            "machine": dict.fromkeys(figures.MACHINE_KEYS, "?"), "date": "2026-01-01 00:00 UTC",
            "commit": "abcdef0", "columns": ["a", "b"], "rows": [[1, 2]],
            "targets": [{"target": "t", "value": 1, "limit": "≤ 2", "met": True}], "notes": []}
    assert figures.envelope_problems(good) == []
    assert figures.envelope_problems({**good, "rows": [[1]]}) == [
        "row 0 has 1 cells for 2 columns"]
    assert "missing key 'date'" in figures.envelope_problems(
        {k: v for k, v in good.items() if k != "date"})
    assert figures.envelope_problems({**good, "targets": [{"target": "t"}]})


def test_slower_is_said_plainly() -> None:
    rows = [["a", 1.5, "µs"], ["b", 0.5, page.NONE]]
    lines = page._table(["case", "ratio", page.SLOWER], rows)
    assert lines[2].endswith("| **µs** |") and lines[3].endswith("| – |")
    assert page_tables._slower(("µs", 1.2), ("bytes", 0.1)) == "µs"
    assert page_tables._slower(("µs", 0.9), ("bytes", None)) == page.NONE


def test_command_is_relative_to_the_repository() -> None:
    argv = [f"{ROOT}/.venv/bin/python", f"{ROOT}/.venv/bin/deltacast", "bench", "--json"]
    assert figures.command(argv).endswith(".venv/bin/deltacast bench --json")
    argv = [f"{ROOT}/.venv/bin/python", "-m", "engine_side.bench.bitmask", "--figures",
            f"{ROOT}/docs/benchmarks/bitmask.json"]
    assert figures.command(argv).endswith(
        ".venv/bin/python -m engine_side.bench.bitmask --figures docs/benchmarks/bitmask.json")
