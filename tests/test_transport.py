"""Transport, security, liveness and resync: pure unit tests plus real-socket tests.

The integration tests run an in-process engine (EngineSession over a real
EngineTransport) against real worker processes (``python -m worker_side.main``)
and check outputs against an in-process reference run.  No wall-clock
assertions: time only bounds loops, and the liveness view is tested with its
own clock.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from oracle import Oracle

from engine_side.demo import admit, make_jobs, make_scheduler, reference_outputs
from engine_side.liveness import LivenessView, WorkerBack, WorkerDead, WorkerJoined, WorkerStuck
from engine_side.mirror import EngineMirror
from engine_side.scheduler import Scheduler
from engine_side.security import (
    CurveKeys,
    EndpointError,
    EndpointInUse,
    InsecureEndpoint,
    PrivateDir,
    free_tcp_endpoint,
    generate_keypair,
    load_keypair,
)
from engine_side.session import EngineSession
from engine_side.transport import EngineTransport
from protocol import codec
from protocol.messages import TOKEN_MODE_ENGINE, Heartbeat
from protocol.replies import StepResult, decode_reply, encode_reply, pack_tokens
from worker_side.replica import State, WorkerReplica

REPO = Path(__file__).resolve().parent.parent


# -- layering --------------------------------------------------------------------------------
def test_only_transport_modules_import_zmq() -> None:
    pure = ["protocol.replies", "engine_side.liveness", "engine_side.scheduler",
            "engine_side.session", "engine_side.demo"]
    probe = ("import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'zmq', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", probe, *pure], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"


# -- pure: liveness ---------------------------------------------------------------------------
def test_liveness_reports_dead_only_after_its_bound() -> None:
    view = LivenessView(dead_after=1.0)
    assert view.check_in(0, 100, 5, "synced", now=10.0) == [WorkerJoined(0, 100)]
    assert view.poll(10.99) == []
    events = view.poll(11.01)
    assert [type(e) for e in events] == [WorkerDead] and events[0].rank == 0
    assert view.poll(11.5) == []  # reported once
    assert view.check_in(0, 100, 5, "synced", now=12.0) == [WorkerBack(0, 100)]
    assert view.alive_ranks() == {0}


def test_liveness_process_exit_is_immediate_and_new_pid_is_a_new_incarnation() -> None:
    view = LivenessView(dead_after=1.0)
    view.check_in(1, 200, 3, "synced", now=0.0)
    dead = view.exited(1, 200, "process exited with status -9", now=0.1)
    assert len(dead) == 1 and isinstance(dead[0], WorkerDead) and "status -9" in dead[0].reason
    assert view.exited(1, 200, "again", now=0.2) == []
    assert view.poll(100.0) == []  # an exited process is never "stuck"
    assert view.check_in(1, 201, -1, "awaiting_snapshot", now=0.3) == [WorkerJoined(1, 201)]


def test_liveness_stuck_has_its_own_longer_per_phase_deadline() -> None:
    view = LivenessView(dead_after=1.0, stuck_after={"synced": 3.0, "awaiting_snapshot": 6.0})
    view.check_in(0, 1, 4, "synced", now=0.0)
    view.check_in(1, 2, -1, "awaiting_snapshot", now=0.0)
    view.engine_at(5, now=0.0)
    for t in np.arange(0.5, 3.0, 0.5):  # alive, checking in, not advancing
        view.check_in(0, 1, 4, "synced", now=float(t))
        view.check_in(1, 2, -1, "awaiting_snapshot", now=float(t))
        assert view.poll(float(t)) == []
    view.check_in(0, 1, 4, "synced", now=3.1)
    view.check_in(1, 2, -1, "awaiting_snapshot", now=3.1)
    stuck = view.poll(3.1)
    assert [(type(e), e.rank) for e in stuck] == [(WorkerStuck, 0)]


def test_liveness_caught_up_worker_is_not_stuck_while_engine_idles() -> None:
    view = LivenessView(dead_after=1.0, stuck_after={"synced": 2.0})
    view.engine_at(7, now=0.0)
    for t in range(1, 10):
        view.check_in(0, 1, 7, "synced", now=float(t) * 0.5)
        assert view.poll(float(t) * 0.5) == []


# -- pure: replica fix, replies, scheduler ------------------------------------------------------
def test_replica_survives_new_epoch_heartbeats_while_desynced() -> None:
    """Regression: a second new-epoch Heartbeat hit an assertion in the BUFFER action."""
    replica = WorkerReplica()
    replica.receive(EngineMirror(epoch=1).snapshot(), 0.0)
    for t in (0.1, 0.2, 0.3):
        replica.receive(Heartbeat(epoch=2, seq=0), t)
    assert replica.state is State.DESYNCED
    replica.receive(EngineMirror(epoch=2).snapshot(), 0.4)
    assert replica.state is State.SYNCED and replica.epoch == 2


def test_replies_round_trip_and_reject_garbage() -> None:
    msg = StepResult(epoch=3, seq=9, rank=2, rows=pack_tokens([0, 2]), tokens=pack_tokens([5, 7]))
    back = decode_reply([encode_reply(msg)])
    assert back == msg and back.token_array().tolist() == [5, 7]
    from protocol.errors import MalformedMessage

    for frames in ([b"\xc1"], [encode_reply(msg)[:-3]], [b"a", b"b"], []):
        with pytest.raises(MalformedMessage):
            decode_reply(frames)


def _drive(scheduler: Scheduler, runner: object, mirror: Oracle | None = None,
           arrivals: int = 10) -> dict[str, list[int]]:
    rng = np.random.default_rng(3)
    for i in range(arrivals):
        scheduler.add(f"r{i}", rng.integers(0, 512, int(rng.integers(5, 60))), 12)
    while scheduler.has_work():
        request = scheduler.schedule()
        if mirror is not None:
            mirror.diff(request)  # the oracle: the workers' rebuild equals the request
        out = runner.execute(request)  # type: ignore[attr-defined]
        scheduler.update(out.req_ids, out.token_ids)
    return {k: v.tolist() for k, v in scheduler.finished.items()}


def test_scheduler_preemption_and_chunking_do_not_change_outputs() -> None:
    """Recompute-style preemption and chunked prefill must not change a single token."""
    import torch

    from worker_side.model import TinyModel
    from worker_side.runner import ModelRunner

    torch.set_num_threads(1)
    model = TinyModel(seed=0)
    roomy = Scheduler(num_blocks=256, token_budget=256, max_running=16)
    tight = Scheduler(num_blocks=12, token_budget=24, max_running=8)
    mirror = Oracle(token_mode=TOKEN_MODE_ENGINE)
    want = _drive(roomy, ModelRunner(model, num_blocks=256))
    got = _drive(tight, ModelRunner(model, num_blocks=256), mirror)
    assert tight.num_preemptions > 0
    assert got == want and len(got) == 10


# -- security policy ------------------------------------------------------------------------------
@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dct-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_tcp_without_keys_or_insecure_flag_is_refused() -> None:
    with pytest.raises(InsecureEndpoint, match="without CURVE.*--insecure"):
        EngineTransport("tcp://127.0.0.1:1")


def test_curve_with_an_empty_allow_list_is_refused() -> None:
    keys = CurveKeys(b"x" * 40, b"y" * 40, frozenset())
    with pytest.raises(InsecureEndpoint, match="allow list is empty"):
        EngineTransport("tcp://127.0.0.1:1", keys=keys)


def test_second_engine_on_the_same_ipc_dir_is_refused(short_dir: Path) -> None:
    endpoint = f"ipc://{short_dir}/e"
    first = EngineTransport(endpoint)
    try:
        with pytest.raises(EndpointInUse, match="another engine"):
            EngineTransport(endpoint)
        assert (short_dir / "e" / "pub").exists()
        assert oct((short_dir / "e").stat().st_mode & 0o777) == "0o700"
    finally:
        first.close()
    assert not (short_dir / "e").exists()  # sockets, lock and directory removed
    EngineTransport(endpoint).close()  # the path is free again


def test_ipc_path_over_107_bytes_and_shared_dirs_are_refused(short_dir: Path) -> None:
    with pytest.raises(EndpointError, match="107"):
        PrivateDir(short_dir / ("x" * 110))
    shared = short_dir / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(EndpointError, match="0700"):
        PrivateDir(shared)


def test_default_endpoint_is_a_fresh_private_ipc_dir() -> None:
    transport = EngineTransport()
    path = Path(transport.endpoint[len("ipc://"):])
    try:
        assert transport.endpoint.startswith("ipc://") and (path / "lock").exists()
        assert path.stat().st_mode & 0o777 == 0o700
    finally:
        transport.close()
    assert not path.exists()


# -- real sockets --------------------------------------------------------------------------


@pytest.mark.integration
def test_worker_with_unknown_curve_key_receives_nothing(tmp_path: Path) -> None:
    from worker_side.transport import ClientKeys, WorkerTransport

    server = load_keypair(generate_keypair(tmp_path, "engine")[1])
    good = load_keypair(generate_keypair(tmp_path, "good")[1])
    bad = load_keypair(generate_keypair(tmp_path, "bad")[1])
    endpoint = free_tcp_endpoint()
    engine = EngineTransport(endpoint, keys=CurveKeys(*server, frozenset({good[0]})))
    workers = [WorkerTransport(endpoint, ClientKeys(server[0], *k)) for k in (good, bad)]
    received = [0, 0]
    try:
        for _ in range(2000):  # bounded: the good worker gets 20 messages long before
            engine.publish(Heartbeat(epoch=1, seq=0))
            for i, w in enumerate(workers):
                received[i] += len(w.recv(5))
            if received[0] >= 20:
                break
        assert received[0] >= 20
        assert received[1] == 0
        assert workers[1].stats()["auth_failures"] >= 1
    finally:
        for w in workers:
            w.close()
        engine.close()


@pytest.mark.integration
@pytest.mark.parametrize("ring", [0, 4 << 20], ids=["sockets", "ring"])
def test_large_tensor_frames_go_out_zero_copy_and_arrive_intact(short_dir: Path,
                                                                ring: int) -> None:
    import torch

    from protocol.messages import Delta, DeltaBody, NewRequest, Spec, encode_spec
    from protocol.tensors import tensors_equal
    from worker_side.transport import WorkerTransport

    engine = EngineTransport(f"ipc://{short_dir}/e", ring_bytes=ring)
    worker = WorkerTransport(engine.endpoint, rank=0)
    embeds = torch.arange(300_000, dtype=torch.float32).reshape(1000, 300)
    spec = encode_spec(Spec(req_id="r", prompt_none=True, embeds=("float32", (1000, 300))))
    body = DeltaBody(added=(NewRequest(handle=0, spec=spec, embeds=embeds),))
    try:
        for _ in range(500):  # until the subscription is live (bounded)
            engine.publish(Heartbeat(epoch=1, seq=0))
            if worker.recv(10):
                break
        size = engine.publish(Delta(epoch=1, seq=1, digest=0, body=body))
        embeds.zero_()  # allowed: publish waited on the MessageTracker (or copied into the ring)
        assert size > embeds.nbytes
        delta = next(m for _ in range(200) for m in worker.recv(20) if isinstance(m, Delta))
        received = delta.body.added[0].embeds
        assert tensors_equal(received, torch.arange(300_000, dtype=torch.float32)
                             .reshape(1000, 300))
    finally:
        worker.close()
        engine.close()


class Harness:
    """An in-process engine stepping a seeded workload through real worker processes."""

    def __init__(self, endpoint: str | None, *, requests: int = 6, seed: int = 0,
                 epoch: int = 1, **transport_kw: object) -> None:
        self.args = argparse.Namespace(seed=seed, requests=requests, max_tokens=10,
                                       num_blocks=256, token_budget=64)
        transport = EngineTransport(endpoint, **transport_kw)  # type: ignore[arg-type]
        self.session = EngineSession(transport, EngineMirror(epoch, TOKEN_MODE_ENGINE))
        self.endpoint = transport.endpoint
        self.scheduler = make_scheduler(self.args)
        self.jobs = make_jobs(seed, requests, 10)
        self.step_no = 0

    def steps(self, count: int | None = None) -> None:
        while (self.jobs or self.scheduler.has_work()) and count != 0:
            admit(self.scheduler, self.jobs, self.step_no)
            request = self.scheduler.schedule()
            answer = self.session.run_step(request)
            ids = [request.req_ids[i] for i in answer.row_array().tolist()]
            self.scheduler.update(ids, answer.token_array().tolist())
            self.step_no += 1
            count = None if count is None else count - 1

    def outputs(self) -> dict[str, list[int]]:
        return {k: v.tolist() for k, v in self.scheduler.finished.items()}


def spawn_worker(endpoint: str, rank: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "worker_side.main", "--connect", endpoint, "--rank", str(rank),
           "--num-blocks", "256", "--engine-timeout", "20", "-v", *extra]  # -v: worker-stats
    return subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stderr=log.open("wb"))


def worker_stats(log: Path) -> dict[str, int]:
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("worker-stats ")]
    assert lines, log.read_text()[-2000:]
    return json.loads(lines[-1][len("worker-stats "):])  # type: ignore[no-any-return]


def _finish(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.integration
def test_bad_frames_are_counted_logged_once_and_change_nothing(tmp_path: Path) -> None:
    h = Harness(None)
    log = tmp_path / "w0.log"
    proc = spawn_worker(h.endpoint, 0, log, "--max-message-bytes", "4096")
    try:
        h.session.wait_for_workers(1, timeout=60)
        h.steps(3)
        good = codec.encode(Heartbeat(epoch=1, seq=h.session.mirror.seq))
        pub = h.session.transport
        pub.publish_frames([b"\xc1 not msgpack"])
        pub.publish_frames([bytes(good[0])[:-2]])  # truncated
        pub.publish_frames([b"x" * 3000, b"y" * 3000])  # every frame fits, the whole does not
        h.steps(3)
        assert h.session.stats["resyncs"] == 0  # state unchanged: deltas kept applying
        pub.publish_frames([b"z" * 10000])  # one frame over MAXMSGSIZE: zmq drops the link
        h.steps()
    finally:
        h.session.close(expect={0})
        code = _finish(proc)
    assert code == 0
    stats = worker_stats(log)
    assert (stats["malformed"], stats["oversized"]) == (2, 1)
    assert stats["disconnects"] >= 1 and stats["replica_rejected"] == 0
    text = log.read_text()
    assert text.count("dropped frames that do not decode") == 1
    assert text.count("dropped a message over max_message_bytes") == 1
    assert h.session.stats["mismatched"] == 0
    assert h.outputs() == reference_outputs(h.args)


@pytest.mark.integration
@pytest.mark.parametrize("goodbye", [True, False], ids=["clean", "crashed"])
def test_engine_restart_new_epoch_workers_resync_and_continue(short_dir: Path, tmp_path: Path,
                                                              goodbye: bool) -> None:
    endpoint = f"ipc://{short_dir}/e"
    log = tmp_path / "w0.log"
    first = Harness(endpoint, epoch=11)
    proc = spawn_worker(endpoint, 0, log, "--persist")
    try:
        first.session.wait_for_workers(1, timeout=60)
        first.steps(4)
        if goodbye:
            first.session.close("restart")
        else:  # vanish mid-run: no Goodbye, the next epoch's heartbeats are the first news
            first.session.transport.close()
        second = Harness(endpoint, epoch=12, requests=5)  # a fresh engine: new workload
        second.session.wait_for_workers(1, timeout=60)
        second.steps()
        assert second.outputs() == reference_outputs(second.args)
        assert second.session.stats["compared"] > 0 and second.session.stats["mismatched"] == 0
        second.session.close("done")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert not (short_dir / "e").exists()


@pytest.mark.integration
def test_killed_worker_is_reported_by_lost_check_ins_never_a_hang(tmp_path: Path) -> None:
    """No supervisor here: only the check-ins tell the engine that rank 1 died."""
    from engine_side.session import WorkerDied

    h = Harness(None, requests=8)
    seen: list[object] = []
    h.session.on_event, h.session.strict = seen.append, True
    procs = [spawn_worker(h.endpoint, r, tmp_path / f"w{r}.log") for r in range(2)]
    try:
        h.session.wait_for_workers(2, timeout=60)
        h.steps(2)
        procs[1].kill()
        procs[1].wait()
        with pytest.raises(WorkerDied, match="rank 1 .* no check-in for") as info:
            h.steps()
        dead = info.value.event
        assert dead.rank == 1 and dead.silent_for > h.session.liveness.dead_after
        assert [e for e in seen if isinstance(e, WorkerDead)] == [dead]
    finally:
        h.session.close(expect={0})
        _finish(procs[0])
        procs[1].wait()


@pytest.mark.integration
def test_worker_refuses_an_engine_of_another_major_version(tmp_path: Path) -> None:
    from protocol.messages import Hello

    h = Harness(None)
    log = tmp_path / "w0.log"
    proc = spawn_worker(h.endpoint, 0, log)
    try:
        h.session.wait_for_workers(1, timeout=60)  # its snapshot came after a Hello of ours
        h.session.transport.publish(Hello(epoch=1, seq=0, major=99, role="engine"))
        code = _finish(proc)
    finally:
        h.session.close()
    assert code == 5
    assert "incompatible protocol" in log.read_text()


@pytest.mark.integration
@pytest.mark.parametrize("ring", [0, 1024], ids=["sockets", "ring"])
def test_stalled_worker_past_hwm_detects_the_gap_and_resyncs(tmp_path: Path, ring: int) -> None:
    """Past the PUB high-water mark (sockets), or past the step ring's capacity (ring: the
    steps taken while it is stopped overrun a 1 KiB ring; larger ones go ON_PUB and drop)."""
    h = Harness(None, requests=8, sndhwm=4, sndbuf=4096, ring_bytes=ring)
    logs = [tmp_path / f"w{r}.log" for r in range(2)]
    procs = [spawn_worker(h.endpoint, r, logs[r], "--rcvhwm", "4", "--rcvbuf", "4096")
             for r in range(2)]
    try:
        h.session.wait_for_workers(2, timeout=60)
        h.steps(2)
        os.kill(procs[1].pid, signal.SIGSTOP)
        for _ in range(300):  # paced, so the kernel buffers fill too: later messages drop
            for _ in range(50):
                h.session.transport.publish(Heartbeat(epoch=1, seq=h.session.mirror.seq))
            h.session.service(0.002)
        h.steps(4 if not ring else 16)  # rank 1 is declared dead and no longer waited for
        os.kill(procs[1].pid, signal.SIGCONT)
        h.steps()
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
        h.session.close(expect={0, 1})
        codes = [_finish(p) for p in procs]
    assert codes == [0, 0]
    stalled = worker_stats(logs[1])
    assert stalled["replica_gaps"] >= 1 and stalled["replica_snapshots"] >= 2
    assert stalled["ring"] == int(ring > 0)
    if ring:  # lapped while stopped (or a large Delta's PUB copy was dropped)
        assert stalled["ring_overruns"] + stalled["ring_lost"] >= 1
    assert h.session.stats["resyncs"] >= 1 and h.session.stats["mismatched"] == 0
    assert h.outputs() == reference_outputs(h.args)


def test_zap_handler_admits_allowed_curve_keys_alone() -> None:
    """The ZAP answers by mechanism and key (RFC 27 frames), refusals counted; a real
    CURVE client with an allowed key gets through the handler's own thread."""
    import zmq
    from zmq.utils import z85

    from engine_side.zap import ZapHandler

    server_pub, server_sec = zmq.curve_keypair()
    good_pub, good_sec = zmq.curve_keypair()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    zap = ZapHandler(ctx, frozenset({good_pub}))
    try:
        def ask(mechanism: bytes, *creds: bytes) -> list[bytes]:
            return zap.answer([b"1.0", b"7", b"", b"127.0.0.1", b"", mechanism, *creds])

        assert ask(b"CURVE", z85.decode(good_pub))[2:5] == [b"200", b"OK", good_pub]
        assert ask(b"CURVE", b"\0" * 32)[2] == b"400" and zap.rejected == 1
        assert ask(b"NULL")[2] == b"200" and ask(b"PLAIN", b"u", b"p")[2] == b"400"
        assert zap.answer([b"2.0", b"7"])[2] == b"400"
        server = ctx.socket(zmq.ROUTER)
        server.curve_server, server.curve_secretkey = True, server_sec
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = ctx.socket(zmq.DEALER)
        client.curve_serverkey, client.curve_publickey = server_pub, good_pub
        client.curve_secretkey = good_sec
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hello")
        assert server.poll(10_000)
        ident, body = server.recv_multipart(copy=False)
        assert body.bytes == b"hello" and body.get("User-Id") == good_pub.decode()
        for sock in (client, server):
            sock.close(linger=0)
    finally:
        zap.stop()
        zap.stop()  # (again: nothing)
        ctx.term()
