"""The fuzz campaign (engine_side/bench/fuzz.py) at a CI budget: a few thousand cases
through every decoder, with whichever kernels this process runs (CI runs the suite
once; the full campaign runs both), and the campaign's own bookkeeping: it must be able
to see an untyped exception and a state changed by a refused case."""

from __future__ import annotations

import importlib.util
import random
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from engine_side.bench import fuzz
from engine_side.bench.fuzz_mutate import mutate
from protocol.errors import InvalidDelta, MalformedMessage

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def runner() -> Iterator[fuzz.Runner]:
    old = signal.signal(signal.SIGALRM, fuzz._alarm)
    before = _scratch()
    runner = fuzz.Runner(1234, vllm=HAS_VLLM)
    try:
        yield runner
    finally:
        runner.close()
        signal.signal(signal.SIGALRM, old)
    assert _scratch() == before, "the fuzzer left its scratch directory"


def _scratch() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("dc-fuzz-*"))


def test_a_small_campaign_gives_only_typed_errors_and_keeps_refused_states(
        runner: fuzz.Runner) -> None:
    runner.run(4000)
    t = runner.tallies
    for name in fuzz.TARGETS:
        tally = t[name]
        if name == "vllm" and not HAS_VLLM:
            continue
        assert tally.cases > 0, name
        assert tally.untyped == 0, (name, tally.findings[:2])
        assert tally.hangs == 0, name
        assert tally.violations == 0, (name, tally.findings[:2])
    core = t["core"]
    assert core.counted > core.cases * 0.8  # mutations get past the header
    assert core.accepted and core.rejected and core.hypothesis
    assert {"InvalidDelta", "MalformedMessage"} <= set(core.errors)
    assert len(core.hows) >= 10  # byte, frame and structure mutations all ran


def test_the_campaign_sees_untyped_errors_and_changed_states(runner: fuzz.Runner) -> None:
    tally = runner.tallies["replies"]
    untyped, violations = tally.untyped, tally.violations

    def explode(frames: list[bytes]) -> None:
        raise IndexError("a decoder bug")

    state = [0]

    def refuse_after_change(frames: list[bytes]) -> None:
        state[0] += 1
        raise MalformedMessage("bad")

    runner.case("replies", [b"\x91\x01"], [b"\x91\x00"], "test", explode)
    runner.case("replies", [b"\x91\x01"], [b"\x91\x00"], "test", refuse_after_change,
                lambda: state[0])
    assert (tally.untyped, tally.violations) == (untyped + 1, violations + 1)
    assert tally.findings[-1]["kind"].startswith("state changed")


def test_structure_mutations_keep_the_header_and_reach_the_typed_decoders() -> None:
    from protocol import codec
    from protocol.messages import Heartbeat

    seed = [bytes(f) for f in codec.encode(Heartbeat(7, 3, digest=99))]
    rng = random.Random(5)
    hows = set()
    for _ in range(300):
        frames, how = mutate(rng, seed)
        hows.add(how)
    assert any(h.startswith("node_") for h in hows) and "flip" in hows


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_a_refused_vllm_step_leaves_the_decoder_as_it_was() -> None:
    from engine_side.bench import fuzz_corpus as fc
    from protocol import codec
    from protocol.ext import decode_ext
    from protocol.messages import Delta

    for chain in fc.vllm_chains():
        for k, (kind, frames) in enumerate(chain.records):
            if kind != "execute_model":
                continue
            msg = codec.decode(frames)
            assert isinstance(msg, Delta)
            if not decode_ext(msg.body.extension).sealed:
                continue
            dec, enc = chain.replay(k)
            bad = msgspec.structs.replace(msg, digest=msg.digest ^ 1)
            with pytest.raises(InvalidDelta):
                dec.decode([bytes(f) for f in codec.encode(bad)])
            dec.decode(frames)  # the real step still applies
            return
    pytest.skip("no golden stream step carries sealed connector metadata")
