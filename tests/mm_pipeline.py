"""The multimodal pipeline of tests/test_mm_wiring.py: test data (images over the
tensor zoo, whole requests), the engine end (``RequestDiffer`` over a ``StoreMirror``)
and a receiver (``WorkerReplica`` → ``ItemResolver`` → ``rebuild_request``)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from nested import assert_same

from engine_side.item_writer import StoreMirror, content_key
from engine_side.request_diff import RequestDiffer
from engine_side.shm_store import ShmStore
from protocol import codec
from protocol.messages import Delta, NewRequest
from protocol.params import MMFeatureRef, SamplingSpec
from protocol.rebuild import rebuild_request, request_spec
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec, requests_equal
from protocol.tensors import tensor_bytes
from worker_side import events as ev
from worker_side.item_resolver import ItemResolver
from worker_side.replica import WorkerReplica
from worker_side.shm_reader import ShmReader

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


def spec(req_id: str, seeds: list[int], numpy_only: bool = False,
         embeds: Any = None) -> RequestSpec:
    prompt = np.arange(40, dtype=np.int64)
    prompt.flags.writeable = False
    feats = tuple(feature(s, 16 * i, numpy_only) for i, s in enumerate(seeds))
    return RequestSpec(req_id, prompt, SamplingSpec(), mm_features=feats, prompt_embeds=embeds)


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


class Receiver:
    """A worker's end: replica, item resolver and the whole request rebuilt per step."""

    def __init__(self, reader: ShmReader | None) -> None:
        self.replica = WorkerReplica()
        self.items = ItemResolver(reader)
        self.cache: dict[int, tuple[NewRequest, RequestSpec]] = {}

    @property
    def reader(self) -> ShmReader | None:
        return self.items.reader

    def receive(self, frames: list[Any]) -> ExecuteModelRequest | None:
        """Apply one message; the rebuilt request when it was an applied Delta."""
        msg = codec.decode(frames, copy=True)
        events = self.replica.receive(msg, 0.0)
        if not isinstance(msg, Delta):
            return None
        assert events == [ev.Applied(msg.seq)]
        replica = self.replica
        state, applied, body = replica.data, replica.applied, msg.body
        assert state is not None and applied is not None
        news = self.items.resolve(state, applied, state.schedule)  # (after the replica applied)
        self.items.commit()
        for h, new in zip(applied.added, news, strict=True):
            self.cache[h] = (state.requests[h], request_spec(state.spec_of(h), new))  # type: ignore[assignment]
        return rebuild_request(state, body, applied, self.cache)


@dataclass
class Local:
    """Engine (store mirror) and one in-process worker joined by the codec."""

    store: ShmStore = field(default_factory=lambda: ShmStore(1 << 20, max_items=64))
    mirror: StoreMirror = field(init=False)
    differ: RequestDiffer = field(init=False)
    worker: Receiver = field(init=False)
    frames: list[list[Any]] = field(default_factory=list)  # every step's frames

    def __post_init__(self) -> None:
        self.mirror = StoreMirror(self.store)
        self.differ = RequestDiffer(self.mirror)
        self.worker = Receiver(ShmReader.attach(self.store.add_reader(os.getpid())))
        self.worker.receive(codec.encode(self.mirror.snapshot()))

    @property
    def engine(self) -> Any:
        return self.mirror.items

    @property
    def reader(self) -> ShmReader:
        assert self.worker.reader is not None
        return self.worker.reader

    def send(self, request: ExecuteModelRequest) -> list[Any]:
        frames = codec.encode(self.differ.diff(request))
        self.frames.append(frames)
        return frames

    def deliver(self, frames: list[Any], request: ExecuteModelRequest) -> ExecuteModelRequest:
        got = self.worker.receive(frames)
        assert got is not None
        check_resolved(got, request, self.worker.items)
        return got

    def step(self, request: ExecuteModelRequest) -> ExecuteModelRequest:
        return self.deliver(self.send(request), request)

    def close(self) -> None:
        self.reader.close()
        self.store.close()


def check_resolved(got: ExecuteModelRequest, want: ExecuteModelRequest,
                   worker: ItemResolver) -> None:
    """``got`` equals ``want``; items the worker holds from the store are views of it."""
    assert requests_equal(got, want)
    for a, b in zip(got.specs, want.specs, strict=True):
        for fa, fb in zip(a.mm_features, b.mm_features, strict=True):
            assert_same(fa.data, fb.data)
            if worker.reader is not None and fa.identifier in worker.held:
                assert all(in_mapping(t, worker.reader) for t in tensors_of(fa.data))
        assert_same(a.prompt_embeds, b.prompt_embeds)
        if worker.reader is not None and a.prompt_embeds is not None \
                and content_key(a.prompt_embeds) in worker.held:
            assert in_mapping(a.prompt_embeds, worker.reader)


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
    return [d for a in delta.body.added for d in a.mm_data]


def embeds(k: int) -> Any:
    """Prompt embeddings from a pool of three contents (new objects: hits go by content)."""
    return torch.full((40, 4), float(k)).to(torch.bfloat16 if k == 2 else torch.float32)
