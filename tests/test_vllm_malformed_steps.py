"""Malformed input at both ends: steps vLLM's scheduler cannot make, and corrupted frames.

The engine's input is its own scheduler's, so a malformed step is a bug on our side of
the wire (a vLLM we do not know, a patched scheduler).  It must fail loudly, as a typed
:class:`LocalProtocolError` that names the requests, before anything is sent -- never a
bare KeyError, never a frame that silently finishes or schedules some other request.
Each generated valid stream gets one step corrupted one way; the fast encoder (the
same-batch, finish and turnover paths) and the general one (``fast=False``) must raise
the same error.

The worker's input comes off the wire: any corruption of a real frame must decode
(a flip in a field no digest covers) or raise a typed ProtocolError -- never a bare
KeyError, ValueError or UnicodeDecodeError.  Skipped without vLLM.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from hypothesis import HealthCheck, assume, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm_streams import scheduler_streams  # noqa: E402

from engine_side.vllm import SchedulerOutputEncoder  # noqa: E402
from engine_side.vllm.convert import check_scheduled  # noqa: E402
from protocol.errors import LocalProtocolError, MalformedMessage, ProtocolError  # noqa: E402
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


def _refusal(steps: list[Any], fast: bool) -> LocalProtocolError:
    """The error the last of ``steps`` raises (the ones before it must encode)."""
    enc = SchedulerOutputEncoder(secret=SECRET, fast=fast)
    for so in steps[:-1]:
        enc.encode(copy.deepcopy(so))
    with pytest.raises(LocalProtocolError) as caught:
        enc.encode(steps[-1])
    return caught.value


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=scheduler_streams(max_steps=10, rare=False), name=st.sampled_from(
    sorted(CORRUPTIONS)), data=st.data())
def test_every_path_refuses_a_malformed_step_alike(stream: dict[str, Any], name: str,
                                                    data: st.DataObject) -> None:
    corrupt, applies = CORRUPTIONS[name]
    fits = [i for i, so in enumerate(stream["steps"]) if i and applies(so)]
    assume(fits)
    at = data.draw(st.sampled_from(fits), label="step")
    steps = [copy.deepcopy(so) for so in stream["steps"][:at + 1]]
    cached = len(steps[-1].scheduled_cached_reqs.req_ids)
    corrupt(steps[-1], data.draw(st.integers(0, max(0, cached - 1)), label="request"))
    fast, general = _refusal(steps, True), _refusal(steps, False)
    assert str(fast) == str(general)
    event(f"{name}: {general.message}")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=scheduler_streams(max_steps=12, rare=False), data=st.data())
def test_a_finished_request_never_runs_in_place_of_another(stream: dict[str, Any],
                                                            data: st.DataObject) -> None:
    """The finish path's shape with one stayer swapped for a finished request (which the
    last batch held, so every position check but the ids passes): refused alike."""
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
    assert str(_refusal(steps, True)) == str(_refusal(steps, False))


def test_the_scheduled_check_names_the_requests() -> None:
    """The three ways num_scheduled_tokens can disagree with the requests, in one
    error; a step that agrees passes (any order of its keys)."""
    from types import SimpleNamespace as NS

    def step(cached: list[str], new: list[str], keys: list[str]) -> Any:
        return NS(scheduled_cached_reqs=NS(req_ids=cached),
                  scheduled_new_reqs=[NS(req_id=r) for r in new],
                  num_scheduled_tokens=dict.fromkeys(keys, 1))

    check_scheduled(step(["a", "b"], ["c"], ["c", "a", "b"]))
    with pytest.raises(LocalProtocolError) as caught:
        check_scheduled(step(["a", "a", "b"], ["c"], ["a", "b", "d"]))
    assert caught.value.fields == {"repeated": ["a"], "unscheduled": ["c"],
                                   "unknown": ["d"]}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=scheduler_streams(max_steps=8), data=st.data())
def test_a_corrupted_frame_decodes_or_is_refused_typed(stream: dict[str, Any],
                                                       data: st.DataObject) -> None:
    enc = SchedulerOutputEncoder(secret=SECRET)
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
    from test_vllm_turnover import _first

    frames = [bytes(f) for f in SchedulerOutputEncoder(secret=SECRET).encode(_first(["a"]))]
    assert b"temperature" in frames[0]  # (the toy's greedy requests say temperature=0)
    bad = [frames[0].replace(b"temperature", b"tdmperature"), *frames[1:]]
    with pytest.raises(MalformedMessage, match="bad vLLM step extension"):
        SchedulerOutputDecoder(SECRET).decode(bad)
    # a name that is not UTF-8 (msgspec raises UnicodeDecodeError, a ValueError)
    bad = [frames[0].replace(b"temperature", b"\xffemperature"), *frames[1:]]
    with pytest.raises(MalformedMessage, match="bad vLLM step extension"):
        SchedulerOutputDecoder(SECRET).decode(bad)


def test_extension_lists_that_do_not_fit_the_step_are_malformed() -> None:
    """Resent token lists for more requests than the step resends (the extension is
    no part of the digest, so only the output's assembly finds it)."""
    import msgspec
    from test_vllm_turnover import _first, _step

    from engine_side.vllm.schema import StepExt, TokenRef
    from protocol import codec
    from protocol.messages import Delta

    enc, dec = SchedulerOutputEncoder(secret=SECRET), SchedulerOutputDecoder(SECRET)
    dec.decode([bytes(f) for f in enc.encode(_first(["a"]))])
    general = _step(["a"], 1, free_encoder_mm_hashes=["h"])  # (a rare field: the general path)
    msg = codec.decode([bytes(f) for f in enc.encode(general)])
    assert isinstance(msg, Delta)
    raw = msg.body.extension.get("v")
    ext = msgspec.msgpack.decode(raw, type=StepExt) if raw else StepExt()
    grown = msgspec.structs.replace(ext, all_tokens=(TokenRef(),))
    body = msgspec.structs.replace(msg.body, extension={"v": msgspec.msgpack.encode(grown)})
    frames = [bytes(f) for f in codec.encode(msgspec.structs.replace(msg, body=body))]
    with pytest.raises(MalformedMessage, match="does not fit its step"):
        dec.decode(frames)


def test_prompt_logprob_ids_must_be_integers() -> None:
    """An ndarray of token ids keeps its integer dtype across the wire; any other dtype is
    the caller's error at the engine (the worker decodes integer dtypes alone)."""
    import numpy as np
    from vllm import SamplingParams

    from engine_side.vllm.params import sampling_to_spec, spec_to_sampling

    ids = np.array([1, 2], dtype=np.int32)
    spec, floats, dtype = sampling_to_spec(SamplingParams(prompt_logprob_token_ids=ids))
    back = spec_to_sampling(spec, floats, dtype).prompt_logprob_token_ids
    assert back.dtype == np.int32 and back.tolist() == [1, 2]
    with pytest.raises(LocalProtocolError, match="integer token ids"):
        sampling_to_spec(SamplingParams(prompt_logprob_token_ids=np.array([1.5])))


def test_an_unknown_output_kind_off_the_wire_is_malformed() -> None:
    import msgspec
    from vllm import SamplingParams

    from engine_side.vllm.params import sampling_to_spec, spec_to_sampling

    spec, _, _ = sampling_to_spec(SamplingParams(temperature=0.5))
    bad = msgspec.structs.replace(spec, output_kind=7)
    with pytest.raises(MalformedMessage, match="output_kind"):
        spec_to_sampling(bad)
