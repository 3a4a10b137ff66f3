"""Subprocess script for tests/test_vllm_recovery.py: ranks that lose or get damaged calls.

``python tests/vllm_recovery_run.py MODEL OUT.json`` runs vLLM's default executor and
DeltaExecutor at TP=2 on the same prompts as tests/vllm_executor_run.py, the latter
twice with faults injected into its ranks' calls (worker_side.vllm.channel's
DELTACAST_INJECT hook: a call lost, or a byte of it flipped, at one rank): once through
the step ring, once with the sockets only.  Outputs, the executor's counters and how
many calls each run made go to OUT.json for the test to judge.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from vllm_executor_run import _close, _engine, _executor, _outputs  # noqa: E402

#: per run: ring size (None: the default ring; 0: sockets only) and the faults, as
#: fault:rank:call number -- calls early (start-up control calls) and mid-run (steps)
FAULTS = {"ring": (None, "drop:1:3,corrupt:0:40,drop:1:57,corrupt:1:58,drop:0:90"),
          "sockets": (0, "corrupt:1:33,drop:0:45,drop:1:71")}


def main(model: str, path: str) -> None:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    out: dict[str, Any] = {}
    llm = _engine(model, 2, delta=False)
    out["default2"] = _outputs(llm)
    _close(llm)
    for name, (ring_kb, faults) in FAULTS.items():
        os.environ["DELTACAST_INJECT"] = faults  # the ranks inherit it when spawned
        try:
            llm = _engine(model, 2, True, ring_kb)
        finally:
            del os.environ["DELTACAST_INJECT"]
        out[name] = _outputs(llm)
        ex = _executor(llm)
        out[f"{name}_stats"] = dict(ex.stats)
        out[f"{name}_calls"] = ex._calls
        out[f"{name}_faults"] = faults
        _close(llm)
        with open(path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the executor object is reachable
    main(sys.argv[1], sys.argv[2])
