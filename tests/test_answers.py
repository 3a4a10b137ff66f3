"""The executor's answers, in call order (SPEC §16.1), from any legal answer stream.

Every rank answers every call once, in order; a rank other than the output rank may
hold its ``K`` answers to step calls and send several in one (at most ``DONE_MAX``),
before its next other answer.  Hypothesis draws the calls, each rank's legal stream
(merged or not, through the reply ring, or too large for it: a marker there and the
answer on the DEALER) and when each part arrives.  A step call must resolve with its
output rank's answer alone, a control call with every rank's, every answer must be
settled in the end, and a rank failing a step call its output rank already answered
must fail the executor naming that rank.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_side.vllm.answers import Answers, RankFault
from protocol import calls as wire
from protocol.ring import MESSAGE, ON_PUB, pack_frames

KINDS = [wire.EXECUTE, wire.STEP, wire.SAMPLE, wire.CONTROL]


def _answer(kind: bytes, rank: int, output: int, n: int) -> list[bytes]:
    if kind == wire.CONTROL:
        return [wire.CONTROL, b"result %d of %d" % (n, rank)]
    return [wire.OUTPUT, b"step %d" % n] if rank == output else [wire.DONE]


def _stream(draw: st.DrawFn, calls: list[bytes], rank: int, output: int,
            fails: int | None) -> list[list[bytes]]:
    """One legal stream of ``rank``'s messages; it fails call ``fails`` (an E)."""
    out: list[list[bytes]] = []
    held = 0
    for n, kind in enumerate(calls):
        answer = [wire.ERROR, b"boom in %d" % n] if n == fails \
            else _answer(kind, rank, output, n)
        if answer == [wire.DONE] and draw(st.booleans()):
            held += 1
            if held < wire.DONE_MAX:
                continue
            answer, held = wire.done_answer(held), 0
        elif held:
            out.append(wire.done_answer(held))
            held = 0
        out.append(answer)
    if held:
        out.append(wire.done_answer(held))
    return out


class Executor:
    """Feeds each rank's stream in, as the executor's transport would: a ring record,
    or a marker now and the answer on the DEALER later (in order)."""

    def __init__(self, streams: list[list[list[bytes]]], large: list[list[bool]]) -> None:
        self.answers = Answers(len(streams), Counter())
        self.streams, self.large = streams, large
        self.sent = [0] * len(streams)  # stream items in (a marker or a record)
        self.dealer: list[list[list[bytes]]] = [[] for _ in streams]

    def deliver(self, rank: int, dealer_first: bool) -> None:
        """One message of ``rank`` in: its oldest answer still on the DEALER (whose
        marker is in), or its next stream item."""
        if self.dealer[rank] and (dealer_first or self.sent[rank] == len(self.streams[rank])):
            self.answers.socket(rank, self.dealer[rank].pop(0))
        elif self.sent[rank] < len(self.streams[rank]):
            i = self.sent[rank]
            self.sent[rank] += 1
            message = self.streams[rank][i]
            if self.large[rank][i]:
                self.answers.ring_record(rank, ON_PUB, b"")
                self.dealer[rank].append(message)
            else:
                self.answers.ring_record(rank, MESSAGE, b"".join(pack_frames(message)))

    def done(self, rank: int) -> bool:
        return self.sent[rank] == len(self.streams[rank]) and not self.dealer[rank]


@st.composite
def runs(draw: st.DrawFn, failing: bool) -> tuple[list[bytes], int, Executor, int | None,
                                                   int | None, st.DataObject]:
    world = draw(st.integers(1 if not failing else 2, 4))
    output = world - 1
    calls = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=200))
    fail_rank = fail_call = None
    if failing:
        steps = [n for n, k in enumerate(calls) if k != wire.CONTROL]
        if steps:
            fail_rank = draw(st.integers(0, output - 1))
            fail_call = draw(st.sampled_from(steps))
    streams = [_stream(draw, calls, r, output, fail_call if r == fail_rank else None)
               for r in range(world)]
    # too large for the reply ring: never a K (a few bytes)
    large = [[m[0] != wire.DONE and draw(st.booleans()) for m in s] for s in streams]
    return calls, output, Executor(streams, large), fail_rank, fail_call, draw(st.data())


def _deliver_one(ex: Executor, data: st.DataObject) -> None:
    left = [r for r in range(len(ex.streams)) if not ex.done(r)]
    assert left, "the executor waits for answers no rank still owes"
    ex.deliver(data.draw(st.sampled_from(left)), data.draw(st.booleans()))


def _drive(calls: list[bytes], output: int, ex: Executor, data: st.DataObject) -> None:
    world = len(ex.streams)
    for n, kind in enumerate(calls):
        needed = (output,) if kind in wire.STEP_KINDS else tuple(range(world))
        while ex.answers.waiting(needed):
            _deliver_one(ex, data)
        replies = ex.answers.take(needed)
        for rank in needed:
            got = replies[rank]
            assert got is not None
            assert got == ([wire.ERROR, b"boom in %d" % n] if got[0] == wire.ERROR
                           else _answer(kind, rank, output, n))
        for rank, reply in enumerate(replies):
            if rank not in needed and reply is not None:
                assert reply[0] in (wire.DONE, wire.ERROR)
    while not all(ex.done(r) for r in range(world)):
        _deliver_one(ex, data)


@settings(max_examples=300, deadline=None)
@given(runs(failing=False))
def test_every_call_resolves_with_the_answers_it_needs_and_all_settle(run: tuple) -> None:
    calls, output, ex, _, _, data = run
    _drive(calls, output, ex, data)
    assert ex.answers.owed == ex.answers.late == [0] * len(ex.streams)
    assert all(not box for box in ex.answers.boxes)


@settings(max_examples=300, deadline=None)
@given(runs(failing=True))
def test_a_step_failed_after_it_resolved_fails_naming_the_rank(run: tuple) -> None:
    calls, output, ex, fail_rank, fail_call, data = run
    if fail_rank is None:
        return
    try:
        _drive(calls, output, ex, data)
    except RankFault as fault:  # it came after the call resolved
        assert fault.rank == fail_rank
        assert fault.error == f"boom in {fail_call}"
    else:  # it came in time: the call saw it among its answers (and raised it)
        assert ex.answers.owed == [0] * len(ex.streams)


@pytest.mark.parametrize("answer", [[wire.DONE, b"\0\0\0\0"], [wire.DONE, b"\1\0"],
                                    [wire.DONE, b"\1\0\0\0", b""]])
def test_a_malformed_count_is_the_ranks_fault(answer: list[bytes]) -> None:
    answers = Answers(2, Counter())
    with pytest.raises(RankFault) as raised:
        answers.socket(0, answer)
    assert raised.value.rank == 0


def test_done_answers_round_trip_their_count() -> None:
    for count in (1, 2, wire.DONE_MAX, 2**32 - 1):
        assert wire.done_count(wire.done_answer(count)) == count
