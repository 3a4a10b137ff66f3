"""The finish fast path (engine_side/vllm/finish.py, worker_side/vllm/finish.py): requests
of the last batch finish and the others stay, in order, with nothing joining.

It must be invisible: the general path's very frames, and at the worker a
SchedulerOutput equal to the original (tests/vllm_paths.py).  Hand-made streams pin
where it fires and where it leaves the step to the turnover or general path; a
tampered frame shows that a refused finish changes nothing.  Skipped without vLLM.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from test_vllm_turnover import PROMPT, SECRET, _first, _new, _step  # noqa: E402
from vllm_equal import assert_vllm_equal  # noqa: E402
from vllm_paths import run_both_paths  # noqa: E402
from vllm_streams import scheduler_streams  # noqa: E402

from engine_side.vllm import SchedulerOutputEncoder, finish, forecast  # noqa: E402
from protocol import (  # noqa: E402
    codec,  # noqa: E402
    digest,
    lane,
    lane_lists,
    packing,
)
from protocol.errors import InvalidDelta, LocalProtocolError  # noqa: E402
from protocol.messages import Delta  # noqa: E402
from protocol.speedups import C  # noqa: E402
from worker_side.vllm import SchedulerOutputDecoder, decoder  # noqa: E402
from worker_side.vllm import quick as worker_quick  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(C is None, reason="the finish path needs the C speedups")]


def _finishes() -> list[Any]:
    """Five requests; finishes one at a time and two at once, with appends, count and
    output departures, drafts and structured-output flags among the stayers."""
    s = ["a", "b", "c", "d", "e"]
    return [
        _first(s), _step(s, 1),
        _step(["a", "c", "d", "e"], 2, finished_req_ids={"b"}),  # plain: nothing departs
        _step(["a", "d", "e"], 3, finished_req_ids={"c"}, blocks=[([31],), None, ([32, 33],)],
              has_structured_output_requests=True),
        _step(["a", "d", "e"], 4),
        _step(["d"], 5, finished_req_ids={"a", "e"}, computed=[PROMPT + 7], outputs=[9],
              scheduled_spec_decode_tokens={"d": [4, -1]}, nsched={"d": 3},
              num_spec_tokens_to_schedule=2),
        _step(["d"], 6, computed=[PROMPT + 10], outputs=[10], nsched={"d": 1}),
        # a general step of the same batch (a rare field): d's table measured from the
        # lengths the finish steps left
        _step(["d"], 7, computed=[PROMPT + 11], outputs=[11], blocks=[([34],)],
              free_encoder_mm_hashes=["h"]),
    ]


def test_finishes_take_the_finish_path_at_both_ends() -> None:
    steps = _finishes()
    enc, dec = run_both_paths(steps, None, SECRET)
    assert (enc.finish_steps, dec.finish_steps) == (3, 3)
    assert enc.turnover_steps == dec.turnover_steps == 0


def test_the_worker_takes_finishes_on_its_pure_python_paths(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (packing, digest, lane, lane_lists, forecast, worker_quick, decoder):
        monkeypatch.setattr(module, "_C", None)
    enc, dec = run_both_paths(_finishes(), None, SECRET)
    assert (enc.finish_steps, dec.finish_steps) == (3, 3)


def test_each_end_decides_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the C scan the engine's turnover path writes the finish steps -- the same
    bytes -- and the worker still takes them as finish steps."""
    monkeypatch.setattr(finish, "_C", None)
    enc, dec = run_both_paths(_finishes(), None, SECRET)
    assert (enc.finish_steps, enc.turnover_steps) == (0, 3)
    assert (dec.finish_steps, dec.turnover_steps) == (3, 0)


def test_a_general_step_after_a_finish_measures_tables_from_the_stayers() -> None:
    """No block appended since the last general step, then a finish: the next general
    step of the same batch finds its new blocks against the stayers' table lengths."""
    s = ["a", "b", "c"]
    steps = [_first(s), _step(s, 1), _step(["a", "c"], 2, finished_req_ids={"b"}),
             _step(["a", "c"], 3, blocks=[None, ([35],)], free_encoder_mm_hashes=["h"])]
    enc, dec = run_both_paths(steps, None, SECRET)
    assert (enc.finish_steps, dec.finish_steps) == (1, 1)


@pytest.mark.parametrize("name", ["unscheduled_finishes", "one_leaves_unfinished", "joins",
                                  "preempted", "reordered", "all_finish", "freed_blocks"])
def test_steps_the_finish_path_leaves_to_the_others(name: str) -> None:
    s = ["a", "b", "c"]
    lead = [_first(s), _step(s, 1)]
    odd = {
        # a left unscheduled a step ago and finishes now: not the last batch's
        "unscheduled_finishes": [_step(["b", "c"], 2), _step(["b", "c"], 3,
                                                             finished_req_ids={"a"})],
        "one_leaves_unfinished": [_step(["c"], 2, finished_req_ids={"b"})],
        "joins": [_step(["a", "c"], 2, [_new("d", [40])], finished_req_ids={"b"})],
        "preempted": [_step(["a"], 2, finished_req_ids={"b"}, preempted_req_ids={"c"})],
        "reordered": [_step(["c", "a"], 2, finished_req_ids={"b"})],
        "all_finish": [_step([], 2, finished_req_ids={"a", "b", "c"})],
        "freed_blocks": [_step(["a", "c"], 2, finished_req_ids={"b"},
                               free_encoder_mm_hashes=["h"])],
    }[name]
    enc, dec = run_both_paths(lead + odd, None, SECRET)
    assert (enc.finish_steps, dec.finish_steps) == (0, 0)


def test_a_finished_request_still_scheduled_is_the_callers_error() -> None:
    """vLLM never schedules a request it finishes.  Such a step (here b finishes and
    stays while c is dropped) raises LocalProtocolError as the general path does; the
    finish path never encodes it as some other request's finish."""
    s = ["a", "b", "c"]
    steps = [_first(s), _step(s, 1), _step(["a", "b"], 2, finished_req_ids={"b"})]
    for fast in (True, False):
        enc = SchedulerOutputEncoder(secret=SECRET, fast=fast)
        for so in steps[:2]:
            enc.encode(so)
        with pytest.raises(LocalProtocolError, match="never scheduled"):
            enc.encode(steps[2])
        assert enc.finish_steps == 0


def _frames(steps: list[Any]) -> list[list[bytes]]:
    enc = SchedulerOutputEncoder(secret=SECRET)
    return [[bytes(f) for f in enc.encode(so)] for so in steps]


def _tampered(frames: list[bytes], digest: int) -> list[bytes]:
    msg = codec.decode(frames)
    assert isinstance(msg, Delta) and msg.body.finished
    return [bytes(f) for f in codec.encode(Delta(msg.epoch, msg.seq, digest, msg.body))]


def test_a_refused_finish_changes_nothing() -> None:
    """A finish whose digest differs raises InvalidDelta with the decoder unchanged:
    the true frames then decode as if the bad one never came."""
    steps = _finishes()
    frames = _frames(steps)
    dec = SchedulerOutputDecoder(SECRET)
    for so, step in zip(steps[:2], frames[:2], strict=True):
        assert_vllm_equal(so, dec.decode(step))
    state = dec.state
    assert state is not None
    before = (dec.seq, dec.lane.digest, dec.quick.batch, state.schedule.tolist())
    with pytest.raises(InvalidDelta, match="digest mismatch"):
        dec.decode(_tampered(frames[2], 12345))
    assert (dec.seq, dec.lane.digest, dec.quick.batch, state.schedule.tolist()) == before
    for so, step in zip(steps[2:], frames[2:], strict=True):
        assert_vllm_equal(so, dec.decode(step))
    assert dec.finish_steps == 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=scheduler_streams(v2=False, rare=False, max_steps=24)
       | scheduler_streams(v2=True, rare=False, max_steps=24))
def test_generated_streams_with_finishes_give_the_general_paths_frames(
        stream: dict[str, Any]) -> None:
    enc, dec = run_both_paths(stream["steps"], stream["kv_groups"], SECRET)
    event(f"finish steps: {'some' if enc.finish_steps else 'none'}")
    assert dec.finish_steps == enc.finish_steps  # the worker takes every one the engine makes
