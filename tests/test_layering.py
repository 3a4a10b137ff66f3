"""Layering rules that keep the pure protocol core pure.

* The pure modules (wire vocabulary, codec, state machines, mirror, replica)
  never import ``zmq``, and never import ``torch``: only ``protocol.tensors``
  handles tensors.
* No source file deserialises with pickle from the network.
* Every module stays small (about 500 lines).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "engine_side", "worker_side")

# Imported by every check; they exist from the start.
REQUIRED_PURE_MODULES = (
    "protocol",
    "protocol.packing",
    "protocol.errors",
    "protocol.params",
    "protocol.request",
)
# Checked once they exist.
OPTIONAL_PURE_MODULES = (
    "protocol.messages",
    "protocol.codec",
    "protocol.state",
    "engine_side.mirror",
    "worker_side.replica",
)

# Files (paths relative to the repo root, "/"-separated) allowed to unpickle, with why.
# An entry MUST be either control-plane code that unpickles only HMAC-authenticated
# bytes (MAC verified with hmac.compare_digest first) or a benchmark baseline that
# unpickles bytes it produced itself; never anything received from a socket or file.
AUTHENTICATED_PICKLE_FILES: dict[str, str] = {
    # the seal (control plane, connector metadata): HMAC-SHA256 verified before loads
    "protocol/seal.py": "unpickles only after the blob's MAC verified (compare_digest)",
    # DeltaExecutor control plane: cloudpickle.dumps of vLLM's callables, sent sealed
    "engine_side/vllm/executor.py": "pickles callables into the HMAC seal (dumps only)",
    # its worker: vLLM's run_method unpickles a callable only after Opener.open verified it
    "worker_side/vllm/proc.py": "callable bytes from an HMAC-verified control call",
    # the benchmark's own baseline: unpickles bytes it produced a line earlier, never
    # anything received (it measures what vLLM's path costs)
    "engine_side/bench/baselines.py": "baseline measurement of self-produced bytes",
    "engine_side/bench/vllm_replay.py": "baseline measurement of self-produced bytes",
}

PICKLE_PATTERN = re.compile(r"pickle\.loads?\(|pickle\.Unpickler|recv_pyobj|cloudpickle")

_PROBE = """
import importlib, json, sys
mods = json.loads(sys.argv[1])
for name in mods:
    importlib.import_module(name)
print(json.dumps({
    "zmq": sorted(m for m in sys.modules if m == "zmq" or m.startswith("zmq.")),
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
}))
"""


def _pure_modules() -> list[str]:
    present = []
    for name in OPTIONAL_PURE_MODULES:
        parent = name.rpartition(".")[0]
        if importlib.util.find_spec(parent) is None:
            continue
        if importlib.util.find_spec(name) is not None:
            present.append(name)
    return [*REQUIRED_PURE_MODULES, *present]


def _probe(modules: list[str]) -> dict[str, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"importing {modules} failed:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_pure_modules_do_not_import_zmq_or_torch() -> None:
    modules = _pure_modules()
    assert "protocol.tensors" not in modules
    loaded = _probe(modules)
    assert not loaded["zmq"], f"pure modules {modules} imported zmq: {loaded['zmq'][:5]}"
    assert not loaded["torch"], (
        f"pure modules {modules} imported torch ({loaded['torch'][:5]}); "
        "only protocol.tensors may import torch"
    )


def test_each_pure_module_alone_is_pure() -> None:
    """Per module, so a failure names the offender."""
    offenders = {}
    for name in _pure_modules():
        loaded = _probe([name])
        if loaded["zmq"] or loaded["torch"]:
            offenders[name] = sorted({m.split(".")[0] for m in loaded["zmq"] + loaded["torch"]})
    assert not offenders, f"modules importing zmq/torch: {offenders}"


def test_no_unauthenticated_unpickling() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if rel in AUTHENTICATED_PICKLE_FILES:
                continue
            text = path.read_text(encoding="utf-8")
            for lineno, line in enumerate(text.splitlines(), start=1):
                if PICKLE_PATTERN.search(line):
                    offenders.append(f"{rel}:{lineno}: {line.strip()}")
    assert not offenders, (
        "pickle deserialisation outside AUTHENTICATED_PICKLE_FILES:\n" + "\n".join(offenders)
    )


def test_whitelist_entries_exist() -> None:
    missing = [f for f in AUTHENTICATED_PICKLE_FILES if not (REPO_ROOT / f).is_file()]
    assert not missing, f"stale AUTHENTICATED_PICKLE_FILES entries: {missing}"


#: the brief's "small modules (about 500 lines)", with a little slack for a docstring
MAX_MODULE_LINES = 520


def test_modules_stay_small() -> None:
    """Every source file of the packages, the tests and the C speedups stays within
    MAX_MODULE_LINES: a module that outgrows it is split by subject, not trimmed."""
    roots = (*PACKAGES, "tests")
    files = [path for root in roots for pattern in ("*.py", "*.c", "*.h")
             for path in sorted((REPO_ROOT / root).rglob(pattern))
             if ".venv" not in path.parts and "build" not in path.parts]
    assert len(files) > 50  # (the packages and tests were found)
    long = {path.relative_to(REPO_ROOT).as_posix(): n for path in files
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
