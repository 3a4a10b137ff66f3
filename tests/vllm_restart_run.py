"""Subprocess script for tests/test_vllm_restart.py: ranks SIGKILLed mid-generation.

``python tests/vllm_restart_run.py MODEL OUT.json`` runs, with the engine core in-process
(the executor is reachable), greedy prompts with logprobs (one chunk-prefilled, prefix
caching on) for three rounds at TP=2:

* vLLM's default executor, undisturbed (``default``);
* vLLM's default executor, where vLLM itself recomputes: at the steps where DeltaExecutor
  loses a rank below, the scheduler preempts every running request and empties the
  prefix cache, dropping that step's output (``reset_prefix_cache(reset_running_requests
  =True)``, vLLM's own utility) (``recomputed``);
* DeltaExecutor, a rank SIGKILLed just before that step is sent: in the first round
  while the long prompt is in prefill, in the second mid-decode; the third runs on the
  prefix cache the restarts emptied (``delta``); then a seeded round (random
  sampling, every recompute within one step's token budget) loses a rank mid-decode
  (``seeded``: against the default executor's undisturbed seeded round).

Then DeltaExecutor with async scheduling (two batches in flight) loses a rank mid-decode,
then has a rank frozen (SIGSTOP: past the liveness bound it is killed), then one hung in
a step with its process alive (past the step timeout the group stops) and, allowed
three restarts, fails on the fourth.  Outputs, pids, restarts and what
failed go to OUT.json for the test to judge.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from vllm_executor_run import GREEDY, SEEDED, _close, _executor, _params, _run  # noqa: E402

ROUNDS = 3
FAULTS = {0: (1, 2), 1: (0, 12)}  # round -> (rank, step of the round): prefill, decode


def _engine(model: str, restarts: int | None = None, async_on: bool = False) -> Any:
    from vllm import LLM

    from engine_side.bench.vllm_scenarios import async_scheduling
    from engine_side.vllm import DeltaExecutor

    kw: dict[str, Any] = {}
    if restarts is not None:
        kw = {"distributed_executor_backend": DeltaExecutor,
              "additional_config": {"deltacast_restarts": restarts}}
    with async_scheduling(async_on):
        return LLM(model=model, tensor_parallel_size=2, enforce_eager=True, block_size=32,
                   max_model_len=1024, seed=0, enable_prefix_caching=True,
                   max_num_batched_tokens=256, enable_chunked_prefill=True, **kw)


def at_step(llm: Any, step: int, before: Callable[[], None] | None = None,
            after: Callable[[], None] | None = None) -> None:
    """Run ``before`` / ``after`` around sending the ``step``-th step from now (1-based)."""
    ex = _executor(llm)
    send, seen = ex.execute_model, [0]

    def execute_model(so: Any, non_block: bool = False) -> Any:
        seen[0] += 1
        if seen[0] == step and before is not None:
            before()
        result = send(so, non_block)
        if seen[0] == step and after is not None:
            after()
        return result

    ex.execute_model = execute_model


def kill(llm: Any, rank: int) -> Callable[[], None]:
    """SIGKILL DeltaExecutor's ``rank`` and wait until it is gone."""
    def run() -> None:
        proc = _executor(llm).local.procs[rank]
        os.kill(proc.pid, signal.SIGKILL)
        wait([proc.sentinel], 10)  # (not reaped here: the executor reads its exit code)
    return run


def _stall_next_step(wrapper: Any, rank: int) -> None:
    """(On every rank, by a control call) rank ``rank`` blocks in its next model step for
    good, its process and I/O thread alive: a deadlocked kernel."""
    import threading

    if wrapper.worker.rank == rank:
        wrapper.execute_model = lambda *args, **kwargs: threading.Event().wait()


def hang(llm: Any, rank: int, timeout_s: float) -> Callable[[], None]:
    """Have DeltaExecutor's ``rank`` hang in its next step, the step timeout ``timeout_s``."""
    def run() -> None:
        ex = _executor(llm)
        ex._model_timeout = lambda: timeout_s
        ex.collective_rpc(_stall_next_step, args=(rank,))
    return run


def freeze(llm: Any, rank: int) -> Callable[[], None]:
    """SIGSTOP DeltaExecutor's ``rank``: it stays alive, its link unheard."""
    return lambda: os.kill(_executor(llm).local.procs[rank].pid, signal.SIGSTOP)


def recompute(llm: Any) -> Callable[[], None]:
    """vLLM's own recompute: preempt every running request, empty the prefix cache."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return lambda: scheduler.reset_prefix_cache(reset_running_requests=True)


def _generate(llm: Any) -> list[dict[str, Any]]:
    return _run(llm, GREEDY, _params()[0])


def _seeded(llm: Any) -> list[dict[str, Any]]:
    return _run(llm, SEEDED, _params()[1])


def _rounds(llm: Any, fault: Callable[[int], dict[str, Any]] | None) -> list[Any]:
    outs = []
    for r in range(ROUNDS):
        if fault is not None and r in FAULTS:
            at_step(llm, FAULTS[r][1], **fault(FAULTS[r][0]))
        outs.append(_generate(llm))
    return outs


def _rings() -> set[str]:
    """The shared-memory segments vLLM's broadcast queues name in /dev/shm."""
    return {p for p in os.listdir("/dev/shm") if p.startswith("psm_")}


def main(model: str, path: str) -> None:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    out: dict[str, Any] = {}
    llm = _engine(model)
    out["default"] = _rounds(llm, None)
    out["default_seeded"] = _seeded(llm)
    _close(llm)
    llm = _engine(model)
    out["recomputed"] = _rounds(llm, lambda rank: {"after": recompute(llm)})
    _close(llm)

    rings = _rings()
    llm = _engine(model, restarts=3)
    ex = _executor(llm)
    called: list[int] = []
    ex.register_failure_callback(lambda: called.append(1))
    out["pids"] = [ex.local.pids()]
    out["delta"] = _rounds(llm, lambda rank: {"before": kill(llm, rank)})
    at_step(llm, 10, before=kill(llm, 1))
    out["seeded"] = _seeded(llm)
    out["pids"].append(ex.local.pids())
    out["restarts"], out["callback_calls"] = ex.restarts.count, len(called)
    out["recoveries_sync"] = ex.recoveries
    out["dist"] = ex._dist[0]
    out["rings_left"] = sorted(_rings() - rings)  # /dev/shm names made since, 4 groups on
    _close(llm)
    out["pids"].append([p for p in ex.local.pids()])

    llm = _engine(model, restarts=3, async_on=True)
    ex = _executor(llm)
    out["async_batches"] = ex.max_concurrent_batches
    out["pids"].append(ex.local.pids())
    at_step(llm, 12, before=kill(llm, 1))
    out["async"] = _generate(llm)
    at_step(llm, 8, before=freeze(llm, 0))
    out["frozen"] = _generate(llm)
    at_step(llm, 6, before=hang(llm, 1, 5.0))
    out["hung"] = _generate(llm)
    out["async_restarts"] = ex.restarts.count
    out["pids"].append(ex.local.pids())
    ex.register_failure_callback(lambda: called.append(2))
    at_step(llm, 5, before=kill(llm, 0))  # past the bound (three restarts): it fails
    try:
        _generate(llm)
        out["past_bound"] = "returned"
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        out["past_bound"] = f"{type(exc).__name__}: {exc}"
    out["failure"] = ex.failure
    out["recoveries"] = ex.recoveries
    out["callback_calls_past_bound"] = called.count(2)
    for p in ex.local.procs:
        p.join(10)  # the monitor stops the survivor
    out["alive_past_bound"] = [p.is_alive() for p in ex.local.procs]
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the executor object is reachable
    main(sys.argv[1], sys.argv[2])
