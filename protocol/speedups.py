"""The optional C speedups, or None when deltacast runs on its pure-Python paths.

``protocol/_speedups*.c`` (one module, built by ``setup.py`` at install, where a C
compiler is found; each file's header says what it holds) hold C versions of the
packers (:mod:`protocol.packing`: small lists, long int64 arrays, prompt lists to
int64), of the digest's per-row block terms and linear count terms
(:mod:`protocol.digest`), of the steady lane's plans and fused count step
(:mod:`protocol.lane`), of the same-batch step's checks, rows and count rows on both
ends -- in one call a side: the engine's read of the step and its Delta frame, the
worker's read of that frame and its SchedulerOutput (:mod:`engine_side.vllm.quick`,
:mod:`worker_side.vllm.quick`) --, of the vLLM replies' token lists
(:mod:`engine_side.vllm.convert`) and of the grammar bitmasks' row scans
(:mod:`engine_side.vllm.rowrefs`).  Each returns exactly
what its Python reference returns, or None for an input it does not take (the
Python path then decides, errors included); ``tests/test_speedups*.py``,
``tests/test_vllm_quick.py`` and
``tests/test_lane_frame.py`` hold the two together.  The bytes on the wire never
depend on which one ran.

``DELTACAST_PURE_PYTHON=1`` in the environment selects the pure-Python paths (the
A/B benchmark and the fallback tests).  ``python -m protocol.speedups`` says which
is in use.
"""

from __future__ import annotations

import os
from types import ModuleType

PURE_ENV = "DELTACAST_PURE_PYTHON"


def _load() -> ModuleType | None:
    if os.environ.get(PURE_ENV) == "1":
        return None
    try:
        import protocol._speedups as _speedups
    except ImportError:  # built without a C compiler: the Python paths
        return None
    return _speedups


C = _load()


def status() -> str:
    """One line: which paths this process uses."""
    if C is not None:
        return f"C speedups in use ({C.__file__})"
    why = f"{PURE_ENV}=1" if os.environ.get(PURE_ENV) == "1" else "not built (no C compiler?)"
    return f"pure Python: C speedups {why}"


if __name__ == "__main__":
    print(status())
