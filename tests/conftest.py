"""Shared pytest setup: import path, Hypothesis profiles, a report of what the run
leaves in /dev/shm, the check that a node leaves no private directory, and the tiny
model and default-executor reference that the tests across hosts share.

Profile "ci" is selected when the environment variable ``CI`` is ``true``
(as in ``CI=true bash .ci/run``); otherwise "default".  Override with
``--hypothesis-profile=NAME``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Defensive: the editable install normally makes the packages importable.
if importlib.util.find_spec("protocol") is None:
    sys.path.insert(0, str(REPO_ROOT))

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    pass
else:
    settings.register_profile(
        "default",
        deadline=None,
        max_examples=100,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile(
        "ci",
        deadline=None,
        max_examples=60,
        derandomize=False,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("ci" if os.environ.get("CI", "").lower() == "true" else "default")


# -- what the run leaves in /dev/shm ---------------------------------------------------
# Reported, not failed on: the entries still there at the end of the run (rings, stores,
# semaphores), each with the test after which it last appeared (a name removed and made
# again belongs to the later test), so that a leak that shows up only now and then can
# be traced to the test that makes it.
_SHM = Path("/dev/shm")


def _shm_names() -> set[str]:
    try:
        return set(os.listdir(_SHM))
    except OSError:  # (no /dev/shm: nothing to report)
        return set()


_shm_at_start = _shm_names()
_shm_seen = set(_shm_at_start)
_shm_appeared_after: dict[str, str] = {}


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    global _shm_seen
    now = _shm_names()
    for name in now - _shm_seen:
        _shm_appeared_after[name] = nodeid
    _shm_seen = now


def pytest_terminal_summary(terminalreporter: Any) -> None:
    left = sorted(_shm_names() - _shm_at_start)
    if left:
        terminalreporter.section(f"left in {_SHM} by this run")
        for name in left:
            terminalreporter.line(f"{name}  (appeared after {_shm_appeared_after.get(name, '?')})")


# -- a node's private directory goes with it ------------------------------------------
@pytest.fixture()
def no_node_dir_left() -> Iterator[None]:
    """Fails a test after which a ``deltacast node`` (or a Ray node's actor) left its
    private directory (its ranks' endpoints, its relay's, its ring) behind, however the
    node ended (10 s allowed for the last of its ranks to exit)."""
    from shm_leftovers import node_dirs

    before = node_dirs()
    yield
    end = time.monotonic() + 10
    while node_dirs() - before and time.monotonic() < end:
        time.sleep(0.2)
    left = sorted(node_dirs() - before)
    for path in left:  # (not the next test's)
        shutil.rmtree(path, ignore_errors=True)
    assert not left, f"a node left its private directory: {[str(p) for p in left]}"


# -- what the executors across hosts must match ---------------------------------------
@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama (2 heads: TP up to 2) of the tests that share a reference."""
    from engine_side.bench.vllm_scenarios import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def default_tp2_reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
                          ) -> dict[str, Any]:
    """vLLM's default executor at TP=2 on one host, on tests/vllm_nodes_run.py's
    requests: what DeltaExecutor's ranks across hosts (headless or placed by Ray) must
    give (run once a session)."""
    import json
    import subprocess

    out = tmp_path_factory.mktemp("default-tp2") / "default.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "vllm_nodes_run.py"),
                           str(tiny_model), str(out), "default"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stderr[-3000:]
    reference: dict[str, Any] = json.loads(out.read_text())
    return reference
