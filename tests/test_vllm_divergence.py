"""Token-hash check-ins and the board that names a diverging rank (pure; no vLLM)."""

from __future__ import annotations

import pytest

from engine_side.vllm.divergence import RankDiverged, TokenHashBoard
from protocol.calls import CHECK_IN_PAYLOAD, parse_check_in
from protocol.errors import MalformedMessage
from worker_side.vllm.tokenhash import TokenHash

STEPS = [(["a", "b"], [[5], [7, 8]]), (["a"], [[9]]), (["b", "c"], [[], [1]])]


def _hashed(steps: list[tuple[list[str], list[list[int]]]]) -> TokenHash:
    h = TokenHash()
    for req_ids, sampled in steps:
        h.update(req_ids, sampled)
    return h


def test_equal_tokens_equal_hash_and_any_difference_shows() -> None:
    base = _hashed(STEPS)
    assert base.steps == 3 and base.value == _hashed(STEPS).value
    variants = [
        [(["a", "b"], [[5], [7, 9]])] + STEPS[1:],  # one token
        [(["b", "a"], [[5], [7, 8]])] + STEPS[1:],  # batch order
        [(["a", "b"], [[5, 7], [8]])] + STEPS[1:],  # same tokens, other split
        STEPS[:1] + [(["a"], [[9]]), (["b", "c"], [[1], []])],  # in a later step
        STEPS[1:2] + STEPS[:1] + STEPS[2:],  # step order
    ]
    values = {_hashed(v).value for v in variants}
    assert base.value not in values and len(values) == len(variants)


def test_check_in_payload_round_trips() -> None:
    h = _hashed(STEPS)
    assert parse_check_in(h.check_in()) == (3, h.value)
    with pytest.raises(MalformedMessage, match="check-in payload"):
        parse_check_in(h.check_in()[:-1])
    assert CHECK_IN_PAYLOAD.size == 16


def test_board_names_the_rank_that_differs_from_the_reference_once() -> None:
    board = TokenHashBoard([2, 3, 4], reference=2)
    assert board.report(3, 8, 111) == []  # reference not in yet: nothing to compare
    assert board.report(4, 8, 222) == []
    assert board.report(2, 8, 111) == [RankDiverged(rank=4, steps=8, source_rank=2)]
    assert board.compared == 2 and not board.pending  # every rank reported count 8
    assert board.report(4, 16, 999) == []  # already named: not again
    assert board.report(2, 16, 5) == []
    assert board.report(3, 16, 6) == [RankDiverged(rank=3, steps=16, source_rank=2)]
    assert set(board.diverged) == {3, 4}


def test_board_agreeing_ranks_and_bounded_history() -> None:
    board = TokenHashBoard(range(2), reference=0, history=4)
    for steps in range(8, 80, 8):
        assert board.report(1, steps, steps * 7) == []
        assert board.report(0, steps, steps * 7) == []
    assert board.compared == 9 and not board.diverged and not board.pending
    for steps in range(8, 80, 8):  # rank 1 silent: pending stays bounded
        board.report(0, 1000 + steps, 1)
    assert len(board.pending) == 4


def test_board_rejects_ranks_that_do_not_sample() -> None:
    with pytest.raises(ValueError, match="reference rank"):
        TokenHashBoard([1], reference=0)
    with pytest.raises(ValueError, match="does not sample"):
        TokenHashBoard([0, 1], reference=0).report(2, 8, 0)


class _Sock:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.sent.append(frames)


class _Output:
    def __init__(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        self.req_ids, self.sampled_token_ids = req_ids, sampled


def test_rank_checks_in_every_n_outputs_after_replying() -> None:
    """A rank folds each output after its reply and sends ``H`` every ``hash_every``."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from worker_side.vllm import proc
    from worker_side.vllm.channel import RankChannel

    sock = _Sock()
    channel = RankChannel(sock, None, 0)  # type: ignore[arg-type]  # no ring: the DEALER
    server = proc._Server(object(), channel, b"k" * 32, is_output=False, hash_every=2)
    for req_ids, sampled in STEPS:
        server.sampled = _Output(req_ids, sampled)
        server._fold()
        server._fold()  # a call without a model output (e.g. control) folds nothing
    assert sock.sent == [[proc.CHECK_IN, _hashed(STEPS[:2]).check_in()]]
    silent = proc._Server(object(), RankChannel(_Sock(), None, 0),  # type: ignore[arg-type]
                          b"k" * 32, is_output=False)
    silent.sampled = _Output(*STEPS[0])
    silent._fold()
    assert silent.token_hash.steps == 0  # not a sampling rank: no hashing at all
