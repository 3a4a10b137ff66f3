"""A call past its deadline while every rank's link is heard (SPEC §16.5): a model step
stops the group for a restart, anything else fails the executor.  No processes: the
executor's receive is stubbed (nothing arrives) and its ranks are a recording stand-in;
the real thing, a rank hung in a step of a real vLLM: tests/test_vllm_restart.py."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from engine_side.vllm.answers import Answers, Reply  # noqa: E402
from engine_side.vllm.executor import DeltaExecutor  # noqa: E402
from engine_side.vllm.restart import RestartPolicy  # noqa: E402
from protocol.faults import PeerFaults  # noqa: E402


class _Ranks:
    def __init__(self) -> None:
        self.kills = 0

    def kill(self) -> None:
        self.kills += 1

    def dead(self) -> list[int]:
        return []


def _executor(serving: bool = True, restarts: int = 3) -> Any:
    ex: Any = object.__new__(DeltaExecutor)
    ex.world_size, ex.output_rank, ex.stats = 2, 0, Counter()
    ex._answers, ex.is_failed, ex.failure = Answers(2, ex.stats), False, ""
    ex.faults = PeerFaults(logging.getLogger("test.overdue"), "dropped")
    ex._serving, ex._relaunching, ex._died, ex._lost = serving, False, None, None
    ex.restarts, ex.local = RestartPolicy(restarts), _Ranks()
    ex.liveness_s, ex.failure_callback = 0.01, None
    ex._arrived = lambda: False
    ex._model_timeout = lambda: 0.05
    return ex


def _late(step: bool) -> Reply:
    needed = (0,) if step else (0, 1)
    return Reply(lambda _: None, lambda r: r, time.monotonic() - 1, needed, step)


def test_a_late_step_stops_the_group_once_and_names_the_cause() -> None:
    ex = _executor()
    assert ex._receive(_late(True)) == []
    assert ex.local.kills == 1 and not ex.is_failed
    assert ex._lost == (0, "no answer to a step within 0.05 s "
                           "(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS): a rank hangs in a kernel "
                           "or a collective")
    assert ex._receive(_late(True)) == [] and ex.local.kills == 1  # stopping already


@pytest.mark.parametrize(("step", "serving", "restarts"),
                         [(False, True, 3), (True, False, 3), (True, True, 0)])
def test_a_late_call_fails_the_executor_otherwise(step: bool, serving: bool,
                                                   restarts: int) -> None:
    """A control call (check_health's 10 s while a step runs long is no hang to kill),
    a step while the group starts, or with restarts off: the executor fails, as vLLM's."""
    ex = _executor(serving, restarts)
    with pytest.raises(TimeoutError, match="timed out"):
        ex._receive(_late(step))
    assert ex.is_failed and ex.local.kills == 0 and ex._lost is None


def test_a_late_control_call_fails_the_executor_while_the_group_restarts() -> None:
    """A control call replayed by a restart (a warm-up's dummy batch) that times out
    fails the executor: only a step waits for a restart already under way."""
    ex = _executor()
    ex._relaunching = True
    with pytest.raises(TimeoutError, match="timed out"):
        ex._receive(_late(False))
    assert ex.is_failed and ex.local.kills == 0
    ex = _executor()
    ex._relaunching = True
    assert ex._receive(_late(True)) == [] and not ex.is_failed and ex.local.kills == 0


def test_a_call_within_its_deadline_waits() -> None:
    ex = _executor()
    reply = Reply(lambda _: None, lambda r: r, time.monotonic() + 60, (0,), True)
    assert ex._receive(reply) == [] and ex.local.kills == 0 and not ex.is_failed
