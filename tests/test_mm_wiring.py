"""Multimodal items wired through the mirror, codec, replica and the shared-memory store.

Every step goes ``RequestDiffer`` → ``StoreMirror`` (the mirror's step with its
``ItemWriter``) → ``codec`` → a real ``WorkerReplica`` → ``ItemResolver`` →
``rebuild_request``; the rebuilt request must equal the engine's original one, with
every tensor bit-exact and of the same library.  Lifetimes are checked against an
independent model of the rule in ``protocol.items``: count = stored items of live
requests + encoder cache.
"""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from mm_pipeline import (
    Local,
    Receiver,
    added_refs,
    batch,
    check_resolved,
    content_hash,
    embeds,
    spec,
    store_refs,
)

from engine_side.item_writer import StoreMirror, content_key
from engine_side.mirror import EngineMirror, Entry
from engine_side.request_diff import RequestDiffer
from engine_side.shm_store import ShmStore
from protocol import codec
from protocol.errors import LocalProtocolError
from protocol.items import COPY_SEPARATOR, StoreRef, as_store_ref
from protocol.rebuild import wire_spec
from protocol.request import ExecuteModelRequest, RequestSpec
from protocol.store_handles import UnknownItem
from worker_side.shm_reader import ShmReader

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def local() -> Iterator[Local]:
    pair = Local()
    yield pair
    pair.close()


# ---------------------------------------------------------------- scenarios


def test_items_travel_as_references_and_hits_send_nothing(local: Local) -> None:
    a = spec("a", [1, 2])
    ident = a.mm_features[0].identifier
    local.step(batch([a], encode={"a": [0, 1]}))
    frames = local.frames[-1]
    assert len(frames) == 1 and codec.encoded_size(frames) < 1000  # 2 images, 1 reader
    refs = [as_store_ref(d) for d in added_refs(frames)]
    assert all(r is not None and set(r.handles) == {0} for r in refs)
    assert local.engine.stats.written == 2 and local.engine.counts[ident] == 2

    b = spec("b", [1])  # same image, new tensor objects
    local.step(batch([a, b]))
    frames = local.frames[-1]
    assert added_refs(frames) == [{"@": "store"}]  # the reader holds it: a bare mention
    assert len(frames) == 1 and codec.encoded_size(frames) < 300  # measured 220: the whole add
    assert local.engine.stats.written == 2 and local.engine.stats.hits == 1
    assert len(msgspec.msgpack.encode(StoreRef())) == 9


@pytest.mark.parametrize("order", ["finish_first", "free_first", "same_step"])
def test_item_freed_when_no_request_nor_cache_needs_it(local: Local, order: str) -> None:
    a, b = spec("a", [1]), spec("b", [1])
    key = a.mm_features[0].identifier
    local.step(batch([a], encode={"a": [0]}))
    local.step(batch([a, b]))
    assert local.engine.counts == {key: 3} == local.worker.items.counts
    local.step(batch([b], finished=("a",)))
    assert local.engine.counts == {key: 2}
    if order == "finish_first":
        local.step(batch([], finished=("b",)))
        assert store_refs(local.store, key) == 1 and local.reader.holds(key)
        local.step(batch([], free=(key,)))
    elif order == "free_first":
        local.step(batch([b], free=(key,)))
        assert store_refs(local.store, key) == 1 and local.reader.holds(key)
        local.step(batch([], finished=("b",)))
    else:
        local.step(batch([], finished=("b",), free=(key,)))
    assert local.engine.counts == {} == local.worker.items.counts
    assert store_refs(local.store, key) == 0  # evictable: unreferenced ...
    assert not local.reader.holds(key) and not local.store.holds(0, key)  # ... and unpinned
    assert local.worker.items.held == {}


def test_refinish_and_readd_in_one_step_keeps_the_item(local: Local) -> None:
    a = spec("a", [3])
    key = a.mm_features[0].identifier
    local.step(batch([a]))
    again = spec("a", [3])
    local.step(batch([again], finished=("a",)))
    assert local.engine.counts == {key: 1} and local.engine.stats.written == 1
    assert added_refs(local.frames[-1]) == [{"@": "store"}]


def test_reacquired_after_release_reuses_the_resident_copy(local: Local) -> None:
    a = spec("a", [4])
    key = a.mm_features[0].identifier
    local.step(batch([a]))
    local.step(batch([], finished=("a",)))
    assert store_refs(local.store, key) == 0 and not local.reader.holds(key)
    local.step(batch([spec("b", [4])]))
    assert local.engine.stats.written == 1 and store_refs(local.store, key) == 1
    assert local.reader.holds(key)


def test_reacquired_before_the_reader_released_gets_a_fresh_copy(local: Local) -> None:
    a = spec("a", [5])
    key = a.mm_features[0].identifier
    local.step(batch([a]))
    release = batch([], finished=("a",))
    readd = batch([spec("b", [5])])
    f1, f2 = local.send(release), local.send(readd)  # the worker lags one step
    fresh = f"{key}{COPY_SEPARATOR}1"
    assert local.engine.key_of(key) == fresh and local.engine.stats.fresh_copies == 1
    local.deliver(f1, release)
    local.deliver(f2, readd)
    assert local.reader.held_keys == [fresh] and store_refs(local.store, key) == 0
    local.step(batch([], finished=("b",)))
    assert local.reader.held_keys == [] and store_refs(local.store, fresh) == 0


def test_full_store_leaves_items_inline() -> None:
    pair = Local(store=ShmStore(2048, max_items=4))
    try:
        pair.step(batch([spec("a", [6])]))  # a ~3.5 KiB item: does not fit
        assert len(pair.frames[-1]) > 1 and pair.engine.stats.inline == 1
        assert pair.engine.counts == {} and len(pair.store) == 0
    finally:
        pair.close()


def test_a_failed_step_takes_back_its_store_references(local: Local) -> None:
    a = spec("a", [8], embeds=embeds(0))
    key = a.mm_features[0].identifier
    wire, data, masks, pe = wire_spec(a)
    with pytest.raises(LocalProtocolError):  # scheduled counts that do not fit the batch
        local.mirror.step(["a"], [1, 1], added=[Entry(wire, 0, None, data, masks, pe)])
    assert local.engine.counts == {} and local.mirror.seq == 0
    assert store_refs(local.store, key) == 0 == store_refs(local.store, content_key(embeds(0)))
    # The reader never got the handles the failed step pinned for it, so the same request
    # again gets fresh copies (the stale pins keep the first ones until it detaches).
    local.step(batch([a]))
    for ident in (key, content_key(embeds(0))):
        fresh = local.engine.key_of(ident)
        assert fresh.startswith(ident + COPY_SEPARATOR) and store_refs(local.store, fresh) == 1
        assert store_refs(local.store, ident) == 0 and local.reader.held_keys.count(fresh) == 1


def test_store_ref_on_a_remote_worker_is_refused(local: Local) -> None:
    frames = local.send(batch([spec("a", [7])]))
    remote = Receiver(None)
    remote.receive(codec.encode(EngineMirror().snapshot()))
    with pytest.raises(UnknownItem):
        remote.receive(frames)


# ---------------------------------------------------------------- random workload


class Model:
    """The lifetime rule, written independently: who needs which identifier."""

    def __init__(self) -> None:
        self.live: dict[str, RequestSpec] = {}
        self.cached: set[str] = set()

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.live.values():
            for f in s.mm_features:
                out[f.identifier] = out.get(f.identifier, 0) + 1
            if s.prompt_embeds is not None:
                key = content_key(s.prompt_embeds)
                out[key] = out.get(key, 0) + 1
        for ident in self.cached:
            out[ident] = out.get(ident, 0) + 1
        return out


def random_step(rng: random.Random, model: Model, n: int) -> ExecuteModelRequest:
    finished = tuple(r for r in model.live if rng.random() < 0.25)
    for r in finished:
        del model.live[r]
    if finished and rng.random() < 0.3:  # finished and re-added in one step
        model.live[finished[0]] = spec(finished[0], [rng.randrange(5)])
    for i in range(rng.randrange(3)):
        pe = embeds(rng.randrange(3)) if rng.random() < 0.3 else None
        model.live[f"r{n}-{i}"] = spec(f"r{n}-{i}", rng.sample(range(5), rng.randrange(0, 3)),
                                       embeds=pe)
    free = tuple(i for i in sorted(model.cached) if rng.random() < 0.3)
    model.cached.difference_update(free)
    specs = list(model.live.values())
    encode: dict[str, list[int]] = {}
    for s in specs:
        for j, f in enumerate(s.mm_features):
            if f.identifier not in model.cached and rng.random() < 0.5:
                model.cached.add(f.identifier)
                encode.setdefault(s.req_id, []).append(j)
    return batch(specs, encode, finished, free)


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_agrees_with_the_model(local: Local, seed: int) -> None:
    rng, model = random.Random(seed), Model()
    for n in range(40):
        local.step(random_step(rng, model, n))
        counts = model.counts()
        assert local.engine.counts == counts == local.worker.items.counts
        held = {local.engine.key_of(i) for i in counts}
        assert set(local.reader.held_keys) == held == set(local.worker.items.held.values())
        for key in (k for k in list(local.store._entries) if COPY_SEPARATOR not in k):
            assert store_refs(local.store, key) == (key in held)
    stats = local.engine.stats
    assert stats.hits > 0 and stats.written > 0 and stats.inline == 0


@dataclass
class Follower:
    """A second local worker that applies the engine's steps late, in random batches."""

    local: Local
    queue: list[tuple[list[Any], ExecuteModelRequest]] = field(default_factory=list)
    worker: Receiver = field(init=False)

    def __post_init__(self) -> None:
        self.worker = Receiver(ShmReader.attach(self.local.store.add_reader(os.getpid())))
        self.worker.receive(codec.encode(self.local.mirror.snapshot()))

    def drain(self) -> None:
        for frames, request in self.queue:
            got = self.worker.receive(frames)
            assert got is not None
            check_resolved(got, request, self.worker.items)
        self.queue.clear()


def lagging_run(seed: int) -> int:
    """One random workload with a second worker applying late; returns fresh copies made."""
    local = Local()
    rng, model, late = random.Random(seed), Model(), Follower(local)
    try:
        for n in range(40):
            request = random_step(rng, model, n)
            frames = local.send(request)
            local.deliver(frames, request)
            late.queue.append((frames, request))
            if rng.random() < 0.3:
                late.drain()
        late.drain()
        assert late.worker.items.counts == local.engine.counts
        want = {local.engine.key_of(i) for i in model.counts()}
        assert set(late.worker.items.held.values()) == want
        return local.engine.stats.fresh_copies
    finally:
        assert late.worker.reader is not None
        late.worker.reader.close()
        local.close()


def test_a_lagging_worker_never_resolves_a_released_item() -> None:
    assert sum(lagging_run(seed) for seed in range(4)) > 0  # the race did happen


# ---------------------------------------------------------------- remote channel


def test_remote_channel_sends_frames_bit_exact() -> None:
    mirror = EngineMirror()
    differ, worker = RequestDiffer(mirror), Receiver(None)
    worker.receive(codec.encode(mirror.snapshot()))
    a = spec("a", [1, 2], embeds=embeds(1))
    sizes = []
    for request in (batch([a], encode={"a": [0, 1]}), batch([a, spec("b", [1])]),
                    batch([], finished=("a", "b"))):
        frames = codec.encode(differ.diff(request))
        sizes.append(len(frames))
        got = worker.receive(frames)
        assert got is not None
        check_resolved(got, request, worker.items)
    assert sizes[0] > 2 and sizes[1] > 1  # the tensors travel as frames
    assert worker.items.counts == {} and worker.items.held == {}


# ---------------------------------------------------------------- a real worker process

_CHILD = r"""
import hashlib, struct, sys
import msgspec
from protocol import codec
from protocol.store_handles import AttachInfo
from protocol.tensors import tensor_bytes
from protocol.rebuild import rebuild_request, request_spec
from worker_side.item_resolver import ItemResolver
from worker_side.replica import WorkerReplica
from worker_side.shm_reader import ShmReader

def read(n):
    data = sys.stdin.buffer.read(n)
    assert len(data) == n
    return data

def blob():
    (size,) = struct.unpack("<Q", read(8))
    return read(size)

def flat(obj):
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in flat(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in flat(v)]
    return [obj] if hasattr(obj, "dtype") else []

reader = ShmReader.attach(msgspec.msgpack.decode(blob(), type=AttachInfo))
replica, items, cache = WorkerReplica(), ItemResolver(reader), {}
while (count := struct.unpack("<I", read(4))[0]):
    msg = codec.decode([blob() for _ in range(count)])
    events = replica.receive(msg, 0.0)
    reply = []
    if any(type(e).__name__ == "Applied" for e in events):
        state, applied = replica.data, replica.applied
        news = items.resolve(state, applied, state.schedule)  # (after the replica applied)
        items.commit()
        for h, new in zip(applied.added, news):
            cache[h] = (state.requests[h], request_spec(state.spec_of(h), new))
        for s in rebuild_request(state, msg.body, applied, cache).specs:
            for f in s.mm_features:
                raw = b"".join(tensor_bytes(t) for t in flat(f.data))
                reply.append([s.req_id, f.identifier, hashlib.sha256(raw).hexdigest()])
    reply.append(sorted(reader.held_keys))
    reply.append("torch" in sys.modules)
    out = msgspec.msgpack.encode(reply)
    sys.stdout.buffer.write(struct.pack("<Q", len(out)) + out)
    sys.stdout.buffer.flush()
"""


def _blob(data: bytes | memoryview) -> bytes:
    return struct.pack("<Q", len(data)) + bytes(data)


@pytest.mark.integration
def test_worker_process_resolves_items_through_the_store() -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], cwd=REPO_ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    store = ShmStore(1 << 20, max_items=16)
    mirror = StoreMirror(store)
    differ = RequestDiffer(mirror)

    def exchange(frames: list[Any]) -> list[Any]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(struct.pack("<I", len(frames)) + b"".join(map(_blob, frames)))
        child.stdin.flush()
        (size,) = struct.unpack("<Q", child.stdout.read(8))
        return list(msgspec.msgpack.decode(child.stdout.read(size)))

    try:
        child.stdin.write(_blob(msgspec.msgpack.encode(store.add_reader(child.pid))))
        exchange(codec.encode(mirror.snapshot()))
        a, b = spec("a", [1, 2], numpy_only=True), spec("b", [2], numpy_only=True)
        steps = [batch([a], encode={"a": [0, 1]}), batch([a, b]),
                 batch([b], finished=("a",), free=(a.mm_features[0].identifier,)),
                 batch([], finished=("b",), free=(b.mm_features[0].identifier,))]
        for request in steps:
            *got, held, torch_loaded = exchange(codec.encode(differ.diff(request)))
            assert not torch_loaded
            want = [[s.req_id, f.identifier, content_hash(f.data)]
                    for s in request.specs for f in s.mm_features]
            assert got == want
            assert held == sorted(mirror.items.key_of(i) for i in mirror.items.counts)
        assert held == [] and not any(store.holds(0, k) for k in list(store._entries))
    finally:
        child.stdin.write(struct.pack("<I", 0))
        child.stdin.close()
        assert child.wait(timeout=30) == 0
        store.close()
