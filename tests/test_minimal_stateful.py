"""The minimal stateful channel (engine_side/bench/minimal_stateful.py) is a fair yardstick: it
rebuilds every step of real vLLM runs exactly from its bytes alone, sends less than
vLLM's pickle, and a stream with a step it cannot carry leaves its figures out
of the replay instead of timing a partial stream."""

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
@pytest.mark.parametrize("name", [*RECORDED, "synthetic-churn", "synthetic-decode"])
def test_the_minimal_channel_rebuilds_every_step_exactly_from_its_bytes(name: str) -> None:
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
    enc, dec = MinimalEncoder(), MinimalDecoder()
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
