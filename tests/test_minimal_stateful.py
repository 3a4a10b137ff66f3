"""The minimal stateful channel (engine_side/bench/minimal_stateful.py) is a fair yardstick: it
rebuilds every step of real vLLM runs exactly from its bytes alone, with or without its
state digest, sends less than vLLM's pickle, its digest refuses a step altered on the way,
and a stream with a step it cannot carry leaves its figures out of the replay instead of
timing a partial stream."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed")
GOLDEN = Path(__file__).resolve().parent / "golden" / "streams"
RECORDED = ("golden16", "golden16_async", "golden16_prefix", "main", "spec")


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("digest", [False, True])
@pytest.mark.parametrize("name", [*RECORDED, "synthetic-churn", "synthetic-decode"])
def test_the_minimal_channel_rebuilds_every_step_exactly_from_its_bytes(name: str,
                                                                        digest: bool) -> None:
    from vllm_equal import differences

    from engine_side.bench.minimal_stateful import MinimalDecoder, MinimalEncoder
    from engine_side.bench.vllm_replay import (
        load_stream,
        pickled,
        synthetic_churn,
        synthetic_decode,
    )

    records = (synthetic_churn(12, 30, prompt=64) if name == "synthetic-churn" else
               synthetic_decode(12, 30, prompt=64) if name == "synthetic-decode" else
               load_stream(GOLDEN / f"{name}.dcobj"))
    steps = [o for k, o in records if k == "execute_model"]
    enc, dec = MinimalEncoder(digest=digest), MinimalDecoder(digest=digest)
    sent = vllm = 0
    for so in steps:
        expected = copy.deepcopy(so)  # the engine edits its objects after dispatch
        data = enc.encode(so)
        assert isinstance(data, bytes)
        got = dec.decode(bytes(data))
        assert differences(expected, got) == []
        sent, vllm = sent + len(data), vllm + pickled("execute_model", so)[0]
    assert 0 < sent < vllm


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize(("name", "field"), [("golden16", "counts"), ("golden16", "computed"),
                                             ("golden16", "blocks"), ("spec", "computed_to")])
def test_the_digest_refuses_a_step_altered_on_the_way(name: str, field: str) -> None:
    """A step whose scheduled counts, computed counts (all of them, or the departures
    from prediction) or new blocks differ from what the engine sent (the digest left as
    it was) raises DigestMismatch on the rank; the steps before it decode."""
    import msgspec

    from engine_side.bench import minimal_stateful
    from engine_side.bench.minimal_stateful import DigestMismatch, MinimalDecoder, MinimalEncoder
    from engine_side.bench.vllm_replay import load_stream

    steps = [o for k, o in load_stream(GOLDEN / f"{name}.dcobj") if k == "execute_model"]
    enc, dec = MinimalEncoder(digest=True), MinimalDecoder(digest=True)
    codec = minimal_stateful._BODY
    altered = 0
    for so in steps:
        data = enc.encode(so)
        body = codec.decode(data)
        value = getattr(body, field)
        if altered or not value:
            dec.decode(data)
            continue
        if field == "blocks":
            value[0][0][0] += 1
        else:
            value[0] += 1
        with pytest.raises(DigestMismatch):
            dec.decode(msgspec.msgpack.encode(body))
        altered += 1
        break
    assert altered == 1


@pytest.mark.vllm
@needs_vllm
def test_a_stream_the_minimal_channel_cannot_carry_has_no_figures_of_it() -> None:
    """A multimodal request: Unsupported from the encoder; the replay still times the
    other paths and reports no minimal-channel figures for the stream."""
    from engine_side.bench.minimal_stateful import MinimalEncoder, Unsupported
    from engine_side.bench.vllm_replay import load_stream, replay

    records = load_stream(GOLDEN / "synthetic_groups.dcobj")
    enc = MinimalEncoder()
    with pytest.raises(Unsupported, match="multimodal"):
        for kind, so in records:
            if kind == "execute_model":
                enc.encode(so)
    summary = replay(records)
    assert summary["request"]["us"] > 0 and summary["request"]["floor_us"] > 0
    assert not [k for part in ("request", "join_leave", "same_batch")
                for k in summary[part] if "minimal" in k]
    carried = replay(load_stream(GOLDEN / "main.dcobj"))
    assert carried["request"]["minimal_us"] > 0
    assert 0 < carried["request"]["minimal_bytes"] < carried["request"]["vllm_bytes"]
