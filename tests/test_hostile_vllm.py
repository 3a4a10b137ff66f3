"""Hostile peers at the vLLM adapter: any bytes through its decode entry points raise
only the project's typed errors.

Real frames (a step of a generated stream, grammar outputs by every way of sending a
bitmask, replies plain and rich) are mutated as in ``test_hostile_frames.py`` and fed
to ``SchedulerOutputDecoder.decode`` / ``decode_grammar`` and
``SchedulerOutputEncoder.decode_reply``; Hypothesis also builds well-formed messages
of hostile content -- a real step's extension (:class:`protocol.ext.StepExt`) replaced
by one of random fields, grammar messages and replies of random positions, names,
lists and bitmask structs.  Whatever decodes must be a value of the type vLLM expects
(a grammar bitmask an integer ndarray, a reply's lists one entry per request), and a
malformed answer fails the executor naming the rank.  Skipped without vLLM.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from hostile import SECRET, mutated, typed, with_nested_field  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm_streams import scheduler_streams  # noqa: E402

from engine_side.vllm import SchedulerOutputEncoder  # noqa: E402
from protocol import codec  # noqa: E402
from protocol.bitmask import Deflated, GrammarMsg, RowRefs, SparseWords  # noqa: E402
from protocol.errors import MalformedMessage  # noqa: E402
from protocol.ext import (  # noqa: E402
    KVOutputWire,
    LogprobsWire,
    NewFix,
    ReplyMsg,
    StepExt,
    TokenRef,
    decode_ext,
    encode_ext,
)
from protocol.messages import Delta  # noqa: E402
from protocol.packing import pack_sints, pack_uints  # noqa: E402
from worker_side.vllm import SchedulerOutputDecoder  # noqa: E402

pytestmark = pytest.mark.vllm


def _vllm_pair() -> tuple[Any, Any, list[str]]:
    """An encoder and a decoder after one first step of three new requests."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    enc, dec = SchedulerOutputEncoder(secret=SECRET), SchedulerOutputDecoder(SECRET)
    ids = ["a", "b", "c"]
    new = [NewRequestData(rid, [1, 2, 3, k], [], SamplingParams(temperature=0), None,
                          ([k + 1],), 0, None) for k, rid in enumerate(ids)]
    dec.decode([bytes(f) for f in enc.encode(SchedulerOutput(
        new, CachedRequestData.make_empty(), dict.fromkeys(ids, 4), 12, {}, {}, set(), [],
        preempted_req_ids=set()))])
    return enc, dec, ids


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_vllm_step_frames_nested_or_mutated_raise_only_typed_errors(data: st.DataObject,
                                                                    ) -> None:
    stream = data.draw(scheduler_streams(max_steps=6), label="stream")
    enc = SchedulerOutputEncoder(stream["kv_groups"], secret=SECRET)
    steps = [[bytes(f) for f in enc.encode(copy.deepcopy(so))] for so in stream["steps"]]
    at = data.draw(st.integers(0, len(steps) - 1), label="step")
    dec = SchedulerOutputDecoder(SECRET)
    for frames in steps[:at]:
        dec.decode(frames)
    typed(dec.decode, data.draw(mutated([steps[at]]), label="frames"))
    typed(dec.decode_grammar, data.draw(mutated([steps[at]]), label="as grammar"))


def _grammar_seeds(enc: Any, ids: list[str]) -> list[list[bytes]]:
    from vllm.v1.core.sched.output import GrammarOutput

    rows = np.zeros((3, 512), dtype=np.int32)  # deflated (mostly zero rows)
    rows[:, 7], rows[1, 100] = -1, 0x5A5A
    big = np.full((3, 2048), -1, dtype=np.int32)  # sparse words (past DEFLATE_MAX)
    big[0, 5] = 3
    masks = [np.arange(12, dtype=np.int32).reshape(3, 4), rows, rows, big]  # rows twice:
    return [[bytes(f) for f in enc.encode_grammar(GrammarOutput(ids, m, [1, 0, 2]))]
            for m in masks]  # (the second by reference to the first)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_vllm_grammar_frames_raise_only_typed_errors(data: st.DataObject) -> None:
    enc, dec, ids = _vllm_pair()
    seeds = _grammar_seeds(enc, ids)
    k = data.draw(st.integers(0, len(seeds) - 1))
    for frames in seeds[:k]:
        dec.decode_grammar(frames)
    typed(dec.decode_grammar, data.draw(mutated(seeds[k:k + 1])))


def _reply_seeds(dec: Any, ids: list[str]) -> list[list[bytes]]:
    from vllm.v1.outputs import KVConnectorOutput, LogprobsLists, ModelRunnerOutput

    plain = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                              sampled_token_ids=[[5]] * len(ids))
    lp = LogprobsLists(np.ones((3, 2), np.int32), np.zeros((3, 2), np.float32),
                       np.arange(3, dtype=np.int32), None)
    rich = ModelRunnerOutput(
        req_ids=ids[::-1], req_id_to_index={r: i for i, r in enumerate(ids[::-1])},
        sampled_token_ids=[[3, 4], [], [5]], logprobs=lp,
        num_nans_in_logits={ids[0]: 0, "gone": 2},
        kv_connector_output=KVConnectorOutput(finished_sending={"gone"},
                                              expected_finished_count=2),
        # (an opaque object: it travels sealed)
        ec_connector_output={"sealed": [1, 2]})  # type: ignore[arg-type]
    return [[bytes(f) for f in dec.encode_reply(out)] for out in (plain, rich, None)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_vllm_reply_frames_raise_only_typed_errors(data: st.DataObject) -> None:
    enc, dec, ids = _vllm_pair()
    seeds = _reply_seeds(dec, ids)
    typed(enc.decode_reply, data.draw(mutated(seeds)))


def test_a_malformed_answer_fails_the_executor_naming_the_rank() -> None:
    """The executor's reading of its ranks' answers (no processes: its receive is
    stubbed with the frames two ranks sent): a malformed reply from the output rank
    fails the executor cleanly -- ExecutorFailed naming the rank, failed, called back."""
    from engine_side.vllm.answers import Answers
    from engine_side.vllm.executor import DeltaExecutor, ExecutorFailed
    from engine_side.vllm.restart import RestartPolicy
    from protocol import calls
    from protocol.faults import PeerFaults
    from protocol.seal import Opener, Sealer

    def executor(answers: list[list[bytes]]) -> tuple[Any, list[int]]:
        ex: Any = object.__new__(DeltaExecutor)
        called: list[int] = []
        ex.world_size, ex.output_rank, ex.stats = 2, 1, Counter()
        ex._answers, ex.is_failed, ex.failure = Answers(2, ex.stats), False, ""
        ex.faults = PeerFaults(logging.getLogger("test.executor"), "dropped")
        ex.failure_callback = lambda: called.append(1)
        ex.encoder = _vllm_pair()[0]
        ex._open_result = [Opener(SECRET, b"result:%d" % r) for r in range(2)]
        ex._receive = lambda deadline: list(enumerate(answers))
        ex.liveness_s, ex._serving, ex._relaunching, ex._died = 0.01, False, False, None
        ex.restarts, ex.local = RestartPolicy(), SimpleNamespace(dead=list)
        return ex, called

    every = SimpleNamespace(deadline=None, needed=(0, 1))  # a call both ranks answer

    reply = [calls.OUTPUT, with_nested_field(_reply_seeds(_vllm_pair()[1], ["a"])[0][0])]
    ex, called = executor([[calls.DONE], reply])  # type: ignore[list-item]
    with pytest.raises(ExecutorFailed, match="rank 1 sent a malformed answer"):
        ex._output(ex._gather(every))
    assert ex.is_failed and called == [1] and ex.faults.by_peer == Counter({"rank 1": 1})
    ex, called = executor([[b"?"], [calls.DONE]])  # not an answer at all
    with pytest.raises(ExecutorFailed, match="rank 0"):
        ex._gather(every)
    sealer = Sealer(SECRET, b"result:0")  # rank 0's result sent as rank 1's
    ex, called = executor([[calls.CONTROL, sealer.seal({"result": 1})],
                           [calls.CONTROL, sealer.seal({"result": 2})]])
    with pytest.raises(ExecutorFailed, match="rank 1 .*MAC"):
        ex._results(ex._gather(every))
    assert called == [1]
    # a step call resolves on its output rank (1) alone; rank 0's E comes after it
    ex, called = executor([])
    arrivals = iter([[(1, [calls.OUTPUT, b"1"])],
                     [(0, [calls.ERROR, b"boom"]), (1, [calls.OUTPUT, b"2"])]])
    ex._receive = lambda deadline: next(arrivals)
    step = SimpleNamespace(deadline=None, needed=(1,))
    assert ex._gather(step) == [None, [calls.OUTPUT, b"1"]]
    with pytest.raises(ExecutorFailed, match="rank 0 failed a step its output rank had "
                                             "answered: boom"):
        ex._gather(step)
    assert ex.is_failed and called == [1]
    # serving, the same E while its peer's death is noticed: that death, not the E
    # (GroupDied: the drain restarts the group; the executor is not failed)
    from engine_side.vllm.restart import GroupDied

    for died in (None, GroupDied(1, -9)):
        ex, called = executor([])
        arrivals = iter([[(1, [calls.OUTPUT, b"1"])],
                         [(0, [calls.ERROR, b"boom"]), (1, [calls.OUTPUT, b"2"])]])
        ex._receive = lambda deadline, arrivals=arrivals: next(arrivals)
        ex._serving, ex._died = True, died
        ex._gather(step)
        if died is None:  # none within the bound: the E is rank 0's own
            with pytest.raises(ExecutorFailed, match="rank 0 failed a step"):
                ex._gather(step)
            assert ex.is_failed
        else:
            with pytest.raises(GroupDied, match="rank 1 died"):
                ex._gather(step)
            assert not ex.is_failed and called == []
    assert calls.rank_of(b"1", 2) == 1
    assert [calls.rank_of(i, 2) for i in (b"2", b"01", b"-1", b"x", b"", b"1" * 9)] == [None] * 6



# ---------------------------------------------------------------- well-formed, hostile content
_SMALL = st.integers(0, 12)
_PACKED = st.one_of(st.lists(_SMALL, max_size=6).map(pack_uints), st.binary(max_size=8))
_SIGNED = st.one_of(st.lists(st.integers(-6, 6), max_size=6).map(pack_sints),
                    st.binary(max_size=8))
_REF = st.builds(TokenRef, p=st.integers(-2, 12), t=_SIGNED)
_EXT = st.fixed_dictionaries({}, optional={
    "kv_groups": st.integers(0, 3), "cached_order": _PACKED, "out_pos": _PACKED,
    "out_delta": _SIGNED, "new_tokens": st.none() | st.tuples(_PACKED, _SIGNED),
    "all_keys": _PACKED, "all_tokens": st.lists(_REF, max_size=3).map(tuple),
    "prefill": st.lists(st.none() | _REF, max_size=3).map(tuple),
    "fixes": st.lists(st.builds(NewFix, i=st.integers(-1, 4), int_floats=st.just(
        ("temperature",)), replay_start=st.integers(-1, 9)), max_size=2).map(tuple),
    "total": st.integers(-2, 40), "preempted_none": st.booleans(),
    "enc_stats": st.none() | st.tuples(_SMALL, _SMALL),
    "invalid_spec": st.none() | st.dictionaries(st.text(max_size=3), _SMALL, max_size=2),
    "sync_kv": st.booleans(), "block_copies": st.none() | _PACKED,
    "prefix_blocks": st.none() | _PACKED, "sealed": st.just(b"") | st.binary(max_size=40)})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=scheduler_streams(max_steps=6), fields=_EXT, data=st.data())
def test_a_step_with_a_hostile_extension_decodes_or_is_refused_typed(
        stream: dict[str, Any], fields: dict[str, Any], data: st.DataObject) -> None:
    """The extension is no part of the digest: a step whose ``x`` is replaced by one of
    random fields still applies, and only the output's assembly can find it wrong."""
    enc = SchedulerOutputEncoder(stream["kv_groups"], secret=SECRET)
    steps = [[bytes(f) for f in enc.encode(copy.deepcopy(so))] for so in stream["steps"]]
    at = data.draw(st.integers(0, len(steps) - 1), label="step")
    dec = SchedulerOutputDecoder(SECRET)
    for frames in steps[:at]:
        dec.decode(frames)
    msg = codec.decode(steps[at])
    assert isinstance(msg, Delta)
    mixed = msgspec.structs.replace(decode_ext(msg.body.extension), **fields) \
        if data.draw(st.booleans(), label="on the real one") else StepExt(**fields)
    body = msgspec.structs.replace(msg.body, extension=encode_ext(mixed))
    frames = [bytes(f) for f in codec.encode(msgspec.structs.replace(msg, body=body))]
    so = typed(dec.decode, frames)
    if so is not None:
        c = so.scheduled_cached_reqs
        assert len(c.num_computed_tokens) == len(c.num_output_tokens) == len(c.req_ids) \
            == len(c.new_block_ids)
        assert set(so.num_scheduled_tokens) == {*c.req_ids, *(nr.req_id for nr in
                                                               so.scheduled_new_reqs)}


_DTYPE = st.sampled_from(["<i4", "<i8", "|u1", "<f4", "zz", ""])
_SHAPE = st.lists(st.integers(-1, 6), max_size=3).map(tuple)
_GRAMMAR_PARTS = st.fixed_dictionaries({}, optional={
    "bitmask": st.none() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=3)
    | st.lists(_SMALL, max_size=3),
    "drafts": st.none() | st.lists(_SMALL, max_size=3),
    "deflated": st.none() | st.builds(Deflated, _DTYPE, _SHAPE, st.binary(max_size=16)),
    "sparse": st.none() | st.builds(SparseWords, _DTYPE, _SHAPE, _PACKED, _PACKED,
                                    st.binary(max_size=16)),
    "rows": st.none() | st.builds(RowRefs, _DTYPE, _SHAPE, st.integers(-1, 4), _PACKED,
                                  st.binary(max_size=24))})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=_GRAMMAR_PARTS, positions=_PACKED, names=st.lists(st.text(max_size=3), max_size=2),
       data=st.data())
def test_generated_grammar_messages_decode_or_are_refused_typed(
        parts: dict[str, Any], positions: bytes, names: list[str], data: st.DataObject) -> None:
    enc, dec, ids = _vllm_pair()
    for frames in _grammar_seeds(enc, ids)[:data.draw(st.integers(0, 3), label="sent before")]:
        dec.decode_grammar(frames)
    seq = enc.seq + data.draw(st.sampled_from([0, 0, 0, -1, 1]), label="seq off by")
    msg = GrammarMsg(seq, positions, tuple(names), **{"bitmask": None, **parts})
    grammar = typed(dec.decode_grammar, [msgspec.msgpack.encode(msg)])
    if grammar is not None:
        assert all(isinstance(r, str) for r in grammar.structured_output_request_ids)
        mask = grammar.grammar_bitmask
        if isinstance(mask, np.ndarray):  # (anything else: the test below)
            assert mask.dtype.kind in "iu"


@pytest.mark.parametrize("bitmask", [None, 7, "x", [1, 2]], ids=repr)
def test_a_grammar_message_without_an_integer_bitmask_is_malformed(bitmask: Any) -> None:
    """vLLM's GrammarOutput always holds an integer ndarray (the runner indexes it): a
    message that sends no bitmask, or a msgpack value in its place, is the peer's error."""
    enc, dec, _ = _vllm_pair()
    msg = GrammarMsg(enc.seq, pack_uints([0, 1]), (), bitmask)
    with pytest.raises(MalformedMessage):
        dec.decode_grammar([msgspec.msgpack.encode(msg)])


_LOGPROBS = st.builds(LogprobsWire, st.none() | st.lists(_SMALL, max_size=3),
                      st.none() | st.lists(st.floats(), max_size=3),
                      st.none() | st.lists(_SMALL, max_size=3), st.none() | st.lists(_SMALL))
_REPLY_PARTS = st.fixed_dictionaries({}, optional={
    "positions": _PACKED, "names": st.lists(st.text(max_size=3), max_size=2).map(tuple),
    "index_map": st.none() | _PACKED, "counts": _PACKED, "tokens": _SIGNED,
    "logprobs": st.none() | _LOGPROBS,
    "prompt_lp": st.lists(st.tuples(st.integers(-1, 5), st.none() | _LOGPROBS),
                          max_size=2).map(tuple),
    "nans": st.none() | st.lists(st.tuples(st.integers(-1, 5), _SMALL), max_size=2).map(tuple),
    "kv": st.none() | st.builds(KVOutputWire, expected=_SMALL),
    "sealed": st.just(b"") | st.binary(max_size=40), "none": st.booleans()})


_TOKEN_LISTS = st.lists(st.lists(_SMALL, max_size=3), max_size=5).map(lambda lists: {
    "counts": pack_uints([len(t) for t in lists]),
    "tokens": pack_sints([v for t in lists for v in t])})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=_REPLY_PARTS, lists=st.none() | _TOKEN_LISTS,
       seq_off=st.sampled_from([0, 0, 0, -1, 1]))
def test_generated_replies_are_one_entry_per_request_or_refused_typed(
        parts: dict[str, Any], lists: dict[str, bytes] | None, seq_off: int) -> None:
    """Token lists that add up (or not) for as many requests as the batch (or not)."""
    enc, _, _ = _vllm_pair()
    reply = ReplyMsg(seq=enc.seq + seq_off, **{**parts, **(lists or {})})
    out = typed(enc.decode_reply, [msgspec.msgpack.encode(reply)])
    if out is not None:  # (lists that do not fit the batch: the test below)
        assert all(isinstance(r, str) for r in out.req_ids)
        assert all(type(t) is list for t in out.sampled_token_ids)


_UNFIT = [
    ("one token list for three requests", {"counts": pack_uints([1]),
                                           "tokens": pack_sints([5])}),
    ("four token lists for three requests", {"counts": pack_uints([1] * 4),
                                             "tokens": pack_sints([5] * 4)}),
    ("an index past the batch", {"index_map": pack_uints([0, 0, 1, 1, 2, 9]),
                                 "tokens": pack_sints([5, 6, 7])}),
]


@pytest.mark.parametrize(("what", "fields"), _UNFIT, ids=[u[0] for u in _UNFIT])
def test_reply_lists_that_do_not_fit_the_batch_are_malformed(what: str,
                                                             fields: dict[str, Any]) -> None:
    """vLLM's scheduler reads ``sampled_token_ids[req_id_to_index[r]]`` for each request
    (no list at all is a pooling model's reply): a reply of token lists that are not one
    per request, or an index past them, would fail there, in the engine -- the decoder
    refuses it, as it does a one-token reply of the wrong length."""
    enc, _, _ = _vllm_pair()
    with pytest.raises(MalformedMessage):
        enc.decode_reply([msgspec.msgpack.encode(ReplyMsg(seq=enc.seq, **fields))])


def _respec(frames: list[bytes], sampling: dict[str, Any], fixes: tuple[Any, ...] = ()
            ) -> list[bytes]:
    """The first step of ``frames`` (one new request) with its sampling spec's fields
    set and the extension's fixes replaced, stamped with the digest it leads to (so only
    the rank's own checks can refuse it)."""
    from protocol.messages import decode_spec
    from protocol.state import ReplicaState

    msg = codec.decode(frames)
    assert isinstance(msg, Delta) and msg.body is not None
    new = msg.body.added[0]
    spec = decode_spec(new.spec)
    assert spec.sampling is not None
    spec = msgspec.structs.replace(spec, sampling=msgspec.structs.replace(spec.sampling,
                                                                           **sampling))
    new = msgspec.structs.replace(new, spec=msgspec.Raw(msgspec.msgpack.encode(spec)))
    ext = msgspec.structs.replace(decode_ext(msg.body.extension), fixes=fixes)
    body = msgspec.structs.replace(msg.body, added=(new,), extension=encode_ext(ext))
    state = ReplicaState(keep_tables=False)
    state.apply(body)
    return [bytes(f) for f in codec.encode(msgspec.structs.replace(msg, body=body,
                                                                    digest=state.digest))]


@pytest.mark.parametrize(("sampling", "fixes"), [
    ({"output_kind": 99}, ()),
    ({"temperature": float("inf")}, (NewFix(0, int_floats=("temperature",)),)),
    ({"temperature": float("nan")}, (NewFix(0, int_floats=("temperature",)),)),
    ({"prompt_logprob_token_ids": [[300]]}, (NewFix(0, logprob_ids_dtype="|u1"),)),
], ids=["output kind", "inf as int", "nan as int", "ids past their dtype"])
def test_parameters_that_make_no_vllm_object_refuse_the_step_unchanged(
        sampling: dict[str, Any], fixes: tuple[Any, ...]) -> None:
    """A new request's parameters become vLLM objects before its step applies: ones that
    cannot (an unknown output kind, a float sent as an int that is none) refuse the step
    with MalformedMessage and the decoder as it was; the genuine step then decodes."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    enc, dec = SchedulerOutputEncoder(secret=SECRET), SchedulerOutputDecoder(SECRET)
    so = SchedulerOutput([NewRequestData("a", [1, 2, 3], [], SamplingParams(temperature=1),
                                         None, ([1],), 0, None)],
                         CachedRequestData.make_empty(), {"a": 3}, 3, {}, {}, set(), [],
                         preempted_req_ids=set())
    frames = [bytes(f) for f in enc.encode(so)]
    with pytest.raises(MalformedMessage):
        dec.decode(_respec(frames, sampling, fixes))
    assert dec.seq == 0 and dec.state is None
    assert dec.decode(frames).scheduled_new_reqs[0].req_id == "a"


def test_the_first_fix_of_a_new_request_is_the_one_used() -> None:
    """SPEC §16 (NewFix ``i``): a rank uses the first fix with its index."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    enc, dec = SchedulerOutputEncoder(secret=SECRET), SchedulerOutputDecoder(SECRET)
    so = SchedulerOutput([NewRequestData("a", [1, 2, 3], [], SamplingParams(temperature=2),
                                         None, ([1],), 0, None)],
                         CachedRequestData.make_empty(), {"a": 3}, 3, {}, {}, set(), [],
                         preempted_req_ids=set())
    frames = _respec([bytes(f) for f in enc.encode(so)], {},
                     (NewFix(0, int_floats=("temperature",)), NewFix(0)))
    got = dec.decode(frames).scheduled_new_reqs[0].sampling_params.temperature
    assert got == 2 and type(got) is int
