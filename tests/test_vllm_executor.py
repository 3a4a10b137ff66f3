"""DeltaExecutor against a real vLLM (CPU build) and a tiny random Llama.

One subprocess (tests/vllm_executor_run.py) runs vLLM's default executor and
DeltaExecutor at TP=1 and TP=2 on the same prompts (greedy with logprobs and a
chunk-prefilled prompt, seeded sampling, n>1, a stop string; each batch twice so
the second round hits the prefix cache), then exercises the executor's other
paths and kills a rank.  The tests judge what it wrote.  Skipped cleanly when
vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # engines start slowly on busy cores
ROOT = Path(__file__).resolve().parent.parent
TOKEN_BUDGET = 256  # max_num_batched_tokens in the script


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_side.bench.vllm_scenarios import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-exec") / "tiny-llama")


def _script(model: Path, name: str, *extra: str) -> dict[str, Any]:
    out = model.parent / f"{name}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_executor_run.py"),
                           str(model), str(out), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["returncode"] = proc.returncode
    result["stderr"] = proc.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def run(model: Path) -> dict[str, Any]:
    return _script(model, "run")


class _FakeWorker:
    rpc_rank = 1

    def echo(self, x: int, y: int = 0) -> int:
        return x + y


def test_control_calls_are_authenticated_before_unpickling() -> None:
    """Names and cloudpickled callables run only under the run's HMAC key, sealed as
    calls, each once; results come back sealed for this rank."""
    import cloudpickle

    from engine_side.vllm import BadSeal
    from protocol.seal import Opener, Sealer
    from worker_side.vllm import proc

    key = b"k" * 32
    calls, results = Sealer(key, b"call"), Opener(key, b"result:1")
    server = proc._Server(_FakeWorker(), None, key, is_output=False, rank=1)  # type: ignore[arg-type]
    kind, blob = server._handle(proc.CONTROL, [calls.seal({"call": ("echo", (2,), {"y": 3})})])
    assert kind == proc.CONTROL and results.open(blob) == {"result": 5}
    fn = cloudpickle.dumps(lambda w, k: w.rpc_rank * k)
    sealed = calls.seal({"call": (fn, (7,), {})})
    assert results.open(server._handle(proc.CONTROL, [sealed])[1]) == {"result": 7}
    with pytest.raises(BadSeal, match="replayed"):
        server._handle(proc.CONTROL, [sealed])  # the same call again
    with pytest.raises(BadSeal, match="MAC"):
        server._handle(proc.CONTROL, [Sealer(b"x" * 32, b"call").seal({"call": (fn, (7,), {})})])
    with pytest.raises(BadSeal, match="MAC"):  # a result (or an attach) is not a call
        server._handle(proc.CONTROL, [Sealer(key, b"result:1").seal({"call": (fn, (7,), {})})])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


@pytest.mark.parametrize("tp", [1, 2])
def test_generate_matches_default_executor(run: dict[str, Any], tp: int) -> None:
    default, delta = run.get(f"default{tp}"), run.get(f"delta{tp}")
    assert default is not None and delta is not None, run["stderr"]
    assert len(delta) == len(default) == 10
    for k, (a, b) in enumerate(zip(default, delta, strict=True)):
        assert a == b, f"request {k} differs (token ids, text or logprobs)"
    assert any(o["lp"] for r in delta for o in r["outs"])  # logprobs were compared
    assert [len(r["outs"]) for r in delta][4] == 3  # n=3 parallel sampling


def test_the_step_ring_and_its_socket_fallbacks_keep_outputs_identical(
        run: dict[str, Any]) -> None:
    """Default: every call through the ring.  A 1 KiB ring: calls and replies over 512 B
    go on the sockets behind markers, still in order.  (No ring, sockets only:
    tests/test_vllm_recovery.py.)"""
    assert run["ring_stats"]["ring_calls"] > 0 and run["ring_stats"].get("socket_calls", 0) \
        <= 2  # (at most the first step's prompts)
    tiny = run["ring1_stats"]
    assert tiny["ring_calls"] > 0 and tiny["socket_calls"] > 0 and tiny["socket_replies"] > 0
    assert run["delta2_ring1"] == run["default2"]


def test_async_scheduling_batch_queue_matches_default_executor(run: dict[str, Any]) -> None:
    """Async scheduling forced on (the CPU platform turns it off): two batches in flight."""
    assert run["async_batch_queue"] == run["async_max_concurrent_batches"] == 2
    assert run["delta1_async"] == run["default1"]


def test_workload_exercised_chunked_prefill_and_prefix_cache(run: dict[str, Any]) -> None:
    delta = run["delta1"]
    assert delta[0]["plen"] > TOKEN_BUDGET  # had to be chunk-prefilled
    assert delta[5]["cached"] >= 32  # second round: prefix cache hits (block size 32)


def test_collective_rpc_by_name_and_callable(run: dict[str, Any]) -> None:
    pids = run["pids"]
    assert len(set(pids)) == 2 and os.getpid() not in pids  # one process per rank
    assert run["ranks_by_name"] == [None, None]
    assert run["futures_in_order"] is True
    assert run["draft"] == "None" and run["async"] is True
    assert run["dummy_batch"] is None and run["max_concurrent_batches"] == 1


def test_ranks_token_hashes_agree_in_normal_runs(run: dict[str, Any]) -> None:
    """TP=2: both ranks sample; their lagged hashes were compared and agreed."""
    assert run["hash_compared"] > 0
    assert run["divergent_before"] == []


def test_a_rank_sampling_other_tokens_is_named(run: dict[str, Any]) -> None:
    assert run["skewed"] == [False, True]  # rank 1 now samples token + 1
    assert [e["rank"] for e in run["divergent_after"]] == [1]
    assert run["divergent_after"][0]["source_rank"] == 0
    assert run["divergence_callback"] == [1]


def test_exception_on_non_output_rank_is_reported(run: dict[str, Any]) -> None:
    assert run["rank1_error"] == "rank 1: ValueError: boom on rank 1"
    # still serving: the same tokens and logprobs as the default executor's second
    # (prefix-cached) round of that prompt
    assert run["after_error"][0]["outs"] == run["default2"][6]["outs"]


def test_a_rank_dead_in_a_control_call_restarts_the_group(run: dict[str, Any]) -> None:
    """The call it died in raises; the engine generates on, with a new group."""
    assert run["rpc_after_death"] == "RuntimeError"
    assert run["generate_after_death"] == "returned"
    assert run["callback_calls"] == 0
    assert run["alive_after_death"] == [True, True]
    assert [r["cause"] for r in run["recoveries"]] == ["rank 1 died (exit code 3)"]


def test_shutdown_leaves_no_orphans(run: dict[str, Any]) -> None:
    assert run["tp1_alive_after_shutdown"] == [False]
    assert not [pid for pid in run["tp1_pids"] + run["pids"] if _alive(pid)]


def test_sigkilled_rank_behind_engine_core_process_restarts_the_group(model: Path) -> None:
    """vLLM's default layout (engine core in its own process): SIGKILL the non-output
    rank; the next generate runs on a restarted group, with the same (seeded) tokens;
    shutdown leaves no rank of either group."""
    run = _script(model, "kill", "kill")
    assert len(run["pids"]) == 2 and run["before"]
    assert run["generate_after_kill"] == "returned"
    assert run["after"] == run["before"]
    assert len(run["pids_after"]) == 2 and not set(run["pids_after"]) & set(run["pids"])
    assert not [pid for pid in run["pids"] + run["pids_after"] if _alive(pid)]
