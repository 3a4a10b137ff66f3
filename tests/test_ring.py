"""The local step ring (protocol/ring.py; its ends engine_side/ring.py and
worker_side/ring.py) and its use by the transports: order, wrap, overrun, ON_PUB
markers, reply rings, doorbells, re-attachment."""

from __future__ import annotations

import os
import select
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_side.ring import RingWriter
from protocol.errors import MalformedMessage
from protocol.messages import AnyMessage, Delta, DeltaBody, Heartbeat
from protocol.replies import StepResult
from protocol.ring import MESSAGE, ON_PUB, drain_bell, open_bell, pack_frames, unpack_frames
from worker_side.ring import RingError, RingReader


@pytest.fixture
def short_dir() -> Iterator[Path]:  # ipc socket paths must stay under 107 bytes
    path = Path(tempfile.mkdtemp(prefix="dcr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[RingWriter]:
    w = RingWriter(tmp_path, ring_bytes=1024, reply_bytes=1024)
    yield w
    w.close()


def _messages(reader: RingReader) -> list[bytes]:
    return [bytes(unpack_frames(p)[0]) for k, p in reader.read() if k == MESSAGE]


def test_records_arrive_in_order_across_wraps(writer: RingWriter, tmp_path: Path) -> None:
    reader = RingReader(tmp_path, 0)
    sent, got = [], []
    for i in range(200):  # 200 records of 40-140 bytes through a 1 KiB ring: many wraps
        record = bytes([i % 251]) * (40 + i % 100)
        assert writer.publish([record], i)
        sent.append(record)
        if i % 3 == 2:
            got += _messages(reader)
    got += _messages(reader)
    assert got == sent and reader.overruns == 0


def test_a_reader_lapped_by_the_writer_is_overrun_not_fed_torn_data(
        writer: RingWriter, tmp_path: Path) -> None:
    reader = RingReader(tmp_path, 0)
    for i in range(40):
        writer.publish([bytes(100)], i)  # 40 * 108 bytes > 1 KiB: the reader is lapped
    assert reader.read() == [] and reader.overruns == 1
    writer.publish([b"next"], 40)
    assert _messages(reader) == [b"next"]  # it resumes from the head (the replica resyncs)


def test_a_late_reader_starts_at_the_head_like_a_late_subscriber(
        writer: RingWriter, tmp_path: Path) -> None:
    writer.publish([b"before"], 1)
    reader = RingReader(tmp_path, 0)
    writer.publish([b"after"], 2)
    assert _messages(reader) == [b"after"]


def test_a_message_too_large_for_the_ring_leaves_an_on_pub_marker(
        writer: RingWriter, tmp_path: Path) -> None:
    reader = RingReader(tmp_path, 0)
    assert not writer.publish([bytes(600)], 7)  # > half the ring
    assert reader.read() == [(ON_PUB, (7).to_bytes(8, "little"))]


def test_frames_pack_and_bad_payloads_are_refused() -> None:
    parts = pack_frames([b"ab", b"", b"cde"])
    payload = b"".join(bytes(p) for p in parts)
    assert [bytes(f) for f in unpack_frames(payload)] == [b"ab", b"", b"cde"]
    for bad in (payload[:-1], (5).to_bytes(4, "little") + b"\0" * 8, b"\1\0"):
        with pytest.raises(MalformedMessage):
            unpack_frames(bad)


def test_replies_per_rank_and_the_sleeping_flag(writer: RingWriter, tmp_path: Path) -> None:
    r0, r3 = RingReader(tmp_path, 0), RingReader(tmp_path, 3)
    assert not writer.replies_pending() and not writer.sleepers()
    assert r3.reply(b"three") and r0.reply(b"zero-a") and r0.reply(b"zero-b")
    assert writer.replies_pending()
    assert writer.replies() == [(0, MESSAGE, b"zero-a"), (0, MESSAGE, b"zero-b"),
                                (3, MESSAGE, b"three")]
    assert not writer.replies_pending() and writer.replies() == []
    assert not r0.reply(bytes(600))  # too large: the caller uses its DEALER
    r0.reply_marker()
    assert writer.replies() == [(0, ON_PUB, bytes(8))]
    assert r3.sleep(True) is False and writer.sleepers() and writer.sleeping_ranks() == [3]
    writer.publish([b"x"], 1)
    assert r0.sleep(True) is True  # records are pending: do not block
    r0.sleep(False)
    r3.sleep(False)
    assert not writer.sleepers()
    assert writer.publish([b"tiny"], 9, limit=64) and not writer.publish([bytes(100)], 10, 64)
    assert [k for k, _ in r0.read()] == [MESSAGE, MESSAGE, ON_PUB]


def _rung(bell: int) -> bool:
    """Whether the doorbell ``bell`` has an unread byte (read it)."""
    if not select.select([bell], [], [], 0)[0]:
        return False
    drain_bell(bell)
    return not select.select([bell], [], [], 0)[0]


def test_the_doorbell_fifo_wakes_exactly_the_ranks_that_sleep(writer: RingWriter,
                                                                  tmp_path: Path) -> None:
    """wake() rings the FIFO of each rank whose sleeping word is set and no other; a rank
    with no FIFO is skipped, one whose reader is gone costs nothing, and one that opens
    it again (a restarted rank) is rung again; a bell path that is not a FIFO is
    refused."""
    readers = {r: RingReader(tmp_path, r) for r in (0, 2, 5)}
    bells = {r: open_bell(tmp_path, r) for r in (0, 2)}  # rank 5 makes none
    try:
        writer.wake()  # nobody sleeps
        assert not any(_rung(b) for b in bells.values())
        readers[2].sleep(True)
        readers[5].sleep(True)
        writer.wake()
        assert (_rung(bells[0]), _rung(bells[2])) == (False, True)
        os.close(bells.pop(2))  # rank 2 exits asleep: its FIFO has no reader
        for _ in range(70_000):  # past what the FIFO holds: no EPIPE, no block
            writer.wake()
        bells[2] = open_bell(tmp_path, 2)  # its successor opens the same FIFO
        writer.wake()
        assert _rung(bells[2]) and not _rung(bells[0])
        (tmp_path / "bell.7").write_bytes(b"")
        with pytest.raises(OSError, match="not a FIFO"):
            open_bell(tmp_path, 7)
    finally:
        for bell in bells.values():
            os.close(bell)
        for reader in readers.values():
            reader.close()


def test_a_restarted_engine_makes_readers_stale_and_bad_ranks_are_refused(
        tmp_path: Path) -> None:
    first = RingWriter(tmp_path, ring_bytes=1024)
    reader = RingReader(tmp_path, 1)
    assert not reader.stale()
    first.close()
    assert reader.stale()
    second = RingWriter(tmp_path, ring_bytes=1024)
    try:
        again = RingReader(tmp_path, 1)
        second.publish([b"new"], 1)
        assert _messages(again) == [b"new"]
        with pytest.raises(RingError, match="rank 64"):
            RingReader(tmp_path, 64)
    finally:
        second.close()
    assert not (tmp_path / "ring").exists()
    with pytest.raises(RingError, match="cannot attach"):
        RingReader(tmp_path, 0)


# -- through the transports (real sockets) -------------------------------------------------
@pytest.mark.integration
def test_transport_merges_ring_and_pub_in_stream_order_and_rings_the_doorbell(
        short_dir: Path) -> None:
    from engine_side.transport import EngineTransport
    from worker_side.transport import WorkerTransport

    engine = EngineTransport(f"ipc://{short_dir}/e", ring_bytes=1024)
    worker = WorkerTransport(engine.endpoint, rank=2)
    try:
        for _ in range(500):  # until the subscription is live (bounded)
            engine.publish(Heartbeat(epoch=1, seq=0))
            if worker.recv(10):
                break
        small = DeltaBody(extension=b"a")
        large = DeltaBody(extension=bytes(600))  # > 512 B: half the ring
        for seq, body in enumerate([small, large, small], start=1):
            engine.publish(Delta(epoch=1, seq=seq, digest=0, body=body))
        got: list[int] = []
        for _ in range(200):
            got += [m.seq for m in worker.recv(20) if isinstance(m, Delta)]
            if len(got) == 3:
                break
        assert got == [1, 2, 3]  # seq 2 came on PUB; seq 3 waited for it in the ring
        assert engine.doorbells == 0

        assert engine.ring is not None  # garbage in the ring: counted, nothing delivered
        engine.ring.seg.ring.write(MESSAGE, [b"\x01\0\0\0" + (3).to_bytes(8, "little")
                                             + b"\xc1xx"])
        engine.ring.seg.ring.write(MESSAGE, [b"\xff\xff"])  # not even a frame table
        assert [m for _ in range(20) for m in worker.recv(5)] == []
        assert worker.malformed.count == 2

        done: list[list[AnyMessage]] = []
        blocked = threading.Thread(target=lambda: done.append(worker.recv(10_000)))
        blocked.start()  # no spin: it announces it sleeps, then blocks on SUB
        while not engine.ring or not engine.ring.sleepers():
            blocked.join(0.001)
        engine.publish(Delta(epoch=1, seq=4, digest=0, body=small))
        blocked.join()
        assert engine.doorbells == 1
        assert [m.seq for m in done[0] if isinstance(m, Delta)] == [4]

        worker.send(StepResult(epoch=1, seq=4, rank=2))
        replies = [(ident, msg.seq, msg.rank) for _ in range(100)
                   for ident, msg in engine.recv(10) if isinstance(msg, StepResult)]
        assert replies[:1] == [(b"", 4, 2)]  # via the reply ring: no DEALER identity
    finally:
        worker.close()
        engine.close()


@pytest.mark.integration
def test_a_worker_without_a_rank_is_told_to_pass_one(short_dir: Path) -> None:
    from engine_side.transport import EngineTransport
    from worker_side.transport import WorkerTransport

    engine = EngineTransport(f"ipc://{short_dir}/e")
    try:
        with pytest.raises(RingError, match="pass this worker's rank"):
            WorkerTransport(engine.endpoint)
    finally:
        engine.close()


@pytest.mark.integration
def test_a_worker_joins_while_steps_stream_through_the_ring(tmp_path: Path) -> None:
    """PUB carries no Deltas with a ring, so heartbeats must keep flowing while steps do:
    a joining worker asks for its snapshot only after hearing the engine on SUB."""
    import subprocess
    import sys

    from engine_side.liveness import LivenessView
    from engine_side.mirror import EngineMirror
    from engine_side.session import EngineSession
    from engine_side.transport import EngineTransport
    from engine_side.workloads import Workload

    workload = Workload("steady_decode", 4, seed=0)
    session = EngineSession(EngineTransport(None), EngineMirror(token_mode=workload.token_mode),
                            LivenessView(dead_after=5.0))
    cmd = [sys.executable, "-m", "worker_side.main", "--ack-only", "--connect",
           session.transport.endpoint, "--engine-timeout", "20"]
    procs = [subprocess.Popen([*cmd, "--rank", "0"], stdin=subprocess.DEVNULL)]
    try:
        session.wait_for_workers(1, timeout=60)
        procs.append(subprocess.Popen([*cmd, "--rank", "1"], stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + 60  # a bound, not a measurement
        while time.monotonic() < deadline:  # steps stream back to back until rank 1 joins
            session.run_step(workload.step())
            if set(session.answers) == {0, 1}:
                break
        assert set(session.answers) == {0, 1} and session.stats["heartbeats"] > 0
        for _ in range(5):
            answer = session.run_step(workload.step())
            assert set(session.answers) == {0, 1}
            assert answer.tokens == session.mirror.state.digest.to_bytes(8, "little")
    finally:
        session.close("done", expect={0, 1})
        for p in procs:
            p.wait(20)
