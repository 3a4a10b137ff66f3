"""The pieces of a group restart (SPEC §16.5) that need no engine: the restart bound,
the engine's move of resumed requests to new ones (``renew``), the ``ro`` extension
through the encoder and the rank's decoder, and the rank's hand-over to its runner
(``resume``).  tests/test_vllm_restart.py runs the whole of it on a real vLLM."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import msgspec  # noqa: E402

from engine_side.vllm import SchedulerOutputEncoder  # noqa: E402
from engine_side.vllm.restart import RestartPolicy, renew  # noqa: E402
from protocol import codec  # noqa: E402
from protocol.errors import MalformedMessage  # noqa: E402
from protocol.ext import decode_ext, encode_ext  # noqa: E402
from protocol.messages import Delta  # noqa: E402
from protocol.packing import pack_sints  # noqa: E402
from worker_side.vllm import SchedulerOutputDecoder  # noqa: E402
from worker_side.vllm.resume import advance, resume  # noqa: E402

pytestmark = pytest.mark.vllm
SECRET = b"r" * 32
PROMPTS = {"a": [1, 2, 3], "b": [4, 5], "c": [6, 7, 8, 9]}


def test_the_restart_bound_counts_restarts_within_the_window() -> None:
    policy = RestartPolicy(2, 10.0)
    assert [policy.allow(t) for t in (0.0, 1.0, 2.0, 9.9, 10.5, 11.5, 11.6)] == \
        [True, True, False, False, True, True, False]
    assert policy.count == 4
    assert "2 restart(s) within 10 s" in policy.refusal()
    assert not RestartPolicy(0).allow(0.0) and "off" in RestartPolicy(0).refusal()
    for bad in ({"deltacast_restarts": -1}, {"deltacast_restart_window_s": 0},
                {"deltacast_restarts": "many"}):
        with pytest.raises(ValueError):
            RestartPolicy.from_config(bad)


def _request(rid: str, outputs: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams

    return SimpleNamespace(request_id=rid, prompt_token_ids=PROMPTS[rid], mm_features=[],
                           num_prompt_tokens=len(PROMPTS[rid]),
                           sampling_params=SamplingParams(temperature=0), pooling_params=None,
                           num_computed_tokens=99, lora_request=None, prompt_embeds=None,
                           prompt_is_token_ids=None, replay_start=0, output_token_ids=outputs)


def _resumed_step(running_c: bool = True) -> tuple[Any, Any]:
    """(a step where "a" and "b" resume and "c" runs on, or joins as new, the scheduler)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    blocks: list[tuple[list[int], ...] | None] = [None, ([7, 8],), ([9],)]
    cached = CachedRequestData(
        req_ids=["c", "a", "b"][1 - running_c:], resumed_req_ids={"a", "b"}, new_token_ids=[],
        all_token_ids={"a": [1, 2, 3, 40, 41], "b": [4, 5, 50]},
        new_block_ids=blocks[1 - running_c:],
        num_computed_tokens=[12, 0, 0][1 - running_c:], num_output_tokens=[3, 2, 1][1 - running_c:])
    new = [] if running_c else [NewRequestData("c", PROMPTS["c"], [], SamplingParams(
        temperature=0), None, ([3],), 0, None)]
    so = SchedulerOutput(new, cached, {"c": 1 if running_c else 4, "a": 5, "b": 3}, 12, {},
                         {}, {"gone"} if running_c else set(), [],
                         preempted_req_ids={"x"} if running_c else set())
    scheduler = SimpleNamespace(requests={r: _request(r, []) for r in ("a", "b", "c")})
    return so, scheduler


def test_renew_sends_resumed_requests_the_new_group_never_saw_as_new() -> None:
    so, scheduler = _resumed_step()
    unsent = {"a", "b", "gone", "x"}
    out, tokens = renew(so, scheduler, unsent)
    assert tokens == {"a": [40, 41], "b": [50]}
    assert [(n.req_id, n.prompt_token_ids, n.block_ids, n.num_computed_tokens)
            for n in out.scheduled_new_reqs] == [("a", [1, 2, 3], ([7, 8],), 0),
                                                 ("b", [4, 5], ([9],), 0)]
    c = out.scheduled_cached_reqs
    assert (c.req_ids, c.resumed_req_ids, c.all_token_ids, c.num_output_tokens) == \
        (["c"], set(), {}, [3])
    assert out.finished_req_ids == set() and out.preempted_req_ids == set()  # never seen
    assert unsent == {"x"}
    assert so.scheduled_cached_reqs.req_ids == ["c", "a", "b"]  # the engine's is untouched
    same, none = renew(so, scheduler, set())
    assert same is so and none == {}



def test_a_request_waiting_at_the_restart_is_seen_once_it_runs() -> None:
    """A request never scheduled before the restart joins the new group as new; resumed
    after a later preemption, it is the group's own (not sent as new again)."""
    joins, scheduler = _resumed_step(running_c=False)  # "c" joins, "a" and "b" resume
    unsent = {"c", "a", "b", "w"}  # ("w" waits on)
    renew(joins, scheduler, unsent)
    assert unsent == {"w"}


class _Runner:
    """What ``resume`` uses of vLLM's model runner: execute_model and its requests."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.steps: list[Any] = []

    def execute_model(self, so: Any) -> None:
        self.steps.append(so)
        for nr in so.scheduled_new_reqs:
            self.requests[nr.req_id] = SimpleNamespace(output_token_ids=[], generator=None)


def test_restored_requests_cross_the_wire_and_resume_on_the_runner() -> None:
    so, scheduler = _resumed_step(running_c=False)
    enc, dec = SchedulerOutputEncoder(1, secret=SECRET), SchedulerOutputDecoder(SECRET)
    first, tokens = renew(so, scheduler, {"a", "b", "c"})
    frames = [bytes(f) for f in enc.encode(first, tokens)]
    got = dec.decode(frames)
    assert dec.restored == {"a": [40, 41], "b": [50]}
    runner = _Runner()
    resume(runner, got, dec.restored)
    register = runner.steps[0]
    assert [n.req_id for n in register.scheduled_new_reqs] == ["a", "b"]
    assert register.total_num_scheduled_tokens == 0
    assert register.num_scheduled_tokens == {"c": 0, "a": 0, "b": 0}  # "c" stays batched
    assert runner.requests["a"].output_token_ids == [40, 41]
    c = got.scheduled_cached_reqs
    assert [n.req_id for n in got.scheduled_new_reqs] == ["c"]
    assert c.req_ids[-2:] == ["a", "b"] and c.resumed_req_ids == {"a", "b"}
    assert c.all_token_ids["a"] == [1, 2, 3, 40, 41] and c.num_output_tokens[-2:] == [2, 1]
    assert c.new_block_ids[-2:] == [([7, 8],), ([9],)]
    nothing = SchedulerOutputDecoder(SECRET)
    nothing.decode([bytes(f) for f in SchedulerOutputEncoder(1, secret=SECRET).encode(first)])
    assert nothing.restored == {}


def test_restored_tokens_naming_no_new_request_are_refused_unchanged() -> None:
    so, scheduler = _resumed_step(running_c=False)
    first, tokens = renew(so, scheduler, {"a", "b", "c"})
    good = [bytes(f) for f in SchedulerOutputEncoder(1, secret=SECRET).encode(first, tokens)]
    msg = codec.decode(good)
    assert isinstance(msg, Delta)
    ext = decode_ext(msg.body.extension)
    dec = SchedulerOutputDecoder(SECRET)
    for bad in ((3, pack_sints([1])), (-1, b""), (0, pack_sints([1]))):
        twice = (bad,) if bad[0] else ((0, pack_sints([7])), bad)
        body = msgspec.structs.replace(msg.body, extension=encode_ext(
            msgspec.structs.replace(ext, restored=twice)))
        with pytest.raises(MalformedMessage, match="restored"):
            dec.decode([bytes(f) for f in codec.encode(msgspec.structs.replace(msg,
                                                                                body=body))])
    assert dec.seq == 0
    dec.decode(good)
    assert dec.restored == {"a": [40, 41], "b": [50]}


@pytest.mark.parametrize("path", ["forward_cpu", "forward_native"])
def test_a_seeded_generator_is_advanced_by_the_draws_already_made(path: str) -> None:
    """A restarted rank's generator, seeded afresh and advanced by three sampled tokens,
    samples what the undisturbed generator sampled from its fourth token on (vLLM's
    own sampler draws; CPU and native paths)."""
    import torch
    import vllm._C  # noqa: F401  (the CPU build's kernels: fused_gumbel_argmax)
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler()
    sampler.forward = getattr(sampler, path)
    runner = SimpleNamespace(sampler=SimpleNamespace(topk_topp_sampler=sampler),
                             model_config=SimpleNamespace(get_vocab_size=lambda: 64))
    logits = torch.zeros(1, 64)  # uniform: every token is as likely

    def sample(gen: torch.Generator, n: int) -> list[int]:
        return [int(sampler.forward(logits.clone(), {0: gen}, None, None)[0][0])
                for _ in range(n)]

    undisturbed = sample(torch.Generator().manual_seed(7), 8)
    restarted = torch.Generator().manual_seed(7)
    advance(runner, restarted, 3)
    assert sample(restarted, 5) == undisturbed[3:]
    assert sample(torch.Generator().manual_seed(7), 5) != undisturbed[3:]  # (not by chance)
