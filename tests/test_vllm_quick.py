"""The same-batch fast path (engine_side/vllm/quick.py, worker_side/vllm/quick.py).

The fast path must be invisible: the same frames as the general path, and a
SchedulerOutput equal to the original whichever path each end takes.  Hand-made
streams pin where it must fire and where it must not.  Skipped without vLLM.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm_equal import assert_vllm_equal  # noqa: E402
from vllm_paths import run_both_paths  # noqa: E402
from vllm_streams import scheduler_streams  # noqa: E402

from engine_side.vllm import (
    SchedulerOutputEncoder,  # noqa: E402
    finish,  # noqa: E402
    forecast,  # noqa: E402
    quick,  # noqa: E402
    rare,  # noqa: E402
)
from engine_side.vllm import encoder as encoder_module  # noqa: E402
from engine_side.vllm.forecast import Forecast  # noqa: E402
from protocol import digest, lane, lane_lists, packing  # noqa: E402
from protocol.errors import LocalProtocolError  # noqa: E402
from protocol.messages import DeltaBody, Rows  # noqa: E402
from protocol.speedups import C  # noqa: E402
from worker_side.vllm import SchedulerOutputDecoder, decoder  # noqa: E402
from worker_side.vllm import quick as worker_quick  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPT = 40
IDS = ["a", "b", "c"]
SECRET = b"q" * 32


def _run(steps: list[Any], kv_groups: int | None = None) -> tuple[int, int]:
    """Every step through fast and general encoders and decoders (tests/vllm_paths.py).
    Returns how many steps each same-batch fast path took."""
    enc, dec = run_both_paths(steps, kv_groups, SECRET)
    return enc.quick_steps, dec.quick_steps


@pytest.fixture(params=["c", "pure"])
def speedups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the C speedups and again on the pure-Python paths."""
    if request.param == "pure":
        for module in (packing, digest, lane, lane_lists, forecast, quick, worker_quick,
                       decoder, finish):
            monkeypatch.setattr(module, "_C", None)
    elif C is None:
        pytest.skip("C speedups not built")
    return str(request.param)


def _first(groups: int = 1) -> SchedulerOutput:
    new = [NewRequestData(rid, list(range(PROMPT)), [], SamplingParams(temperature=0), None,
                          tuple([10 * k + g] for g in range(groups)), 0, None)
           for k, rid in enumerate(IDS)]
    return SchedulerOutput(new, CachedRequestData.make_empty(), dict.fromkeys(IDS, PROMPT),
                           PROMPT * len(IDS), {}, {}, set(), [], preempted_req_ids=set())


def _step(t: int, ids: list[str] | None = None, **changes: Any) -> SchedulerOutput:
    """Decode step ``t`` (1, 2, ...) of the batch: one token each, computed as predicted."""
    ids = IDS if ids is None else ids
    cached = CachedRequestData(
        list(ids), changes.pop("resumed", set()), [], changes.pop("all_tokens", {}),
        changes.pop("blocks", [None] * len(ids)),
        changes.pop("computed", [PROMPT + t - 1] * len(ids)),
        changes.pop("outputs", [t] * len(ids)))
    nsched = changes.pop("nsched", dict.fromkeys(ids, 1))
    fields = {"scheduled_spec_decode_tokens": {}, "scheduled_encoder_inputs": {},
              "finished_req_ids": set(), "free_encoder_mm_hashes": [],
              "preempted_req_ids": set(), **changes}
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens=nsched,
                           total_num_scheduled_tokens=sum(nsched.values()), **fields)


def test_steady_and_grown_steps_take_the_fast_path() -> None:
    steps = [_first(), _step(1), _step(2), _step(3, blocks=[None, ([77],), None]), _step(4)]
    assert _run(steps) == (4, 4)


def test_departures_inside_the_batch_still_take_the_fast_path() -> None:
    """Computed or output counts off the prediction, changed scheduled counts, drafts."""
    steps = [_first(), _step(1),
             _step(2, computed=[PROMPT + 1, PROMPT - 3, PROMPT + 1]),  # a rollback
             _step(3, outputs=[3, 9, 3], nsched={"a": 3, "b": 1, "c": 2},
                   scheduled_spec_decode_tokens={"a": [5, -1], "c": [7]},
                   num_spec_tokens_to_schedule=2),
             _step(4, computed=[PROMPT + 5, PROMPT - 2, PROMPT + 4], outputs=[6, 10, 5],
                   nsched={"a": 3, "b": 1, "c": 2}, has_structured_output_requests=True)]
    assert _run(steps) == (4, 4)


def test_a_count_departure_alone_leaves_the_plain_step(speedups: str) -> None:
    """A computed count off the prediction with outputs that agree with it, then an
    output count alone off it: the steps look plain but for those counts."""
    p = PROMPT
    steps = [_first(), _step(1),
             _step(2, computed=[p + 1, p - 3, p + 1], outputs=[2, 0, 2]),
             _step(3, computed=[p + 2, p - 2, p + 2], outputs=[3, 0, 3]),
             _step(4, computed=[p + 3, p - 1, p + 3], outputs=[4, 7, 4]),
             _step(5, computed=[p + 4, p, p + 4], outputs=[5, 8, 5],
                   blocks=[None, ([55],), None])]
    assert _run(steps) == (5, 5)


def test_structured_output_flags_keep_the_plain_step(speedups: str) -> None:
    """Forecast steps that set the structured-output flags, with and without appends,
    and one that drops them again."""
    steps = [_first(), _step(1),
             _step(2, has_structured_output_requests=True),
             _step(3, has_structured_output_requests=True, pending_structured_output_tokens=True,
                   blocks=[([61],), None, None]),
             _step(4, pending_structured_output_tokens=True),
             _step(5)]
    assert _run(steps) == (5, 5)


def test_drafts_for_every_request_and_rows_growing_several_blocks() -> None:
    """Every request drafting (the positions 0..n-1 shortcut), rows growing by more than
    one block, and more grown rows than the small-step loop takes."""
    ids = [f"r{i}" for i in range(8)]
    new = [NewRequestData(rid, list(range(PROMPT)), [], SamplingParams(temperature=0), None,
                          ([k],), 0, None) for k, rid in enumerate(ids)]
    first = SchedulerOutput(new, CachedRequestData.make_empty(), dict.fromkeys(ids, PROMPT),
                            PROMPT * len(ids), {}, {}, set(), [], preempted_req_ids=set())
    drafted = {rid: [k, k + 1][: 1 + k % 2] for k, rid in enumerate(ids)}
    steps = [first, _step(1, ids=ids),
             _step(2, ids=ids, blocks=[([90 + k, 190 + k],) for k in range(8)]),  # 8 rows
             _step(3, ids=ids, blocks=[None, ([300, 301, 302],), None, ([303],)] + [None] * 4,
                   nsched={rid: 1 + len(d) for rid, d in drafted.items()},
                   scheduled_spec_decode_tokens=drafted, num_spec_tokens_to_schedule=2)]
    assert _run(steps) == (3, 3)


@pytest.mark.parametrize("name", ["order", "resumed", "empty_blocks", "preempted_none",
                                  "spec_order", "spec_empty", "finished", "zero"])
def test_steps_the_fast_path_must_leave_to_the_general_path(name: str) -> None:
    odd = {
        "order": lambda: _step(2, ids=["b", "a", "c"], nsched={"b": 1, "a": 1, "c": 1}),
        "resumed": lambda: _step(2, resumed={"b"}, blocks=[None, ([90],), None],
                                 all_tokens={"b": list(range(PROMPT + 1))}),
        "empty_blocks": lambda: _step(2, blocks=[None, ([],), None]),
        "preempted_none": lambda: _step(2, preempted_req_ids=None),
        "spec_order": lambda: _step(2, scheduled_spec_decode_tokens={"c": [4], "a": [5]},
                                    nsched={"a": 2, "b": 1, "c": 2}),
        "spec_empty": lambda: _step(2, scheduled_spec_decode_tokens={"a": [5], "b": []},
                                    nsched={"a": 2, "b": 1, "c": 1}),
        "finished": lambda: _step(2, finished_req_ids={"zz"}),
        "zero": lambda: _step(2, new_block_ids_to_zero=[3]),
    }[name]()
    after = _step(3, ids=list(odd.num_scheduled_tokens))
    assert _run([_first(), _step(1), odd, after]) == (2, 2)  # steps 1 and 3 only


def test_drafts_of_an_unscheduled_request_are_a_local_error() -> None:
    """vLLM never drafts for a request it did not schedule: both paths refuse it, typed."""
    odd = _step(2, scheduled_spec_decode_tokens={"a": [5], "zz": [1]},
                nsched={"a": 2, "b": 1, "c": 1})
    for fast in (True, False):
        enc = SchedulerOutputEncoder(secret=SECRET, fast=fast)
        enc.encode(_first())
        enc.encode(_step(1))
        with pytest.raises(LocalProtocolError, match="unscheduled request"):
            enc.encode(odd)


@pytest.mark.parametrize("general", [False, True])
@pytest.mark.parametrize("field", ["blocks", "computed", "outputs"])
def test_cached_lists_of_another_length_are_a_local_error(field: str, general: bool) -> None:
    """A CachedRequestData list that is not one entry per request is refused by name on
    both paths (the fast path leaves it to the general one), not misread."""
    short = {"blocks": [None, None], "computed": [PROMPT + 1] * 2, "outputs": [2, 2]}[field]
    changes: dict[str, Any] = {field: short}
    if general:
        changes["finished_req_ids"] = {"zz"}
    odd = _step(2, None, **changes)
    name = {"blocks": "new_block_ids", "computed": "num_computed_tokens",
            "outputs": "num_output_tokens"}[field]
    for fast in (True, False):
        enc = SchedulerOutputEncoder(secret=SECRET, fast=fast)
        enc.encode(_first())
        enc.encode(_step(1))
        with pytest.raises(LocalProtocolError, match="one entry per request") as info:
            enc.encode(odd)
        assert info.value.fields["field"] == name


def test_more_kv_groups_grow_one_group_at_a_time() -> None:
    steps = [_first(2), _step(1, blocks=[([50], []), None, ([51], [52])]), _step(2)]
    assert _run(steps, kv_groups=2) == (2, 2)


def _first_large(ids: list[str]) -> SchedulerOutput:
    new = [NewRequestData(rid, list(range(PROMPT)), [], SamplingParams(temperature=0), None,
                          ([k],), 0, None) for k, rid in enumerate(ids)]
    return SchedulerOutput(new, CachedRequestData.make_empty(), dict.fromkeys(ids, PROMPT),
                           PROMPT * len(ids), {}, {}, set(), [], preempted_req_ids=set())


def test_large_batches_forecast_with_numpy(speedups: str) -> None:
    ids = [f"r{i}" for i in range(70)]
    steps = [_first_large(ids)] + [_step(t, ids=ids) for t in range(1, 12)]  # past a table
    steps.append(_step(12, ids=ids, computed=[PROMPT + 11] * 69 + [3]))
    assert _run(steps) == (12, 12)


def test_large_batch_departures_take_the_fast_path(speedups: str) -> None:
    """Past forecast.SMALL requests (C compares without building the forecast rows): a
    rollback, output departures, changed scheduled counts, grown rows, then steps
    that match the forecast again."""
    ids = [f"r{i}" for i in range(70)]
    n = len(ids)
    wide = {rid: 3 if k % 5 == 0 else 1 for k, rid in enumerate(ids)}
    c3 = [PROMPT + 2] * (n - 1) + [PROMPT - 2]
    c4 = [c + wide[rid] for c, rid in zip(c3, ids, strict=True)]
    c5 = [c + wide[rid] for c, rid in zip(c4, ids, strict=True)]
    steps = [_first_large(ids), _step(1, ids=ids),
             _step(2, ids=ids, computed=[PROMPT + 1] * (n - 1) + [PROMPT - 3]),
             _step(3, ids=ids, computed=c3, outputs=[3] * (n - 2) + [9, 1], nsched=wide,
                   blocks=[([500 + k],) if k % 7 == 0 else None for k in range(n)]),
             _step(4, ids=ids, computed=c4, outputs=[4] * n, nsched=wide),
             _step(5, ids=ids, computed=c5, outputs=[5] * n, nsched=wide,
                   blocks=[([600 + k, 700 + k],) if k % 9 == 0 else None for k in range(n)]),
             _step(6, ids=ids, computed=[c + 1 for c in c5], outputs=[6] * n)]
    assert _run(steps) == (6, 6)


def test_forecast_lists_match_python_and_numpy() -> None:
    plen_small, plen_large = [5, 1, 9], [5, 1, 9] * 20
    small, large = Forecast(plen_small), Forecast(plen_large)
    small.restart([3, 4, 20], [1, 2, 1])
    large.restart([3, 4, 20] * 20, [1, 2, 1] * 20)
    for _ in range(20):
        (cs, os_), (cl, ol) = small.take(), large.take()
        assert cl == cs * 20 and ol == os_ * 20
        assert os_ == small.outputs(cs)
        small.advanced()
        large.advanced()


@settings(max_examples=30, deadline=None,  # the fixture only patches modules: shared is fine
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=scheduler_streams(), large=st.booleans())
def test_generated_streams_give_the_general_paths_frames(stream: dict[str, Any],
                                                       speedups: str, large: bool) -> None:
    # large: every batch takes the large-batch forecast (numpy tables; C comparisons)
    with mock.patch.object(forecast, "SMALL", 0 if large else forecast.SMALL):
        fast_steps = _run(stream["steps"], kv_groups=stream["kv_groups"])
    event(f"fast path taken: {'yes' if fast_steps[0] else 'no'}")


def _plain_checks(enc: SchedulerOutputEncoder, so: SchedulerOutput) -> tuple[Any, Any]:
    """The C plain_check and its Python reference on the encoder's forecast, the rare
    fields named (as the encoder passes them); each answers the same with them read by
    the callable."""
    q = enc.quick
    fc = q.forecast
    answers = []
    for names in (rare.RARE_NAMES, rare.RARE):
        args = (so, q.batch, fc.nsched, fc.total, fc.basis(), fc.plen_less_one, names,
                rare.PLAIN, q.kv_groups == 1, q.handles)
        assert C is not None
        answers.append((C.plain_check(*args), quick.plain_check_py(*args)))
    assert answers[0] == answers[1]
    return answers[0]


@st.composite
def _near_plain_steps(draw: st.DrawFn) -> SchedulerOutput:
    """Step 2 of ``_first(), _step(1)``: plain, or off it in one or more ways."""
    entry = st.sampled_from([None] * 6 + [([70],), ([71, 72],), ([],), ([73], [74]), [[75]]])
    changes: dict[str, Any] = {"blocks": [draw(entry) for _ in IDS],
                               "has_structured_output_requests": draw(st.booleans()),
                               "pending_structured_output_tokens": draw(st.booleans())}
    off = st.sampled_from([0, 0, 0, 1, -1])
    if draw(st.booleans()):
        changes["computed"] = [PROMPT + 1 + draw(off) for _ in IDS]
    if draw(st.booleans()):
        changes["outputs"] = [2 + draw(off) for _ in IDS]
    if draw(st.integers(0, 4)) == 0:
        changes["nsched"] = {rid: 1 + draw(st.integers(0, 1)) for rid in IDS}
    if draw(st.integers(0, 4)) == 0:
        changes["finished_req_ids"] = {"x"}
    # rare fields equal to a plain step's by value but not by type, or set: the named
    # reads (rare_equal) compare them as the tuple does
    rare: st.SearchStrategy[dict[str, Any]] = st.sampled_from([
        {}, {"finished_req_ids": frozenset()}, {"preempted_req_ids": None},
        {"free_encoder_mm_hashes": ()}, {"resumed": frozenset()}, {"resumed": {"a"}},
        {"num_invalid_spec_tokens": {}}, {"kv_connector_metadata": 0},
        {"has_sync_kv_loads": 0}, {"all_tokens": {"a": [1]}}])
    changes.update(draw(rare))
    return _step(2, **changes)


@pytest.mark.skipif(C is None, reason="C speedups not built")
@settings(max_examples=200, deadline=None)
@given(so=_near_plain_steps())
def test_plain_check_answers_as_its_python_reference(so: SchedulerOutput) -> None:
    """The C check takes exactly the plain steps its reference takes (these steps hold
    exact ints), with the same answer."""
    enc = SchedulerOutputEncoder(secret=SECRET)
    enc.encode(_first())
    enc.encode(_step(1))
    c_answer, py_answer = _plain_checks(enc, so)
    assert c_answer == py_answer
    event(f"plain: {py_answer is not None}")


@pytest.mark.skipif(C is None, reason="C speedups not built")
@settings(max_examples=200, deadline=None)
@given(st.data())
def test_append_rows_answer_as_the_python_lists(data: st.DataObject) -> None:
    """append_rows is QuickDecoder.blocks and _new_blocks of one group's rows, or None
    where blocks refuses (an unknown handle, a zero count) or the ids do not add up."""
    n = data.draw(st.integers(1, 12))
    dec = worker_quick.QuickDecoder()
    dec.reset([f"r{k}" for k in range(n)], [7 * k + 3 for k in range(n)], [0] * n,
              {f"r{k}": 1 for k in range(n)}, [1] * n, 1)
    handles = data.draw(st.lists(st.sampled_from([7 * k + 3 for k in range(n)] + [5]),
                                 min_size=1, max_size=n))
    counts = [data.draw(st.integers(0 if data.draw(st.integers(0, 9)) == 0 else 1, 3))
              for _ in handles]
    size = sum(counts) + (1 if data.draw(st.integers(0, 9)) == 0 else 0)
    values = data.draw(st.lists(st.integers(0, 1 << 31), min_size=size, max_size=size))
    one_each = counts == [1] * len(handles) and data.draw(st.booleans())
    rows = packing.pack_uints(handles), b"" if one_each else packing.pack_uints(counts), \
        packing.pack_uints(values)
    assert C is not None
    got = C.append_rows(*rows, dec.at, n)
    body = DeltaBody(block_append=(Rows(handles=rows[0], counts=rows[1], values=rows[2]),))
    blocks = dec.blocks(body.block_append)
    if blocks is None or sum(blocks[0][1]) != len(values):
        assert got is None
    else:
        assert got is not None
        assert [got[:3]] == blocks and got[3] == dec._new_blocks(blocks)
    event(f"taken: {got is not None}")


@pytest.mark.skipif(C is None, reason="C speedups not built")
def test_plain_check_refuses_what_is_not_a_plain_step() -> None:
    """Hand-made departures: each makes both answers None (C never raises for them)."""
    enc = SchedulerOutputEncoder(secret=SECRET)
    enc.encode(_first())
    enc.encode(_step(1))
    packed = (packing.pack_uints([enc.quick.handles[1]]), b"", packing.pack_uints([77]))
    assert _plain_checks(enc, _step(2, blocks=[None, ([77],), None]))[0] == (
        ([1], [1], [77]), packed, False, False, [PROMPT + 1] * 3)
    for bad in (_step(2, blocks=(None, None, None)), _step(2, blocks=[None, ([],), None]),
                _step(2, blocks=[None, ([1], [2]), None]), _step(2, blocks=[None, 5, None]),
                _step(2, computed=[PROMPT + 1, True, PROMPT + 1]),
                _step(2, outputs=[2, 2, 3]), _step(2, ids=["a", "c", "b"]),
                _step(2, nsched={"a": 1, "b": 1, "c": 2}),
                _step(2, finished_req_ids={"x"}), _step(2, num_spec_tokens_to_schedule=1),
                _step(2, scheduled_spec_decode_tokens={"a": [1]})):
        assert _plain_checks(enc, bad)[0] is None
    steady = _step(2)
    steady.total_num_scheduled_tokens = 1 << 70
    assert _plain_checks(enc, steady) == (None, None)


def test_quick_outputs_are_built_like_the_constructor_builds_them() -> None:
    """``made`` bypasses the dataclass __init__: it must name every field, in order,
    and the classes must have no __post_init__ or slots it would skip."""
    import dataclasses

    enc, dec = SchedulerOutputEncoder(secret=SECRET), SchedulerOutputDecoder(SECRET)
    dec.decode([bytes(f) for f in enc.encode(_first())])
    got = dec.decode([bytes(f) for f in enc.encode(_step(1, blocks=[([90],), None, None]))])
    assert dec.quick_steps == 1
    for obj, cls in ((got, SchedulerOutput), (got.scheduled_cached_reqs, CachedRequestData)):
        assert type(obj) is cls and not hasattr(cls, "__post_init__")
        assert "__slots__" not in vars(cls)
        assert list(vars(obj)) == [f.name for f in dataclasses.fields(cls)]
    assert got == _step(1, blocks=[([90],), None, None])
    first = SchedulerOutputDecoder(SECRET).decode([bytes(f) for f in SchedulerOutputEncoder(
        secret=SECRET).encode(_first())])
    nr = first.scheduled_new_reqs[0]  # the general path makes new requests so too
    assert type(nr) is NewRequestData and not hasattr(NewRequestData, "__post_init__")
    assert "__slots__" not in vars(NewRequestData)
    assert list(vars(nr)) == [f.name for f in dataclasses.fields(NewRequestData)]
    assert first == _first()


@pytest.mark.skipif(C is None, reason="C speedups not built")
@pytest.mark.parametrize("flags", [(False, False, 0), (True, True, 2)])
def test_c_step_output_is_the_python_assembly(flags: tuple[bool, bool, int],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``step_output`` builds what ``_assemble``'s lines build: equal objects, the same
    instance-dict order, every container fresh (vLLM keeps and changes them)."""
    dec = worker_quick.QuickDecoder()
    dec.reset(list(IDS), [5, 6, 7], [40, 41, 42], dict.fromkeys(IDS, 1), [PROMPT] * 3, 1)
    body = DeltaBody(has_structured_output=flags[0], pending_structured_output=flags[1],
                     num_spec_tokens_to_schedule=flags[2])
    args = ([41, 42, 43], [2, 3, 4], [None, ([9],), None], 3, {"b": [4]}, body)
    with_c = [dec._assemble(*args) for _ in range(2)]
    monkeypatch.setattr(worker_quick, "_C", None)
    python = dec._assemble(*args)
    for got in with_c:
        assert_vllm_equal(python, got)
        for obj, ref in ((got, python), (got.scheduled_cached_reqs, python.scheduled_cached_reqs)):
            assert type(obj) is type(ref) and list(vars(obj)) == list(vars(ref))
    first, second = (vars(so) | vars(so.scheduled_cached_reqs) for so in with_c)
    fresh = [k for k, v in first.items() if isinstance(v, list | set | dict)
             and k not in ("new_block_ids", "num_computed_tokens", "num_output_tokens",
                           "scheduled_spec_decode_tokens")]
    assert len(fresh) == 11 and all(first[k] is not second[k] for k in fresh)
    assert first["req_ids"] is not dec.batch and first["num_scheduled_tokens"] is not \
        dec.nsched_map
    assert C is not None
    assert C.step_output(CachedRequestData, SchedulerOutput, tuple(IDS), {}, *args[:5],
                         False, False, 0) is None  # not a list: the Python lines decide


def _tables_made_afresh(enc: SchedulerOutputEncoder, so: SchedulerOutput) -> None:
    """The encoder's last tables equal tables made from its lists for ``so``'s batch."""
    from protocol.request import Ragged

    batch = list(so.num_scheduled_tokens)
    groups = enc.kv_groups or 1
    fresh = [Ragged.from_lists([enc.tables[rid][g] for rid in batch]) for g in range(groups)]
    assert enc._last_blocks is not None and len(enc._last_blocks) == groups
    for got, want in zip(enc._last_blocks, fresh, strict=True):
        assert got.lengths.tolist() == want.lengths.tolist()
        assert got.values.tolist() == want.values.tolist()


@settings(max_examples=30, deadline=None)
@given(stream=scheduler_streams())
def test_carried_block_tables_equal_tables_made_afresh(stream: dict[str, Any]) -> None:
    """The general path carries last step's tables (rows that left dropped, appends
    patched in, joining rows made from its lists): always the tables made afresh."""
    enc = SchedulerOutputEncoder(stream["kv_groups"], secret=SECRET, fast=False)
    for so in stream["steps"]:
        enc.encode(so)
        _tables_made_afresh(enc, so)
        event("a request joined or left" if so.scheduled_new_reqs or so.finished_req_ids
              else "same batch")


def test_carried_tables_take_appends_and_drop_a_re_added_request() -> None:
    """A request leaves while another grows a block and one joins; then a request that
    finished joins again under the same id (its old table must not be carried)."""
    def joined(rid: str, block: int) -> NewRequestData:
        return NewRequestData(rid, list(range(PROMPT)), [], SamplingParams(temperature=0),
                              None, ([block],), 0, None)

    grow = _step(1, ids=["a", "b"], blocks=[None, ([77],)], finished_req_ids={"c"},
                 nsched={"a": 1, "b": 1, "d": PROMPT})
    grow.scheduled_new_reqs = [joined("d", 40)]
    again = _step(2, ids=["b", "d"], computed=[PROMPT + 1, PROMPT], outputs=[2, 1],
                  finished_req_ids={"a"}, nsched={"b": 1, "d": 1, "a": PROMPT})
    again.scheduled_new_reqs = [joined("a", 50)]
    enc = SchedulerOutputEncoder(secret=SECRET, fast=False)
    for so in (_first(), grow, again):
        enc.encode(so)
        _tables_made_afresh(enc, so)
    assert enc._last_blocks is not None
    assert enc._last_blocks[0].values.tolist() == [10, 77, 40, 50]


def test_a_long_same_batch_run_files_its_appends_as_it_goes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine notes each same-batch step's appends for its tables and files them once
    UNFILED steps are noted, not only when a general step reads the tables: the notes
    stay bounded, and the general step after the run (the batch reordered) still gives
    the general path's frames."""
    monkeypatch.setattr(encoder_module, "UNFILED", 4)
    run = [_step(t, blocks=[([100 + 3 * t + k],) if (t + k) % 2 else None
                            for k in range(len(IDS))]) for t in range(1, 12)]
    after = _step(12, ids=["b", "a", "c"], nsched={"b": 1, "a": 1, "c": 1})
    enc = SchedulerOutputEncoder(secret=SECRET)
    noted = []
    for so in [_first(), *run]:
        enc.encode(so)
        noted.append(len(enc._unfiled))
    assert max(noted) == 3 and noted.count(0) > 1  # (filed every fourth noted step)
    assert _run([_first(), *run, after]) == (len(run), len(run))
