"""Multimodal items wired through mirror, codec, replica and the shared-memory store.

Every step goes ``MultimodalEngine`` (mirror + store) → ``codec`` → a real
``WorkerReplica`` → ``MultimodalWorker``; the resolved request must equal the
engine's original one, with every tensor bit-exact and of the same library.
Lifetimes are checked against an independent model of the rule in
``worker_side.mm_items``: count = stored features of live requests + encoder cache.
"""

from __future__ import annotations

import hashlib
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
import numpy as np
import pytest
import torch
from nested import assert_same

from engine_side.mirror import EngineMirror
from engine_side.mm_items import COPY_SEPARATOR, MultimodalEngine
from engine_side.shm_store import ShmStore
from protocol import codec
from protocol.messages import Delta
from protocol.params import MMFeatureRef, SamplingSpec
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec, requests_equal
from protocol.store_handles import UnknownItem
from protocol.tensors import tensor_bytes
from worker_side import events as ev
from worker_side.mm_items import MultimodalWorker, StoreRef, as_store_ref
from worker_side.replica import WorkerReplica
from worker_side.shm_reader import ShmReader

REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- data


def np_image(seed: int) -> dict[str, Any]:
    """numpy only (a worker process then never imports torch: it starts in well under 1 s)."""
    rng = np.random.default_rng(seed)
    return {"pixel_values": [rng.standard_normal((3, 16, 16), dtype=np.float32),
                             np.zeros((0, 2), np.float16)],
            "image_grid_thw": np.array([[1, 4, 4]]) + seed, "scale": np.array(seed, np.float64)}


def image(seed: int) -> dict[str, Any]:
    """Nested like multimodal kwargs, over the tensor zoo (bf16, 0-d, empty, non-contiguous)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": [torch.randn(3, 16, 16, generator=g),
                         torch.randn(2, 5, generator=g).to(torch.bfloat16)],
        "image_grid_thw": torch.tensor([[1, 4, 4]], dtype=torch.int64) + seed,
        "extra": {"scale": torch.tensor(0.5 + seed), "empty": torch.empty(0, 3),
                  "t": torch.arange(12.0).reshape(3, 4).t() * seed,
                  "np": np.arange(6, dtype=np.int32).reshape(2, 3) + seed, "n": [seed, "x"]},
    }


def content_hash(data: Any) -> str:
    return hashlib.sha256(b"".join(tensor_bytes(t) for t in tensors_of(data))).hexdigest()


def tensors_of(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from tensors_of(v)
    elif isinstance(obj, np.ndarray | torch.Tensor):
        yield obj


def feature(seed: int, offset: int = 0, numpy_only: bool = False) -> MMFeatureRef:
    data = (np_image if numpy_only else image)(seed)  # fresh objects: hits go by identifier
    return MMFeatureRef("image", f"img{seed}-" + content_hash(data)[:56], offset, 16,
                        data=data)


def spec(req_id: str, seeds: list[int], numpy_only: bool = False) -> RequestSpec:
    prompt = np.arange(40, dtype=np.int64)
    prompt.flags.writeable = False
    feats = tuple(feature(s, 16 * i, numpy_only) for i, s in enumerate(seeds))
    return RequestSpec(req_id, prompt, SamplingSpec(), mm_features=feats)


def batch(specs: list[RequestSpec], encode: dict[str, list[int]] | None = None,
          finished: tuple[str, ...] = (), free: tuple[str, ...] = ()) -> ExecuteModelRequest:
    n, encode = len(specs), encode or {}
    return ExecuteModelRequest(
        req_ids=[s.req_id for s in specs], specs=specs,
        num_scheduled_tokens=np.ones(n, dtype=np.int64),
        num_computed_tokens=np.zeros(n, dtype=np.int64),
        block_tables=(Ragged.from_lists([[i] for i in range(n)]),),
        spec_token_ids=Ragged.empty(n),
        encoder_inputs=Ragged.from_lists([encode.get(s.req_id, []) for s in specs]),
        finished_req_ids=frozenset(finished), free_encoder_mm_hashes=free)


# ---------------------------------------------------------------- the pipeline


@dataclass
class Local:
    """Engine (mirror + store) and one in-process worker joined by the codec."""

    store: ShmStore = field(default_factory=lambda: ShmStore(1 << 20, max_items=64))
    engine: MultimodalEngine = field(init=False)
    reader: ShmReader = field(init=False)
    replica: WorkerReplica = field(default_factory=WorkerReplica)
    worker: MultimodalWorker = field(init=False)
    frames: list[list[Any]] = field(default_factory=list)  # every step's frames

    def __post_init__(self) -> None:
        self.engine = MultimodalEngine(EngineMirror(verify=True), self.store)
        self.reader = ShmReader.attach(self.store.add_reader(os.getpid()))
        self.worker = MultimodalWorker(self.reader)
        self.replica.receive(codec.decode(codec.encode(self.engine.snapshot())), 0.0)

    def send(self, request: ExecuteModelRequest) -> list[Any]:
        frames = codec.encode(self.engine.diff(request))
        self.frames.append(frames)
        return frames

    def deliver(self, frames: list[Any], request: ExecuteModelRequest) -> ExecuteModelRequest:
        delta = codec.decode(frames)
        assert isinstance(delta, Delta)
        assert self.replica.receive(delta, 0.0) == [ev.Applied(delta.seq)]
        got = self.worker.resolve(self.replica.request())
        check_resolved(got, request, self.worker)
        return got

    def step(self, request: ExecuteModelRequest) -> ExecuteModelRequest:
        return self.deliver(self.send(request), request)

    def close(self) -> None:
        self.reader.close()
        self.store.close()


def check_resolved(got: ExecuteModelRequest, want: ExecuteModelRequest,
                   worker: MultimodalWorker) -> None:
    """``got`` equals ``want``; items the worker holds from the store are views of it."""
    assert requests_equal(got, want)
    for a, b in zip(got.specs, want.specs, strict=True):
        for fa, fb in zip(a.mm_features, b.mm_features, strict=True):
            assert_same(fa.data, fb.data)
            if worker.reader is not None and fa.identifier in worker.held:
                assert all(in_mapping(t, worker.reader) for t in tensors_of(fa.data))


def in_mapping(t: Any, reader: ShmReader) -> bool:
    """True when tensor ``t`` is a view of the reader's mapping (zero-copy)."""
    base = np.frombuffer(reader._data, np.uint8).ctypes.data  # test-only peek
    ptr = t.ctypes.data if isinstance(t, np.ndarray) else t.data_ptr()
    return bool(t.nbytes == 0 or base <= ptr < base + reader.info.capacity)


def store_refs(store: ShmStore, key: str) -> int:
    """The engine references the store holds for ``key`` (test-only peek)."""
    entry = store._entries.get(key)
    return -1 if entry is None else entry.refs


def added_refs(frames: list[Any]) -> list[Any]:
    delta = codec.decode(frames)
    assert isinstance(delta, Delta)
    return [f.data for a in delta.body.added for f in a.mm_features]


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
    assert local.engine.counts == {key: 3} == local.worker.lifetimes.counts
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
    assert local.engine.counts == {} == local.worker.lifetimes.counts
    assert store_refs(local.store, key) == 0  # evictable: unreferenced ...
    assert not local.reader.holds(key) and not local.store.holds(0, key)  # ... and unpinned
    assert local.worker.held == {}


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


def test_store_ref_on_a_remote_worker_is_refused(local: Local) -> None:
    frames = local.send(batch([spec("a", [7])]))
    replica, remote = WorkerReplica(), MultimodalWorker(None)
    replica.receive(codec.decode(codec.encode(EngineMirror().snapshot())), 0.0)
    replica.receive(codec.decode(frames), 0.0)
    with pytest.raises(UnknownItem):
        remote.resolve(replica.request())


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
        model.live[f"r{n}-{i}"] = spec(f"r{n}-{i}", rng.sample(range(5), rng.randrange(1, 3)))
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
        assert local.engine.counts == counts == local.worker.lifetimes.counts
        held = {local.engine.key_of(i) for i in counts}
        assert set(local.reader.held_keys) == held == set(local.worker.held.values())
        for key in (k for k in list(local.store._entries) if COPY_SEPARATOR not in k):
            assert store_refs(local.store, key) == (key in held)
    stats = local.engine.stats
    assert stats.hits > 0 and stats.written > 0 and stats.inline == 0


@dataclass
class Follower:
    """A second local worker that applies the engine's steps late, in random batches."""

    local: Local
    queue: list[tuple[list[Any], ExecuteModelRequest]] = field(default_factory=list)
    replica: WorkerReplica = field(default_factory=WorkerReplica)
    worker: MultimodalWorker = field(init=False)

    def __post_init__(self) -> None:
        reader = ShmReader.attach(self.local.store.add_reader(os.getpid()))
        self.worker = MultimodalWorker(reader)
        self.replica.receive(codec.decode(codec.encode(self.local.engine.snapshot())), 0.0)

    def drain(self) -> None:
        for frames, request in self.queue:
            assert self.replica.receive(codec.decode(frames), 0.0)[0] == ev.Applied(
                self.replica.seq)
            check_resolved(self.worker.resolve(self.replica.request()), request, self.worker)
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
        assert late.worker.lifetimes.counts == local.engine.counts
        want = {local.engine.key_of(i) for i in model.counts()}
        assert set(late.worker.held.values()) == want
        return local.engine.stats.fresh_copies
    finally:
        assert late.worker.reader is not None
        late.worker.reader.close()
        local.close()


def test_a_lagging_worker_never_resolves_a_released_item() -> None:
    assert sum(lagging_run(seed) for seed in range(4)) > 0  # the race did happen


# ---------------------------------------------------------------- remote channel


def test_remote_channel_sends_frames_bit_exact() -> None:
    engine = MultimodalEngine(EngineMirror(verify=True), store=None)
    replica, worker = WorkerReplica(), MultimodalWorker(None)
    replica.receive(codec.decode(codec.encode(engine.snapshot())), 0.0)
    a = spec("a", [1, 2])
    for request in (batch([a], encode={"a": [0, 1]}), batch([a, spec("b", [1])]),
                    batch([], finished=("a", "b"))):
        frames = codec.encode(engine.diff(request))
        replica.receive(codec.decode(frames, copy=True), 0.0)
        check_resolved(worker.resolve(replica.request()), request, worker)
    assert engine.stats.inline == 3 and engine.stats.written == 0
    assert worker.lifetimes.counts == {}


# ---------------------------------------------------------------- a real worker process

_CHILD = r"""
import hashlib, struct, sys
import msgspec
from protocol import codec
from protocol.store_handles import AttachInfo
from protocol.tensors import tensor_bytes
from worker_side.mm_items import MultimodalWorker
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
replica, worker = WorkerReplica(), MultimodalWorker(reader)
while (count := struct.unpack("<I", read(4))[0]):
    applied = replica.receive(codec.decode([blob() for _ in range(count)]), 0.0)
    reply = []
    if any(type(e).__name__ == "Applied" for e in applied):
        for s in worker.resolve(replica.request()).specs:
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
    engine = MultimodalEngine(EngineMirror(), store)

    def exchange(frames: list[Any]) -> list[Any]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(struct.pack("<I", len(frames)) + b"".join(map(_blob, frames)))
        child.stdin.flush()
        (size,) = struct.unpack("<Q", child.stdout.read(8))
        return list(msgspec.msgpack.decode(child.stdout.read(size)))

    try:
        child.stdin.write(_blob(msgspec.msgpack.encode(store.add_reader(child.pid))))
        exchange(codec.encode(engine.snapshot()))
        a, b = spec("a", [1, 2], numpy_only=True), spec("b", [2], numpy_only=True)
        steps = [batch([a], encode={"a": [0, 1]}), batch([a, b]),
                 batch([b], finished=("a",), free=(a.mm_features[0].identifier,)),
                 batch([], finished=("b",), free=(b.mm_features[0].identifier,))]
        for request in steps:
            *got, held, torch_loaded = exchange(codec.encode(engine.diff(request)))
            assert not torch_loaded
            want = [[s.req_id, f.identifier, content_hash(f.data)]
                    for s in request.specs for f in s.mm_features]
            assert got == want
            assert held == sorted(engine.key_of(i) for i in engine.counts)
        assert held == [] and not any(store.holds(0, k) for k in list(store._entries))
    finally:
        child.stdin.write(struct.pack("<I", 0))
        child.stdin.close()
        assert child.wait(timeout=30) == 0
        store.close()
