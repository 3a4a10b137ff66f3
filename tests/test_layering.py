"""Layering rules that keep the pure protocol core pure.

* The pure modules (wire vocabulary, codec, state machines, mirror, replica)
  never import ``zmq``, and never import ``torch``: only ``protocol.tensors``
  handles tensors.
* ``protocol/`` has no sockets, threads, clock or vLLM (by its imports), and its
  source, C included, names no vLLM scheduler type or field.
* The library modules of ``engine_side`` and ``worker_side`` never import each other
  (what both ends share is protocol vocabulary); only the harnesses that run both
  ends in one process may.
* No import cycles among the packages' modules (every import counts: function-level
  and TYPE_CHECKING ones too).
* No source file deserialises with pickle from the network.
* Every module stays small (about 500 lines).
"""

from __future__ import annotations

import ast
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


# -- imports, read with ast (function-level and TYPE_CHECKING imports included) -------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(*roots: str) -> dict[str, Path]:
    """Module name -> file, for every .py under ``roots``."""
    return {_module_name(p): p for root in roots for p in sorted((REPO_ROOT / root).rglob("*.py"))}


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module name, names it imports) of every import statement in
    ``path`` (for ``import M``: M, []; for ``from M import a``: M, [a])."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            out.append((node.lineno, base, [a.name for a in node.names]))
    return out


#: modules that run both ends in one process (benchmarks, reports and the recorder of a
#: vLLM run, the demo, the CLI): the only ones that may import the other side
HARNESSES = ("engine_side/bench/", "engine_side/report/", "engine_side/demo.py",
             "engine_side/cli.py")


def test_engine_and_worker_libraries_do_not_import_each_other() -> None:
    """Each side's library reaches the other only through protocol vocabulary (a rank is
    spawned by module path: a string, not an import)."""
    offenders = []
    for side, other in (("engine_side", "worker_side"), ("worker_side", "engine_side")):
        for path in _sources(side).values():
            rel = path.relative_to(REPO_ROOT).as_posix()
            if rel.startswith(HARNESSES):
                continue
            offenders += [f"{rel}:{line}: imports {mod}" for line, mod, _ in _imports(path)
                          if mod.split(".")[0] == other]
    assert not offenders, "library modules importing the other side:\n" + "\n".join(offenders)


def test_harness_exceptions_exist() -> None:
    missing = [h for h in HARNESSES if not (REPO_ROOT / h).exists()]
    assert not missing, f"stale HARNESSES entries: {missing}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` that hold a cycle (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    modules = _sources(*PACKAGES)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, mod, names in _imports(path):  # a name that is a submodule: an edge to it
            graph[name] |= {f"{mod}.{n}" if f"{mod}.{n}" in modules else mod
                            for n in names or [""]} & modules.keys()
    assert len(graph) > 50 and any(graph.values())  # (the modules and their edges were found)
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each line: modules that import each other in a loop):\n" \
        + "\n".join(" <-> ".join(c) for c in cycles)


#: what protocol/ must not import (sockets, threads, clock, process control, vLLM), with
#: the one module allowed each exception and why
IMPURE_IMPORTS = ("zmq", "torch", "vllm", "socket", "select", "selectors", "asyncio",
                  "threading", "_thread", "multiprocessing", "subprocess", "time")
IMPURE_ALLOWED = {
    ("protocol/tensors.py", "torch"): "the one module that handles tensors",
    ("protocol/ring.py", "threading"): "a Lock used only as a memory fence (no thread)",
    ("protocol/codec.py", "threading"): "threading.local: per-thread codec scratch (no thread)",
}
#: vLLM's scheduler vocabulary, which protocol/ (its C included) never names
VLLM_NAMES = re.compile(r"SchedulerOutput|NewRequestData|CachedRequestData|"
                        r"scheduled_new_reqs|scheduled_cached_reqs")


def test_protocol_has_no_sockets_threads_clock_or_vllm() -> None:
    offenders = []
    for path in _sources("protocol").values():
        rel = path.relative_to(REPO_ROOT).as_posix()
        offenders += [f"{rel}:{line}: imports {mod}" for line, mod, _ in _imports(path)
                      if mod.split(".")[0] in IMPURE_IMPORTS
                      and (rel, mod.split(".")[0]) not in IMPURE_ALLOWED]
    assert not offenders, "impure imports in protocol/:\n" + "\n".join(offenders)


def test_protocol_source_names_no_vllm_scheduler_type() -> None:
    files = [p for pattern in ("*.py", "*.pyi", "*.c", "*.h")
             for p in sorted((REPO_ROOT / "protocol").rglob(pattern))]
    assert any(p.suffix == ".c" for p in files)  # (the C was found)
    offenders = [f"{p.relative_to(REPO_ROOT).as_posix()}:{n}: {m.group()}"
                 for p in files for n, line in enumerate(p.read_text(encoding="utf-8")
                                                         .splitlines(), start=1)
                 if (m := VLLM_NAMES.search(line))]
    assert not offenders, "vLLM names in protocol/:\n" + "\n".join(offenders)


def test_impure_exceptions_are_still_needed() -> None:
    stale = [k for k in IMPURE_ALLOWED if not any(
        mod.split(".")[0] == k[1] for _, mod, _ in _imports(REPO_ROOT / k[0]))]
    assert not stale, f"stale IMPURE_ALLOWED entries: {stale}"
