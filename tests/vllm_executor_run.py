"""Subprocess script for tests/test_vllm_executor.py: vLLM's default executor vs DeltaExecutor.

``python tests/vllm_executor_run.py MODEL OUT.json [kill]`` runs, in one process with
the engine core in-process (so the executor object is reachable), four engines
one after the other -- default and DeltaExecutor at TP=1 and TP=2 -- on the same
prompts, then exercises the executor's other paths on the last one and finally
kills a rank.  With ``kill`` it instead SIGKILLs a rank of a DeltaExecutor
behind vLLM's separate engine-core process.  Everything observed goes to
OUT.json for the test to judge.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

BASE = "the quick brown fox jumps over a lazy dog "
# Greedy batch: a prompt longer than the token budget (chunked prefill), logprobs, a stop.
GREEDY = [BASE * 40, BASE * 6 + "seven", BASE * 6 + "wizards"]
# Seeded batch of short prompts (the CPU build crashes on a seeded chunk-prefilled request).
SEEDED = ["lazy dog " * 5, "quietly hex " * 6]


def _params() -> tuple[list[Any], list[Any]]:
    from vllm import SamplingParams

    greedy = [SamplingParams(temperature=0, max_tokens=24, logprobs=2),
              SamplingParams(temperature=0, max_tokens=32, logprobs=2),
              SamplingParams(temperature=0, max_tokens=40, stop=["dog"])]
    seeded = [SamplingParams(temperature=0.9, seed=7, max_tokens=24),
              SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=16)]
    return greedy, seeded


def _run(llm: Any, prompts: list[str], params: list[Any]) -> list[dict[str, Any]]:
    return [{"plen": len(req.prompt_token_ids), "cached": req.num_cached_tokens or 0,
             "outs": [{"ids": list(c.token_ids), "text": c.text,
                       "lp": None if c.logprobs is None else
                       [{str(k): v.logprob for k, v in d.items()} for d in c.logprobs]}
                      for c in req.outputs]}
            for req in llm.generate(prompts, params, use_tqdm=False)]


def _outputs(llm: Any) -> list[dict[str, Any]]:
    greedy, seeded = _params()
    res = []
    for _ in range(2):  # the second round hits the prefix cache
        res += _run(llm, GREEDY, greedy) + _run(llm, SEEDED, seeded)
    return res


def _engine(model: str, tp: int, delta: bool, ring_kb: int | None = None) -> Any:
    from vllm import LLM

    from engine_side.vllm import DeltaExecutor

    kw: dict[str, Any] = {"distributed_executor_backend": DeltaExecutor} if delta else {}
    if ring_kb is not None:
        kw["additional_config"] = {"deltacast_ring_kb": ring_kb}
    return LLM(model=model, tensor_parallel_size=tp, enforce_eager=True, block_size=32,
               max_model_len=1024, seed=0, enable_prefix_caching=True,
               max_num_batched_tokens=256, enable_chunked_prefill=True, **kw)


def _executor(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor


def _close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _pid(worker: Any) -> int:
    return os.getpid()


def _fail_on_rank1(worker: Any) -> int:
    if worker.rpc_rank == 1:
        raise ValueError("boom on rank 1")
    return worker.rpc_rank


def _die_on_rank1(worker: Any) -> None:
    if worker.rpc_rank == 1:
        os._exit(3)


def _paths(llm: Any, out: dict[str, Any]) -> None:
    """The executor's non-generation paths, on a live DeltaExecutor at TP=2."""
    ex = _executor(llm)
    out["pids"] = ex.collective_rpc(_pid)
    out["ranks_by_name"] = ex.collective_rpc("check_health")
    ex.check_health()
    futures = [ex.collective_rpc(_pid, non_block=True) for _ in range(3)]
    out["futures_in_order"] = [f.result() for f in reversed(futures)] == [out["pids"]] * 3
    out["draft"] = repr(ex.take_draft_token_ids())
    out["dummy_batch"] = ex.execute_dummy_batch()
    out["async"] = ex.supports_async_scheduling()
    out["max_concurrent_batches"] = ex.max_concurrent_batches
    try:
        ex.collective_rpc(_fail_on_rank1)
    except RuntimeError as exc:
        out["rank1_error"] = str(exc)
    out["after_error"] = _run(llm, GREEDY[1:2], _params()[0][1:2])  # still serving


def _skew_rank1_sampler(worker: Any) -> bool:
    """Test-only fault: rank 1 samples token + 1 from now on (rank 0 is untouched)."""
    if worker.rpc_rank != 1:
        return False
    sampler = worker.worker.model_runner.sampler
    forward = sampler.forward

    def skewed(logits: Any, *args: Any, **kwargs: Any) -> Any:
        result = forward(logits, *args, **kwargs)
        result.sampled_token_ids = (result.sampled_token_ids + 1) % logits.shape[-1]
        return result

    sampler.forward = skewed
    return True


def _diverge(llm: Any, out: dict[str, Any]) -> None:
    """Normal runs compare the ranks' token hashes and find nothing; a rank made to
    sample other tokens is named (log, ``divergent``, callback)."""
    ex = _executor(llm)
    ex.check_health()  # drains the check-ins of the runs so far
    out["hash_compared"] = ex.hashes.compared
    out["divergent_before"] = [vars(e) for e in ex.divergent]
    named: list[int] = []
    ex.register_divergence_callback(lambda event: named.append(event.rank))
    out["skewed"] = ex.collective_rpc(_skew_rank1_sampler)
    _run(llm, GREEDY[1:2], _params()[0][1:2])
    ex.check_health()
    out["divergent_after"] = [vars(e) for e in ex.divergent]
    out["divergence_callback"] = named


def _kill(llm: Any, out: dict[str, Any]) -> None:
    """A rank dies mid-call: the group restarts, the call raises, the engine serves on."""
    ex = _executor(llm)
    called: list[int] = []
    ex.register_failure_callback(lambda: called.append(1))
    try:
        ex.collective_rpc(_die_on_rank1)
        out["rpc_after_death"] = "returned"
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        out["rpc_after_death"] = type(exc).__name__
    try:
        llm.generate(SEEDED[:1], use_tqdm=False)
        out["generate_after_death"] = "returned"
    except Exception as exc:  # noqa: BLE001
        out["generate_after_death"] = type(exc).__name__
    out["callback_calls"] = len(called)
    out["alive_after_death"] = [p.is_alive() for p in ex.local.procs]
    out["recoveries"] = ex.recoveries
    _close(llm)


def _async_run(model: str, out: dict[str, Any]) -> None:
    from engine_side.bench.vllm_scenarios import async_scheduling

    with async_scheduling(True):
        llm = _engine(model, 1, delta=True)
    out["async_batch_queue"] = llm.llm_engine.engine_core.engine_core.batch_queue_size
    out["async_max_concurrent_batches"] = _executor(llm).max_concurrent_batches
    out["delta1_async"] = _outputs(llm)
    _close(llm)


def main(model: str, path: str) -> None:
    out: dict[str, Any] = {}
    for tp in (1, 2):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "auto" if tp == 1 else "0|1"
        for delta in (False, True):
            llm = _engine(model, tp, delta)
            out[f"{'delta' if delta else 'default'}{tp}"] = _outputs(llm)
            if delta and tp == 1:
                ex = _executor(llm)
                out["tp1_pids"] = ex.collective_rpc(_pid)
                _close(llm)
                out["tp1_alive_after_shutdown"] = [p.is_alive() for p in ex.local.procs]
                _async_run(model, out)
            elif delta:
                out["ring_stats"] = dict(_executor(llm).stats)
                _paths(llm, out)
                _diverge(llm, out)
                _kill(llm, out)
            else:
                _close(llm)
            with open(path, "w") as f:
                json.dump(out, f)
    # a 1 KiB ring: large calls and replies take the sockets (no ring at all:
    # tests/vllm_recovery_run.py's "sockets" run)
    llm = _engine(model, 2, True, 1)
    out["delta2_ring1"] = _outputs(llm)
    out["ring1_stats"] = dict(_executor(llm).stats)
    _close(llm)
    with open(path, "w") as f:
        json.dump(out, f)


def _worker_pids() -> list[int]:
    """DeltaExecutor ranks among this process's descendants, by rank (their titles)."""
    import psutil

    found = {}
    for p in psutil.Process().children(recursive=True):
        title = " ".join(p.cmdline())
        if "DeltaWorker_" in title:
            found[int(title.split("DeltaWorker_")[1].split()[0])] = p.pid
    return [found[r] for r in sorted(found)]


def kill_main(model: str, path: str) -> None:
    """Engine core in its own process (vLLM's default): SIGKILL rank 1, then generate
    (the group restarts), then shut down."""
    import signal

    from vllm.v1.engine.exceptions import EngineDeadError

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    llm = _engine(model, 2, delta=True)
    out: dict[str, Any] = {"pids": _worker_pids()}
    out["before"] = _run(llm, SEEDED[:1], _params()[1][:1])[0]["outs"][0]["ids"]
    os.kill(out["pids"][1], signal.SIGKILL)
    try:
        out["after"] = _run(llm, SEEDED[:1], _params()[1][:1])[0]["outs"][0]["ids"]
        out["generate_after_kill"] = "returned"
    except EngineDeadError:
        out["generate_after_kill"] = "EngineDeadError"
    out["pids_after"] = _worker_pids()
    _close(llm)
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if sys.argv[3:] == ["kill"]:
        kill_main(sys.argv[1], sys.argv[2])
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        main(sys.argv[1], sys.argv[2])
