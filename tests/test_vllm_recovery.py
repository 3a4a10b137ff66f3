"""A DeltaExecutor rank that loses a call, or gets one damaged, recovers it (SPEC §16).

tests/vllm_recovery_run.py runs a real vLLM (CPU) at TP=2: the default executor, then
DeltaExecutor twice with faults injected into its ranks' calls -- lost ones (the rank
finds out from the next call, or from the executor's ping when it was the newest) and
damaged ones (the CRC of the call head) -- through the step ring and through the
sockets.  Every run must give the default executor's tokens, text and logprobs, and
the executor must have sent the calls again.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from vllm_script import run_script  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script(tmp_path_factory, "recovery")


@pytest.mark.parametrize("name", ["ring", "sockets"])
def test_outputs_stay_identical_to_the_default_executor(run: dict[str, Any],
                                                         name: str) -> None:
    assert name in run, run["stderr"][-4000:]
    default = run["default2"]
    assert len(run[name]) == len(default) == 10
    for k, (a, b) in enumerate(zip(default, run[name], strict=True)):
        assert a == b, f"request {k} differs after the injected faults"


@pytest.mark.parametrize("name", ["ring", "sockets"])
def test_every_injected_fault_was_recovered_by_sending_calls_again(run: dict[str, Any],
                                                                   name: str) -> None:
    faults = run[f"{name}_faults"].split(",")
    assert max(int(f.split(":")[2]) for f in faults) < run[f"{name}_calls"]  # all reached
    assert run[f"{name}_stats"].get("resent_calls", 0) >= len(faults)
    if name == "sockets":  # no ring: every call on the sockets
        assert run["sockets_stats"].get("ring_calls", 0) == 0 < run["sockets_stats"]["socket_calls"]
    for fault in faults:
        what, rank, number = fault.split(":")
        word = "dropped" if what == "drop" else "damaged"
        assert f"rank {rank}: injected fault: call {number} {word}" in run["stderr"]
        assert f"rank {rank}: call {number} missing or damaged" in run["stderr"]
