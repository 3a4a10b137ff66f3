"""The turnover fast path (engine_side/vllm/turnover.py): requests leave the batch and
new ones join at its end.

Like the same-batch path it must be invisible: the very frames of the general path
(an encoder built with ``fast=False``), and a SchedulerOutput equal to the original
at the worker.  Hand-made streams pin where it must fire and where it must not;
generated streams and the synthetic churn cover the rest.  Skipped without vLLM.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm_paths import run_both_paths  # noqa: E402
from vllm_streams import scheduler_streams  # noqa: E402

from engine_side.bench.vllm_replay import synthetic_churn  # noqa: E402
from engine_side.vllm import finish, forecast, quick, turnover  # noqa: E402
from protocol import digest, lane, lane_lists, packing  # noqa: E402
from protocol.speedups import C  # noqa: E402
from worker_side.vllm import decoder  # noqa: E402
from worker_side.vllm import quick as worker_quick  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPT = 40
SECRET = b"t" * 32  # connector metadata in generated streams travels sealed


def _run(steps: list[Any], kv_groups: int | None = None) -> tuple[int, int]:
    """Every step through fast and general encoders and decoders (tests/vllm_paths.py).
    Returns the turnover steps of the fast encoder and decoder."""
    enc, dec = run_both_paths(steps, kv_groups, SECRET)
    return enc.turnover_steps, dec.turnover_steps


@pytest.fixture(params=["c", "pure"])
def speedups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the C speedups and again on the pure-Python paths."""
    if request.param == "pure":
        for module in (packing, digest, lane, lane_lists, forecast, quick, worker_quick,
                       turnover, decoder, finish):
            monkeypatch.setattr(module, "_C", None)
    elif C is None:
        pytest.skip("C speedups not built")
    return str(request.param)


def _new(rid: str, blocks: list[int], prompt: list[int] | None = None,
         computed: int = 0) -> NewRequestData:
    return NewRequestData(rid, list(range(PROMPT)) if prompt is None else prompt, [],
                          SamplingParams(temperature=0), None, (blocks,), computed, None)


def _first(ids: list[str]) -> SchedulerOutput:
    new = [_new(rid, [10 * k]) for k, rid in enumerate(ids)]
    return SchedulerOutput(new, CachedRequestData.make_empty(), dict.fromkeys(ids, PROMPT),
                           PROMPT * len(ids), {}, {}, set(), [], preempted_req_ids=set())


def _step(stay: list[str], t: int, new: list[NewRequestData] = (),  # type: ignore[assignment]
          **changes: Any) -> SchedulerOutput:
    """Decode step ``t`` of ``stay`` (one token each, as predicted) plus ``new`` joining."""
    cached = CachedRequestData(
        list(stay), changes.pop("resumed", set()), [], changes.pop("all_tokens", {}),
        changes.pop("blocks", [None] * len(stay)),
        changes.pop("computed", [PROMPT + t - 1] * len(stay)),
        changes.pop("outputs", [t] * len(stay)))
    nsched = changes.pop("nsched", {**dict.fromkeys(stay, 1),
                                    **{nr.req_id: len(nr.prompt_token_ids or []) for nr in new}})
    fields = {"scheduled_spec_decode_tokens": {}, "scheduled_encoder_inputs": {},
              "finished_req_ids": set(), "free_encoder_mm_hashes": [],
              "preempted_req_ids": set(), **changes}
    return SchedulerOutput(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens=nsched,
                           total_num_scheduled_tokens=sum(nsched.values()), **fields)


def test_finishes_joins_and_preemptions_take_the_turnover_path(speedups: str) -> None:
    long = list(range(100, 164))  # 64 tokens: a prefix the next joins reference
    steps = [
        _first(["a", "b", "c"]), _step(["a", "b", "c"], 1),
        # b finishes, d joins (several blocks) while a grows a block
        _step(["a", "c"], 2, [_new("d", [40, 41], long)], finished_req_ids={"b"},
              blocks=[([30],), None]),
        # c is preempted; e joins with d's prompt prefix; an unknown id finishes too
        _step(["a", "d"], 3, [_new("e", [50, 51], long[:48] + [7, 8])],
              preempted_req_ids={"c"}, finished_req_ids={"zz"},
              computed=[PROMPT + 2, 64], outputs=[3, 1]),
        # a leaves unscheduled; two join, the second sharing the first's new prompt
        _step(["d", "e"], 4, [_new("f", [], list(range(500, 532))),
                              _new("g", [60], list(range(500, 540)), computed=16)],
              computed=[65, 50], outputs=[2, 1], nsched={"d": 1, "e": 3, "f": 32, "g": 24},
              blocks=[([],), ([52, 53],)]),
        # a count departure and an output-count departure among the stayers
        _step(["d", "e", "f", "g"], 5, finished_req_ids={"a"},
              computed=[66, 53, 32, 40], outputs=[3, 2, 1, 5]),
        # g finishes while d and f draft (a placeholder among them) and h joins
        _step(["d", "e", "f"], 6, [_new("h", [70])], finished_req_ids={"g"},
              computed=[67, 54, 33], outputs=[4, 3, 2],
              scheduled_spec_decode_tokens={"d": [3, -1], "f": [9]},
              nsched={"d": 3, "e": 1, "f": 2, "h": PROMPT}, num_spec_tokens_to_schedule=2),
    ]
    assert _run(steps) == (4, 4)


@pytest.mark.parametrize("name", ["reordered", "joins_first", "live_again", "resumed",
                                  "drafts_out_of_order", "finished_scheduled",
                                  "preempted_none"])
def test_steps_the_turnover_path_leaves_to_the_general_path(name: str) -> None:
    s = ["a", "b", "c"]
    odd = {
        "reordered": lambda: _step(["c", "a"], 2, finished_req_ids={"b"}),
        "joins_first": lambda: _step(["a", "c"], 2, [_new("d", [40])], finished_req_ids={"b"},
                                     nsched={"d": PROMPT, "a": 1, "c": 1}),
        "live_again": lambda: _step(["a", "c"], 2, [_new("b", [40])]),
        "resumed": lambda: _step(["a", "b"], 2, resumed={"b"}, blocks=[None, ([90],)],
                                 all_tokens={"b": list(range(PROMPT + 1))}),
        "drafts_out_of_order": lambda: _step(["a", "c"], 2, finished_req_ids={"b"},
                                             scheduled_spec_decode_tokens={"c": [4], "a": [5]},
                                             nsched={"a": 2, "c": 2}),
        "finished_scheduled": lambda: _step(["a", "c"], 2, finished_req_ids={"c"}),
        "preempted_none": lambda: _step(["a", "c"], 2, finished_req_ids={"b"},
                                        preempted_req_ids=None),
    }[name]
    if name in ("finished_scheduled",):  # vLLM never sends it: the general path refuses
        with pytest.raises(Exception):  # noqa: B017, PT011 - whichever error it names
            _run([_first(s), _step(s, 1), odd()])
        return
    assert _run([_first(s), _step(s, 1), odd()]) == (0, 0)


def test_two_kv_groups_take_the_general_path() -> None:
    new = [NewRequestData(rid, list(range(PROMPT)), [], SamplingParams(temperature=0), None,
                          ([10 * k], [10 * k + 1]), 0, None) for k, rid in enumerate("ab")]
    first = SchedulerOutput(new, CachedRequestData.make_empty(), dict.fromkeys("ab", PROMPT),
                            2 * PROMPT, {}, {}, set(), [], preempted_req_ids=set())
    assert _run([first, _step(["a"], 1, finished_req_ids={"b"})]) == (0, 0)


@pytest.mark.parametrize("running", [4, 64])
def test_synthetic_churn_is_all_turnover(running: int, speedups: str) -> None:
    steps = [so for kind, so in synthetic_churn(running, 12) if kind == "execute_model"]
    assert _run(steps) == (len(steps) - 1,) * 2  # every step after the first


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=scheduler_streams() | scheduler_streams(v2=False, rare=False, max_steps=16))
def test_generated_streams_give_the_general_paths_frames(stream: dict[str, Any]) -> None:
    enc, dec = run_both_paths(stream["steps"], stream["kv_groups"], SECRET)
    event(f"turnover steps: {'some' if enc.turnover_steps else 'none'}")
    event(f"finish steps: {'some' if enc.finish_steps else 'none'}")
    # every turnover or finish body the engine makes, the worker takes
    assert dec.turnover_steps >= enc.turnover_steps
    assert dec.finish_steps == enc.finish_steps
