"""The count rows of a same-batch step in C (protocol/_speedups_counts.c) against their
Python references: the engine's ``count_rows`` (engine_side.vllm.quick.count_rows_py),
the worker's ``count_lists`` (worker_side.vllm.quick.count_lists_py) and ``lane_rows``
(protocol.lane_lists.lane_rows on its Python lines).  Each must
give its reference's answer for every input it takes, refuse (None, nothing changed)
only inputs past int64 or out of range, and take every ordinary step.  The steady
lane's fused ``lane_counts`` is held to ReplicaState.apply by tests/test_lane.py."""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="the same-batch modules are vLLM's adapters")

from vllm_paths import run_both_paths  # noqa: E402

from engine_side.vllm.quick import count_rows_py  # noqa: E402
from protocol import lane, lane_lists  # noqa: E402
from protocol.messages import DeltaBody, Rows  # noqa: E402
from protocol.packing import pack_sints, pack_uints  # noqa: E402
from protocol.speedups import C  # noqa: E402
from worker_side.vllm.quick import count_lists_py  # noqa: E402

pytestmark = pytest.mark.skipif(C is None, reason="C speedups not built")
I64 = (1 << 63) - 1


def _near(draw: st.DrawFn, values: list[int], wide: bool) -> list[int]:
    """``values`` with some entries moved a little (or, when ``wide``, to int64's edges
    and past them)."""
    moves = st.sampled_from([0, 0, 0, 0, 1, -1, 3, -40])
    edges = st.sampled_from([I64, -I64 - 1, I64 + 1, 1 << 62, -(1 << 62)])
    return [draw(edges) if wide and draw(st.integers(0, 9)) == 0 else v + draw(moves)
            for v in values]


@st.composite
def _count_steps(draw: st.DrawFn) -> tuple[list[int], ...]:
    """(computed, outputs, basis, nsched_before, nsched, plen_less_one) of a batch."""
    n = draw(st.integers(0, 40))
    wide = draw(st.integers(0, 4)) == 0
    basis = [draw(st.integers(0, 5000)) for _ in range(n)]
    before = [draw(st.integers(0, 6)) for _ in range(n)]
    plm1 = [draw(st.integers(0, 5000)) for _ in range(n)]
    computed = _near(draw, [b + s for b, s in zip(basis, before, strict=True)], wide)
    outputs = _near(draw, [max(c - p, 0) for c, p in zip(computed, plm1, strict=True)], wide)
    nsched = _near(draw, before, wide)
    return computed, outputs, basis, before, nsched, plm1


def _fits_int64(*lists: list[int]) -> bool:
    return all(-I64 - 1 <= v <= I64 for values in lists for v in values)


@settings(max_examples=300, deadline=None)
@given(step=_count_steps())
@example(step=([5, 7], [0, 0], [4, 6], [1, 1], [1, 1], [9, 9]))  # on the forecast
@example(step=([-1], [0], [4], [1], [1], [9]))  # a moved count below zero: refused
def test_count_rows_answers_as_its_reference(step: tuple[list[int], ...]) -> None:
    assert C is not None
    got = C.count_rows(*step)
    if got is None:  # refused: only values past int64, or what the reference refuses
        try:
            want = count_rows_py(*step)
        except (ValueError, OverflowError):
            want = None  # a value the packers refuse
        assert want is None or not _fits_int64(*step) or any(
            abs(v) > 1 << 62 for values in step for v in values)
        return
    assert got == count_rows_py(*step)
    computed, scheduled, outputs, made = got
    assert made == step[0] and made is not step[0]  # a copy for the forecast


def test_count_rows_takes_a_speculative_step() -> None:
    """A step of accepted drafts: every kind of row at once, each packed."""
    assert C is not None
    basis, before, plm1 = [100, 200, 300], [5, 1, 3], [90, 190, 290]
    computed, outputs, nsched = [103, 201, 303], [13, 11, 13], [2, 5, 3]
    got = C.count_rows(computed, outputs, basis, before, nsched, plm1)
    assert got is not None
    rows, sched, outs, _ = got
    assert rows == ([0], [-2], pack_uints([0]), pack_sints([-2]))
    assert sched == ([0, 1], [2, 5], pack_uints([0, 1]), pack_uints([2, 5]))
    assert outs is None
    assert C.count_rows(computed, outputs, basis, before, (2, 5, 3), plm1) is None  # a tuple


@st.composite
def _worker_steps(draw: st.DrawFn) -> dict[str, Any]:
    """count_lists' arguments: rows mostly in range, sometimes out of it or past int64."""
    n = draw(st.integers(1, 30))
    bad = draw(st.integers(0, 9)) == 0
    batch = [f"r{i}" for i in range(n)]
    position = st.integers(0, n if bad else n - 1)
    move = st.integers(-5, 5) | (st.sampled_from([I64, I64 + 1]) if bad else st.just(0))

    def rows(values: st.SearchStrategy[int]) -> tuple[list[int], list[int]] | None:
        if draw(st.booleans()):
            return None
        at = draw(st.lists(position, max_size=5, unique=True))
        return at, [draw(values) for _ in at]

    out_at = draw(st.lists(position, max_size=4, unique=True))
    out_moves = [draw(st.integers(-3, 3)) for _ in out_at]
    return {
        "basis": [draw(st.integers(10, 900)) for _ in range(n)],
        "nsched_before": [draw(st.integers(1, 5)) for _ in range(n)],
        "plen_less_one": [draw(st.integers(0, 900)) for _ in range(n)],
        "computed_rows": rows(move), "scheduled_rows": rows(st.integers(0, 6)),
        "out_pos": pack_uints(out_at) if out_at else b"",
        "out_delta": pack_sints(out_moves) if out_at else b"",
        "batch": batch, "nsched_map": dict.fromkeys(batch, 1)}


def _call(fn: Any, args: dict[str, Any]) -> Any:
    return fn(**args) if fn is count_lists_py else fn(*args.values())


@settings(max_examples=300, deadline=None)
@given(args=_worker_steps())
def test_count_lists_answers_as_its_reference(args: dict[str, Any]) -> None:
    assert C is not None
    mine, theirs = copy.deepcopy(args), copy.deepcopy(args)
    got = _call(C.count_lists, mine)
    if got is None:  # refused: nothing changed, and the reference fails or overflows
        assert mine == args
        try:
            want = _call(count_lists_py, theirs)
        except IndexError:
            return
        assert not _fits_int64(*want[:2])
        return
    assert got == _call(count_lists_py, theirs)
    assert mine["nsched_map"] == theirs["nsched_map"]
    assert list(mine["nsched_map"]) == args["batch"]  # key order kept


def test_count_lists_refuses_malformed_output_rows_unchanged() -> None:
    assert C is not None
    names = {"a": 1, "b": 1}
    args = ([5, 6], [1, 1], [0, 0], None, ([1], [3]), b"\x07", b"", ["a", "b"], names)
    assert C.count_lists(*args) is None
    assert names == {"a": 1, "b": 1}


def _packed(draw: st.DrawFn, signed: bool = False) -> bytes:
    """A packed array: mostly well formed, sometimes empty, truncated or 64 bits wide."""
    kind = draw(st.sampled_from(["ok"] * 6 + ["empty", "cut", "wide"]))
    values = draw(st.lists(st.integers(-3 if signed else 0, 9), max_size=6))
    if kind == "wide":
        return pack_uints([(1 << 64) - 1, 1])
    packed = (pack_sints if signed else pack_uints)(values)
    return b"" if kind == "empty" else packed[:-1] if kind == "cut" and len(packed) > 2 \
        else packed


@st.composite
def _lane_bodies(draw: st.DrawFn) -> tuple[DeltaBody, int]:
    n = draw(st.integers(0, 8))
    fields: dict[str, Any] = {}
    if draw(st.booleans()):
        fields["computed_tokens"] = Rows(handles=_packed(draw), values=_packed(draw, True))
    if draw(st.booleans()):
        fields["scheduled_tokens"] = Rows(handles=_packed(draw), values=_packed(draw))
    if draw(st.booleans()):
        fields["spec_tokens"] = Rows(handles=b"" if draw(st.integers(0, 5)) else _packed(draw),
                                     counts=_packed(draw), values=_packed(draw))
    return DeltaBody(**fields), n


@settings(max_examples=300, deadline=None)
@given(case=_lane_bodies())
def test_lane_rows_in_c_lists_what_python_lists(case: tuple[DeltaBody, int]) -> None:
    """lane_rows with the C unpacking and on the Python lines: the same rows, or the same
    refusal (None) -- fresh lists each time."""
    body, n = case
    with_c = lane_lists.lane_rows(body, n)
    with mock.patch.object(lane_lists, "_C", None):
        assert lane_lists.lane_rows(body, n) == with_c
    if with_c is not None and with_c.scheduled is not None and with_c.computed is not None:
        assert with_c.scheduled[0] is not with_c.computed[0]  # never one shared list


PROMPT = 40
SECRET = b"s" * 32


def _prefill(ids: list[str]) -> Any:
    """The first step of a stream: every request of ``ids`` prefills its PROMPT tokens."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = [NewRequestData(rid, list(range(PROMPT)), [], SamplingParams(temperature=0), None,
                          ([k],), 0, None) for k, rid in enumerate(ids)]
    return SchedulerOutput(new, CachedRequestData.make_empty(), dict.fromkeys(ids, PROMPT),
                           PROMPT * len(ids), {}, {}, set(), [], preempted_req_ids=set())


@st.composite
def _speculative_streams(draw: st.DrawFn) -> list[Any]:
    """A batch, then same-batch steps as speculative decoding makes them: drafts for
    some requests, scheduled counts of one plus the drafts (sometimes not), computed
    counts advanced by the tokens accepted, output counts that now and then depart from
    the forecast, blocks appended and the step flags set at random."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    n = draw(st.integers(1, 12))
    ids = [f"r{i}" for i in range(n)]
    steps: list[Any] = [_prefill(ids)]
    computed, nsched, block = [PROMPT] * n, [PROMPT] * n, 100
    for _ in range(draw(st.integers(1, 8))):
        accepted = [s - draw(st.integers(0, max(s - 1, 0))) if s > 1 else s for s in nsched]
        computed = [c + a for c, a in zip(computed, accepted, strict=True)]
        drafts = {rid: draw(st.lists(st.integers(-1, 500), min_size=1, max_size=4))
                  for rid in ids if draw(st.booleans())}
        nsched = [1 + len(drafts.get(rid, [])) + (draw(st.integers(0, 2))
                                                  if draw(st.integers(0, 9)) == 0 else 0)
                  for rid in ids]
        outputs = [max(c - PROMPT + 1, 0) + (draw(st.integers(-1, 2))
                                               if draw(st.integers(0, 7)) == 0 else 0)
                   for c in computed]
        blocks: list[Any] = []
        for _rid in ids:
            grow = draw(st.integers(0, 5))
            blocks.append(None if grow > 1 else ([block + j for j in range(grow + 1)],))
            block += 3
        cached = CachedRequestData(list(ids), set(), [], {}, blocks, list(computed),
                                   [max(o, 0) for o in outputs])
        steps.append(SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(zip(ids, nsched, strict=True)),
            total_num_scheduled_tokens=sum(nsched), scheduled_spec_decode_tokens=drafts,
            scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
            preempted_req_ids=set(),
            has_structured_output_requests=draw(st.integers(0, 4)) == 0,
            pending_structured_output_tokens=draw(st.integers(0, 4)) == 0,
            num_spec_tokens_to_schedule=draw(st.sampled_from([0, 4]))))
    return steps


@pytest.fixture(params=["c", "pure"])
def speedups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the C speedups and again on the pure-Python paths."""
    from engine_side.vllm import finish, forecast
    from engine_side.vllm import quick as engine_quick
    from protocol import digest, packing
    from worker_side.vllm import decoder
    from worker_side.vllm import quick as worker_quick

    if request.param == "pure":
        for module in (packing, digest, lane, lane_lists, forecast, engine_quick, worker_quick,
                       decoder, finish):
            monkeypatch.setattr(module, "_C", None)
    return str(request.param)


@settings(max_examples=60, deadline=None,  # the fixture only patches modules: shared is fine
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=_speculative_streams())
def test_speculative_steps_give_the_general_paths_frames(steps: list[Any],
                                                         speedups: str) -> None:
    """Same-batch steps with drafts and count departures (the fused C calls above: the
    engine's scan, the lane's count step, the worker's rows and SchedulerOutput) give
    the general path's frames and the original objects, with and without the speedups;
    every step after the first takes the fast path on both ends."""
    enc, dec = run_both_paths(steps, 1, SECRET)
    assert enc.quick_steps == dec.quick_steps == len(steps) - 1
    _settles_to_the_general_state(enc, steps)


def _settles_to_the_general_state(enc: Any, steps: list[Any]) -> None:
    """``enc``'s mirror, its lane settled, rebuilds what a general-path encoder's does
    after ``steps`` (the lane's last step -- a body, or a frame it wrote -- included)."""
    from engine_side.vllm import SchedulerOutputEncoder
    from protocol.request import request_differences

    slow = SchedulerOutputEncoder(1, secret=SECRET, fast=False)
    for so in steps:
        slow.encode(so)
    enc.lane.settle()
    assert slow.mirror is not None
    assert request_differences(enc.mirror.state.rebuild(), slow.mirror.state.rebuild()) == []


class _OutputDeclined:
    """The speedups, but ``counted_step`` leaves the output to the caller, as when its
    ``count_output`` does not take the rows (the lane's step is then already done)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(C, name)

    @staticmethod
    def counted_step(*args: Any) -> Any:
        assert C is not None  # noqa: S101 - the module skips without the speedups
        got = C.counted_step(*args)
        return (got[0], None, *got[2:]) if type(got) is tuple else got


@settings(max_examples=30, deadline=None)
@given(steps=_speculative_streams())
def test_a_counted_step_whose_output_c_declines_answers_from_the_lines(
        steps: list[Any]) -> None:
    """The worker's one-call count step keeps the lane's step and makes the
    SchedulerOutput on the Python lines when C does not make it: the same frames and
    objects as the general path, every step on the fast path."""
    from worker_side.vllm import quick as worker_quick

    with mock.patch.object(worker_quick, "_C", _OutputDeclined()):
        enc, dec = run_both_paths(steps, 1, SECRET)
    assert enc.quick_steps == dec.quick_steps == len(steps) - 1


class _FrameDeclined:
    """The speedups, but ``lane_frame`` takes nothing (as for values it refuses)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(C, name)

    @staticmethod
    def lane_frame(*args: Any) -> None:
        return None


@settings(max_examples=30, deadline=None)
@given(steps=_speculative_streams())
def test_a_counted_step_whose_frame_c_declines_is_encoded_from_the_objects(
        steps: list[Any]) -> None:
    """The engine's one-call count step keeps the lane's step and encodes the body's
    objects when C does not write the frame: the general path's frames, every step on
    the fast path."""
    from engine_side.vllm import encoder

    with mock.patch.object(encoder, "_C", _FrameDeclined()):
        enc, dec = run_both_paths(steps, 1, SECRET)
    assert enc.quick_steps == dec.quick_steps == len(steps) - 1
    _settles_to_the_general_state(enc, steps)


@settings(max_examples=30, deadline=None)
@given(steps=_speculative_streams(), at=st.integers(1, 8))
def test_a_counted_step_with_a_wrong_digest_raises_and_changes_nothing(
        steps: list[Any], at: int) -> None:
    """A count step whose Delta carries a wrong digest raises InvalidDelta at the
    worker, which then decodes the true frames of that step and every later one as
    if the bad one had never come."""
    from vllm_equal import assert_vllm_equal

    from engine_side.vllm import SchedulerOutputEncoder
    from protocol import codec
    from protocol.errors import InvalidDelta
    from protocol.messages import Delta
    from worker_side.vllm import SchedulerOutputDecoder

    enc, dec = SchedulerOutputEncoder(1, secret=SECRET), SchedulerOutputDecoder(SECRET)
    for k, so in enumerate(steps):
        expected = copy.deepcopy(so)
        frames = [bytes(f) for f in enc.encode(so)]
        msg = codec.decode(frames)
        assert isinstance(msg, Delta)
        if k == min(at, len(steps) - 1) and msg.body.computed_tokens is not None:
            bad = codec.encode(Delta(msg.epoch, msg.seq, (msg.digest + 1) % (1 << 64),
                                     msg.body))
            with pytest.raises(InvalidDelta):
                dec.decode(bad)
        assert_vllm_equal(expected, dec.decode(frames))


def _forecast_stream(n: int, steps: int, shape: str) -> list[Any]:
    """A batch, then steps whose counts are all the forecast's, so without count rows:
    ``drafts`` two a request, all accepted; ``outputs`` one token each and one request's
    output count off the forecast every step (output rows alone); ``nspec`` one token
    each and num_spec_tokens_to_schedule set (speculative decoding that drafted
    nothing).  Blocks now and then."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    ids = [f"r{i}" for i in range(n)]
    out: list[Any] = [_prefill(ids)]
    width = 3 if shape == "drafts" else 1
    computed, nsched = [PROMPT] * n, [PROMPT] * n
    for t in range(steps):
        computed = [c + s for c, s in zip(computed, nsched, strict=True)]
        nsched = [width] * n
        blocks: list[Any] = [([1000 + 10 * t + k],) if (t + k) % 3 == 0 else None
                             for k in range(n)]
        outputs = [c - PROMPT + 1 + (shape == "outputs" and k == t % n)
                   for k, c in enumerate(computed)]
        cached = CachedRequestData(list(ids), set(), [], {}, blocks, list(computed), outputs)
        out.append(SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict.fromkeys(ids, width),
            total_num_scheduled_tokens=width * n,
            scheduled_spec_decode_tokens={rid: [t, t + 1] for rid in ids}
            if shape == "drafts" else {},
            scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
            preempted_req_ids=set(), num_spec_tokens_to_schedule=4 * (shape != "outputs")))
    return out


@pytest.mark.parametrize("shape", ["drafts", "outputs", "nspec"])
def test_steps_without_count_rows_take_the_one_call_paths(shape: str) -> None:
    """Steps whose counts are all the forecast's but that carry drafts, output counts off
    it or a number of speculative tokens: after the first one of the new width (count
    rows), none has count rows, and none is a plain step.  The engine writes their frames
    in one call, the worker reads them in one (lane_view) and answers in another, and
    both give the general paths' frames and objects."""
    from engine_side.vllm import SchedulerOutputEncoder
    from worker_side.vllm.quick import QuickDecoder

    assert C is not None
    steps = _forecast_stream(4, 6, shape)
    enc = SchedulerOutputEncoder(1, secret=SECRET)
    views = [C.lane_view(bytes(enc.encode(so)[0])) for so in steps]
    assert views[0] is None and views[1] is not None  # (the first of the width: count rows)
    # (computed, scheduled, drafts present, output positions present, nspec)
    assert [(v[3], v[4], v[5] is not None, v[7] != b"", v[11]) for v in views[2:]] == \
        [(None, None, shape == "drafts", shape == "outputs", 4 * (shape != "outputs"))] * 5
    # (the worker's one call makes the output: the Python lines that would are not called)
    with mock.patch.object(QuickDecoder, "scheduler_output", side_effect=AssertionError):
        fast_enc, dec = run_both_paths(steps, 1, SECRET)
    assert fast_enc.quick_steps == dec.quick_steps == len(steps) - 1
    _settles_to_the_general_state(fast_enc, steps)
