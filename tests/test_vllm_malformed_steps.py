"""Malformed input at both ends: steps vLLM's scheduler cannot make, and corrupted frames.

The engine's input is its own scheduler's, so a malformed step is a bug on our side of
the wire (a vLLM we do not know, a patched scheduler).  It must fail loudly, as a typed
:class:`LocalProtocolError`, before anything is sent and with the encoder's mirror of
the workers' state unchanged -- never a bare KeyError or IndexError, never a frame that
silently finishes or schedules some other request.  Each generated valid stream gets
one step corrupted one way.

The worker's input comes off the wire: any corruption of a real frame must decode
(a flip in a field no digest covers) or raise a typed ProtocolError -- never a bare
KeyError, ValueError or UnicodeDecodeError.  Skipped without vLLM.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import msgspec  # noqa: E402
from hypothesis import HealthCheck, assume, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from oracle import state_fingerprint  # noqa: E402
from vllm_equal import assert_vllm_equal  # noqa: E402
from vllm_streams import scheduler_streams  # noqa: E402

from engine_side.vllm import SchedulerOutputEncoder  # noqa: E402
from protocol import codec  # noqa: E402
from protocol.errors import LocalProtocolError, MalformedMessage, ProtocolError  # noqa: E402
from protocol.ext import TokenRef, decode_ext, encode_ext  # noqa: E402
from protocol.messages import Delta  # noqa: E402
from protocol.packing import pack_uints  # noqa: E402
from worker_side.vllm import SchedulerOutputDecoder  # noqa: E402

pytestmark = pytest.mark.vllm
SECRET = b"m" * 32


def _rename(d: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    return {new if k == old else k: v for k, v in d.items()}


def _finished_stays(so: Any, k: int) -> None:
    """A request finishes and is scheduled again in the same step."""
    so.finished_req_ids = {*so.finished_req_ids, so.scheduled_cached_reqs.req_ids[k]}


def _repeated(so: Any, k: int) -> None:
    """A cached request twice, its every per-request list too."""
    c = so.scheduled_cached_reqs
    for name in ("req_ids", "new_block_ids", "num_computed_tokens", "num_output_tokens"):
        values = getattr(c, name)
        values.append(copy.deepcopy(values[k]))


def _unknown(so: Any, k: int) -> None:
    """A cached request the encoder never saw (renamed everywhere it is keyed)."""
    c = so.scheduled_cached_reqs
    old = c.req_ids[k]
    c.req_ids[k] = "never-seen"
    so.num_scheduled_tokens = _rename(so.num_scheduled_tokens, old, "never-seen")
    so.scheduled_spec_decode_tokens = _rename(so.scheduled_spec_decode_tokens, old,
                                              "never-seen")


def _unscheduled(so: Any, k: int) -> None:
    """A cached request without a scheduled count."""
    gone = so.scheduled_cached_reqs.req_ids[k]
    so.num_scheduled_tokens = {r: n for r, n in so.num_scheduled_tokens.items() if r != gone}


def _extra(so: Any, k: int) -> None:
    """A scheduled count for a request that is neither new nor cached."""
    so.num_scheduled_tokens = {**so.num_scheduled_tokens, "stray": 1 + k % 3}


def _short(so: Any, k: int) -> None:
    """A CachedRequestData list one entry short."""
    c = so.scheduled_cached_reqs
    c.num_computed_tokens = c.num_computed_tokens[:-1]


def _new_and_cached(so: Any, k: int) -> None:
    """A new request under the id of a cached one (its own count dropped)."""
    nr = so.scheduled_new_reqs[0]
    old, nr.req_id = nr.req_id, so.scheduled_cached_reqs.req_ids[k]
    so.num_scheduled_tokens = {r: n for r, n in so.num_scheduled_tokens.items() if r != old}


def _finished_instead(so: Any, k: int, last: list[str]) -> None:
    """A request of the last batch finishes yet runs again in place of stayer ``k``, which
    leaves unannounced; the stayers still in the last batch's order (``last``)."""
    c = so.scheduled_cached_reqs
    done = sorted(set(so.finished_req_ids).intersection(last))[0]
    ids = [done if i == k else rid for i, rid in enumerate(c.req_ids)]
    order = sorted(range(len(ids)), key=lambda i: last.index(ids[i]))
    for name in ("new_block_ids", "num_computed_tokens", "num_output_tokens"):
        values = getattr(c, name)
        setattr(c, name, [values[i] for i in order])
    counts = so.num_scheduled_tokens
    gone = c.req_ids[k]
    renamed = _rename(counts, gone, done)
    so.num_scheduled_tokens = {ids[i]: renamed[ids[i]] for i in order} | {
        r: n for r, n in renamed.items() if r not in ids}
    so.scheduled_spec_decode_tokens = _rename(so.scheduled_spec_decode_tokens, gone, done)
    c.req_ids = [ids[i] for i in order]


#: name -> (corruption, whether the step can take it: it needs cached or new requests)
CORRUPTIONS = {
    "finished_stays": (_finished_stays, lambda so: bool(so.scheduled_cached_reqs.req_ids)),
    "repeated": (_repeated, lambda so: bool(so.scheduled_cached_reqs.req_ids)),
    "unknown": (_unknown, lambda so: bool(so.scheduled_cached_reqs.req_ids)),
    "unscheduled": (_unscheduled, lambda so: bool(so.scheduled_cached_reqs.req_ids)),
    "extra": (_extra, lambda so: True),
    "short": (_short, lambda so: bool(so.scheduled_cached_reqs.req_ids)),
    "new_and_cached": (_new_and_cached, lambda so: bool(
        so.scheduled_cached_reqs.req_ids and so.scheduled_new_reqs)),
}


def _mirror(enc: SchedulerOutputEncoder) -> tuple[Any, ...]:
    """Everything the encoder's mirror holds: its state, seq, ids, batch, and the handles
    its allocator hands out (free ones below its next; a freed top one is the same)."""
    m = enc.mirror
    assert m is not None
    free, top = set(m.allocator._free), m.allocator._next
    while top - 1 in free:
        top -= 1
        free.discard(top)
    return (state_fingerprint(m.state), m.seq, dict(m.ids), list(m.batch), list(m._nsched),
            sorted(free), top)


def _refusal(steps: list[Any], kv_groups: int) -> LocalProtocolError:
    """The error the last of ``steps`` raises (the ones before it must encode), the
    mirror unchanged by it."""
    enc = SchedulerOutputEncoder(kv_groups, secret=SECRET)
    for so in steps[:-1]:
        enc.encode(copy.deepcopy(so))
    before = _mirror(enc)
    with pytest.raises(LocalProtocolError) as caught:
        enc.encode(steps[-1])
    assert _mirror(enc) == before
    return caught.value


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=scheduler_streams(max_steps=10, rare=False), data=st.data())
def test_a_malformed_step_is_refused_typed_before_the_mirror_changes(
        name: str, stream: dict[str, Any], data: st.DataObject) -> None:
    corrupt, applies = CORRUPTIONS[name]
    fits = [i for i, so in enumerate(stream["steps"]) if i and applies(so)]
    assume(fits)
    at = data.draw(st.sampled_from(fits), label="step")
    steps = [copy.deepcopy(so) for so in stream["steps"][:at + 1]]
    cached = len(steps[-1].scheduled_cached_reqs.req_ids)
    corrupt(steps[-1], data.draw(st.integers(0, max(0, cached - 1)), label="request"))
    event(f"{name}: {_refusal(steps, stream['kv_groups']).message}")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=scheduler_streams(max_steps=12, rare=False), data=st.data())
def test_a_finished_request_never_runs_in_place_of_another(stream: dict[str, Any],
                                                            data: st.DataObject) -> None:
    """A step where only finishes change the batch, with one stayer swapped for a
    finished request (which the last batch held, so every position check but the ids
    passes): refused."""
    steps = stream["steps"]

    def finish_shaped(so: Any, last: dict[str, int]) -> bool:
        stay = so.scheduled_cached_reqs.req_ids
        return bool(stay) and not so.scheduled_new_reqs and set(stay) <= last.keys() \
            and not set(so.finished_req_ids).isdisjoint(last)

    fits = [i for i in range(1, len(steps))
            if finish_shaped(steps[i], steps[i - 1].num_scheduled_tokens)]
    assume(fits)
    at = data.draw(st.sampled_from(fits), label="step")
    steps = [copy.deepcopy(so) for so in steps[:at + 1]]
    cached = len(steps[-1].scheduled_cached_reqs.req_ids)
    _finished_instead(steps[-1], data.draw(st.integers(0, cached - 1), label="request"),
                      list(steps[-2].num_scheduled_tokens))
    event(_refusal(steps, stream["kv_groups"]).message)


# ---------------------------------------------------------------- hand-made steps
def _first(ids: list[str], groups: int = 1) -> Any:
    """A first step: ``ids`` join with a 4-token prompt, one block per KV group each."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = [NewRequestData(rid, [1, 2, 3, k], [], SamplingParams(temperature=0), None,
                          tuple([10 * g + k] for g in range(groups)), 0, None)
           for k, rid in enumerate(ids)]
    return SchedulerOutput(new, CachedRequestData.make_empty(), dict.fromkeys(ids, 4),
                           4 * len(ids), {}, {}, set(), [], preempted_req_ids=set())


def _next(ids: list[str], computed: int) -> Any:
    """The next step of ``ids``: one token each, ``computed`` computed, nothing new."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    cached = CachedRequestData(ids, set(), [], {}, [None] * len(ids), [computed] * len(ids),
                               [1] * len(ids))
    return SchedulerOutput([], cached, dict.fromkeys(ids, 1), len(ids), {}, {}, set(), [],
                           preempted_req_ids=set())


def _empty() -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.preempted_req_ids = set()
    return so


def test_a_new_request_of_another_kv_group_count_is_refused_typed() -> None:
    """A new request whose block table has more lists than the encoder's KV groups."""
    enc = SchedulerOutputEncoder(1, secret=SECRET)
    enc.encode(_first(["a"]))
    before = _mirror(enc)
    with pytest.raises(LocalProtocolError):
        enc.encode(_first(["b"], groups=2))
    assert _mirror(enc) == before


def test_kv_groups_are_not_guessed_from_a_step_without_new_requests() -> None:
    """The executor leaves ``kv_groups`` to the encoder (the first new request's table
    says it); a first step with no new request (a connector still loading) must not fix
    it at one: a two-group request later round-trips, or is refused typed."""
    enc, dec = SchedulerOutputEncoder(secret=SECRET), SchedulerOutputDecoder(SECRET)
    for so in (_empty(), _first(["a"], groups=2)):
        expected = copy.deepcopy(so)
        try:
            frames = [bytes(f) for f in enc.encode(so)]
        except LocalProtocolError:
            return
        assert_vllm_equal(expected, dec.decode(frames))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=scheduler_streams(max_steps=8), data=st.data())
def test_a_corrupted_frame_decodes_or_is_refused_typed(stream: dict[str, Any],
                                                       data: st.DataObject) -> None:
    enc = SchedulerOutputEncoder(stream["kv_groups"], secret=SECRET)
    frames = [[bytes(f) for f in enc.encode(copy.deepcopy(so))] for so in stream["steps"]]
    at = data.draw(st.integers(0, len(frames) - 1), label="step")
    dec = SchedulerOutputDecoder(SECRET)
    for step in frames[:at]:
        dec.decode(step)
    step = list(frames[at])
    k = data.draw(st.integers(0, len(step) - 1), label="frame")
    raw = bytearray(step[k])
    assume(raw)
    i = data.draw(st.integers(0, len(raw) - 1), label="offset")
    how = data.draw(st.sampled_from(["flip", "byte", "cut", "insert"]), label="how")
    if how == "flip":
        raw[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "byte":
        raw[i] = data.draw(st.integers(0, 255))
    elif how == "cut":
        del raw[i:]
    else:
        raw.insert(i, data.draw(st.integers(0, 255)))
    step[k] = bytes(raw)
    try:
        dec.decode(step)
        event("decoded")
    except ProtocolError as exc:
        event(type(exc).__name__)


def test_a_sampling_field_name_off_the_wire_is_checked() -> None:
    """A new request's float fields sent as ints are named on the wire; a name that is
    not one of SamplingParams' float fields is MalformedMessage (it was a KeyError)."""
    frames = [bytes(f) for f in SchedulerOutputEncoder(secret=SECRET).encode(_first(["a"]))]
    assert b"temperature" in frames[0]  # (the toy's greedy requests say temperature=0)
    for name in (b"tdmperature", b"\xffemperature"):  # another name; not UTF-8
        bad = [frames[0].replace(b"temperature", name), *frames[1:]]
        with pytest.raises(MalformedMessage, match="bad step extension"):
            SchedulerOutputDecoder(SECRET).decode(bad)


def test_extension_lists_that_do_not_fit_the_step_are_refused_unchanged() -> None:
    """Resent token lists for a request the step does not hold (the extension is no
    part of the digest): refused before the state changes, so the honest step still
    applies after it and decodes as the first rank's."""
    enc, dec = SchedulerOutputEncoder(secret=SECRET), SchedulerOutputDecoder(SECRET)
    first = [bytes(f) for f in enc.encode(_first(["a"]))]
    dec.decode(first)
    good = [bytes(f) for f in enc.encode(_next(["a"], 4))]
    msg = codec.decode(good)
    assert isinstance(msg, Delta)
    ext = decode_ext(msg.body.extension)
    for bad in (msgspec.structs.replace(ext, all_keys=pack_uints([5]), all_tokens=(TokenRef(),)),
                msgspec.structs.replace(ext, all_keys=pack_uints([0]),
                                        all_tokens=(TokenRef(p=99),)),
                msgspec.structs.replace(ext, all_tokens=(TokenRef(),)),
                msgspec.structs.replace(ext, out_pos=pack_uints([3]), out_delta=b""),
                msgspec.structs.replace(ext, block_copies=pack_uints([1, 2, 3]))):
        body = msgspec.structs.replace(msg.body, extension=encode_ext(bad))
        frames = [bytes(f) for f in codec.encode(msgspec.structs.replace(msg, body=body))]
        with pytest.raises(MalformedMessage):
            dec.decode(frames)
    out = dec.decode(good)
    other = SchedulerOutputDecoder(SECRET)
    other.decode(first)
    assert repr(out) == repr(other.decode(good))


def test_a_first_step_naming_impossible_kv_groups_is_malformed() -> None:
    """Found by the fuzz campaign: ``kg`` out of 1..64 reached the state's constructor
    (LocalProtocolError, an error of ours) instead of being the peer's (MalformedMessage)."""
    msg = codec.decode([bytes(f) for f in SchedulerOutputEncoder(secret=SECRET).encode(
        _first(["a"]))])
    assert isinstance(msg, Delta)
    for groups in (65, -1):
        ext = msgspec.structs.replace(decode_ext(msg.body.extension), kv_groups=groups)
        body = msgspec.structs.replace(msg.body, extension=encode_ext(ext))
        frames = [bytes(f) for f in codec.encode(msgspec.structs.replace(msg, body=body))]
        with pytest.raises(MalformedMessage, match="KV groups"):
            SchedulerOutputDecoder(SECRET).decode(frames)


def test_prompt_logprob_ids_must_be_integers() -> None:
    """An ndarray of token ids keeps its integer dtype across the wire; any other dtype is
    the caller's error at the engine (the worker decodes integer dtypes alone)."""
    import numpy as np
    from vllm import SamplingParams

    from engine_side.vllm.params import sampling_to_spec
    from worker_side.vllm.params import spec_to_sampling

    ids = np.array([1, 2], dtype=np.int32)
    spec, floats, dtype = sampling_to_spec(SamplingParams(prompt_logprob_token_ids=ids))
    back = spec_to_sampling(spec, floats, dtype).prompt_logprob_token_ids
    assert back.dtype == np.int32 and back.tolist() == [1, 2]
    with pytest.raises(LocalProtocolError, match="integer token ids"):
        sampling_to_spec(SamplingParams(prompt_logprob_token_ids=np.array([1.5])))


def test_an_unknown_output_kind_off_the_wire_is_malformed() -> None:
    import msgspec
    from vllm import SamplingParams

    from engine_side.vllm.params import sampling_to_spec
    from worker_side.vllm.params import spec_to_sampling

    spec, _, _ = sampling_to_spec(SamplingParams(temperature=0.5))
    bad = msgspec.structs.replace(spec, output_kind=7)
    with pytest.raises(MalformedMessage, match="output_kind"):
        spec_to_sampling(bad)
