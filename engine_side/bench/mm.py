"""``deltacast bench mm``: moving multimodal pixel tensors from the engine to local workers.

Each case sends ``batch`` images (3×896×896 float32 pixel values plus an
``image_grid_thw``, nested like vLLM's multimodal kwargs) from this process to
1, 2 and 4 worker processes and waits until every worker holds every tensor.

Formats:

* ``memcpy``       one plain copy of the tensors in this process, the yardstick: into
  tensors allocated and written once beforehand (untimed), as the store writes into
  pages it faulted in when it was made (a ``clone`` into fresh pages costs 1-4x as much,
  by whether the allocator hands back pages it already holds);
* ``pickle_torch`` / ``pickle_numpy``  vLLM MessageQueue-style protocol-5 pickle of the
  ``{"pixel_values": [...], "image_grid_thw": [...]}`` dict, sent over zmq ipc, unpickled;
* ``frames``       a :class:`Delta` whose new request carries the images in ``mm_data``,
  ``codec.encode`` zero-copy frames over zmq ipc, ``codec.decode`` (views) in workers;
* ``store_first``  items written into the :class:`ShmStore` (one copy), handles sent;
  workers verify and map views;
* ``store_hit``    the same items again: workers hold them, only keys move;
* ``vllm_shm``     vLLM 0.32's ``SingleWriterShmObjectStorage`` (only when vLLM imports).

Row keys (engine_side/bench/rows.py): ``bytes`` = bytes on the control channel
to one worker; ``encode_us`` = engine-side work; ``decode_us`` = from then until
the last worker holds all tensors (transfer + decode), so ``total_us`` is the
whole hop.  Extra key ``worker_decode_us``: the slowest worker's own decode.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import torch
import zmq

from engine_side.bench.baselines import frames_size, pickle_frames, unpickle_frames
from engine_side.bench.rows import Row, dumps, make_row
from engine_side.shm_store import ShmStore
from protocol import codec
from protocol.messages import Delta, DeltaBody, MMItem, NewRequest, Spec, encode_spec
from protocol.packing import pack_uints
from protocol.store_handles import AttachInfo, decode_refs, encode_refs

FORMATS = ("memcpy", "pickle_torch", "pickle_numpy", "frames", "store_first", "store_hit",
           "vllm_shm")
FULL: dict[str, Any] = {"batches": (1, 10, 50, 100), "workers": (1, 2, 4), "hw": 896,
                        "repeats": 5}
QUICK: dict[str, Any] = {"batches": (1, 2), "workers": (2,), "hw": 64, "repeats": 1}
_DONE = msgspec.msgpack.Decoder(tuple[int, float, int])

Image = dict[str, torch.Tensor]


# ---------------------------------------------------------------- workload


def make_images(count: int, hw: int) -> list[Image]:
    """Distinct pixel tensors (content differs per image) and Qwen2-VL style grids."""
    return [{"pixel_values": torch.full((3, hw, hw), float(i)),
             "image_grid_thw": torch.tensor([[1, hw // 14, hw // 14]])} for i in range(count)]


def mm_kwargs(images: list[Image], numpy: bool = False) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"pixel_values": [], "image_grid_thw": []}
    for img in images:
        for name in out:
            out[name].append(img[name].numpy() if numpy else img[name])
    return out


def features_delta(images: list[Image], keys: list[str]) -> Delta:
    """One new request whose items' data travel beside its spec (``mm_data``)."""
    items = tuple(MMItem("image", k, offset=i * 64, length=64, mm_hash=k)
                  for i, k in enumerate(keys))
    spec = Spec(req_id="mm-0", prompt=pack_uints([0] * 64 * len(keys)), mm=items)
    new = NewRequest(handle=0, spec=encode_spec(spec), mm_data=tuple(images))
    return Delta(epoch=1, seq=1, digest=0, body=DeltaBody(added=(new,)))


def count_tensors(obj: Any) -> int:
    if isinstance(obj, dict):
        return sum(count_tensors(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(count_tensors(v) for v in obj)
    if hasattr(obj, "get_data"):  # vLLM MultiModalKwargsItem
        return count_tensors(obj.get_data())
    return int(isinstance(obj, torch.Tensor) or hasattr(obj, "__array_interface__"))


# ---------------------------------------------------------------- worker process


class _Worker:
    """State of one worker process: its store reader, vLLM reader and held tensors."""

    def __init__(self) -> None:
        self.reader: Any = None
        self.vllm: Any = None
        self.held: Any = None

    def handle(self, kind: str, frames: list[Any]) -> int:
        """Decode one message; returns the number of tensors now held."""
        bufs = [f.buffer for f in frames]
        if kind in ("pickle_torch", "pickle_numpy"):
            self.held = unpickle_frames(bufs)
        elif kind == "frames":
            msg = codec.decode(frames)
            assert isinstance(msg, Delta)
            self.held = (msg, list(msg.body.added[0].mm_data))
            return count_tensors(self.held[1])
        elif kind in ("store_first", "store_hit"):
            self.held = self.reader.resolve_all(decode_refs(bufs[0]))
        elif kind == "vllm_shm":
            refs = msgspec.msgpack.decode(bufs[0])
            self.held = [self.vllm.get(addr, mid, sig, key) for key, addr, mid, sig in refs]
        elif kind == "release":
            for key in self.reader.held_keys:
                self.reader.release(key)
            self.held = None
        elif kind == "attach":
            self._attach(bufs)
        return count_tensors(self.held)

    def _attach(self, bufs: list[Any]) -> None:
        from worker_side.shm_reader import ShmReader

        self.reader = ShmReader.attach(msgspec.msgpack.decode(bufs[0], type=AttachInfo))
        if len(bufs) > 1:
            size, name, max_object, readers = msgspec.msgpack.decode(bufs[1])
            self.vllm = _vllm_reader(size, name, max_object, readers, lock=_VLLM_LOCK)


_VLLM_LOCK: Any = None


def _worker_main(index: int, cmd_addr: str, done_addr: str, lock: Any) -> None:
    global _VLLM_LOCK
    _VLLM_LOCK = lock
    torch.set_num_threads(1)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(cmd_addr)
    push.connect(done_addr)
    worker = _Worker()
    while True:
        frames = pull.recv_multipart(copy=False)
        kind = bytes(frames[0].buffer).decode()
        if kind == "quit":
            break
        start = time.perf_counter()
        held = worker.handle(kind, frames[1:])
        elapsed = (time.perf_counter() - start) * 1e6
        del frames
        push.send(msgspec.msgpack.encode((index, elapsed, held)))
    if worker.reader is not None:
        worker.held = None
        worker.reader.close()
    ctx.destroy(linger=0)


# ---------------------------------------------------------------- vLLM's store


def vllm_available() -> bool:
    try:
        import vllm.distributed.device_communicators.shm_object_storage  # noqa: F401
    except Exception:  # any import failure means "not installed / not usable"
        return False
    return True


def _vllm_reader(size: int, name: str, max_object: int, readers: int, lock: Any) -> Any:
    from vllm.distributed.device_communicators import shm_object_storage as vs

    ring = vs.SingleWriterShmRingBuffer(size, name=name, create=False)
    return vs.SingleWriterShmObjectStorage(max_object, readers, ring, vs.MsgpackSerde,
                                           reader_lock=lock)


class VllmWriter:
    """vLLM's sender side: one ``MultiModalKwargsItem`` per image, put under its hash."""

    def __init__(self, size: int, readers: int) -> None:
        from vllm.distributed.device_communicators import shm_object_storage as vs
        from vllm.multimodal import inputs

        self.inputs = inputs
        self.config = (size, f"dcmm_{os.getpid()}_{readers}", 64 << 20, readers)
        self.ring = vs.SingleWriterShmRingBuffer(size, name=self.config[1], create=True)
        self.store = vs.SingleWriterShmObjectStorage(self.config[2], readers, self.ring,
                                                     vs.MsgpackSerde)

    def item(self, img: Image) -> Any:
        field = self.inputs.MultiModalBatchedField()
        return self.inputs.MultiModalKwargsItem(
            {k: self.inputs.MultiModalFieldElem(data=v, field=field) for k, v in img.items()})

    def put(self, keys: list[str], images: list[Image]) -> bytes:
        refs = []
        for key, img in zip(keys, images, strict=True):
            addr, mid = self.store.put(key, self.item(img))
            refs.append((key, addr, mid, self.store.get_signature(key)))
        return msgspec.msgpack.encode(refs)

    def close(self) -> None:
        self.store.close()


# ---------------------------------------------------------------- engine side


class Group:
    """``n`` worker processes, a store they read and (optionally) vLLM's store."""

    def __init__(self, n: int, capacity: int, use_vllm: bool) -> None:
        self.n = n
        self.ctx = zmq.Context()
        self.dir = tempfile.TemporaryDirectory(prefix="dcmm-")
        self.done = self.ctx.socket(zmq.PULL)
        self.done.bind(f"ipc://{self.dir.name}/done")
        spawn = mp.get_context("spawn")
        lock = spawn.Lock() if use_vllm else None
        self.socks, self.procs = [], []
        for i in range(n):
            sock = self.ctx.socket(zmq.PUSH)
            sock.bind(f"ipc://{self.dir.name}/w{i}")
            proc = spawn.Process(target=_worker_main, daemon=True,
                                 args=(i, f"ipc://{self.dir.name}/w{i}",
                                       f"ipc://{self.dir.name}/done", lock))
            proc.start()
            self.socks.append(sock)
            self.procs.append(proc)
        self.store = ShmStore(capacity, max_items=1024, populate=True)
        self.vllm = VllmWriter(capacity, n) if use_vllm else None
        self.rids = []
        for sock, proc in zip(self.socks, self.procs, strict=True):
            info = self.store.add_reader(proc.pid or 0)
            self.rids.append(info.reader_id)
            extra = [msgspec.msgpack.encode(self.vllm.config)] if self.vllm else []
            sock.send_multipart([b"attach", msgspec.msgpack.encode(info), *extra])
        self.collect()

    def send(self, kind: str, per_worker: list[list[Any]]) -> None:
        for sock, frames in zip(self.socks, per_worker, strict=True):
            sock.send_multipart([kind.encode(), *frames], copy=False)

    def collect(self) -> tuple[float, int]:
        """Wait for every worker; (slowest worker decode µs, fewest tensors held)."""
        replies = [_DONE.decode(self.done.recv()) for _ in range(self.n)]
        return max(r[1] for r in replies), min(r[2] for r in replies)

    def close(self) -> None:
        self.send("quit", [[] for _ in range(self.n)])
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        if self.vllm is not None:
            self.vllm.close()
        self.store.close()
        self.ctx.destroy(linger=0)
        self.dir.cleanup()


def _keys(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).hexdigest() for i in range(n)]


def measure(group: Group, fmt: str, images: list[Image], tag: str) -> tuple[int, float, float]:
    """One timed hop: (control bytes per worker, encode µs, worker decode µs)."""
    if fmt == "memcpy":
        into = [{k: torch.zeros_like(v) for k, v in img.items()} for img in images]
        start = time.perf_counter()
        for img, out in zip(images, into, strict=True):
            for k, v in img.items():
                out[k].copy_(v)
        return sum(v.nbytes for img in images for v in img.values()), _us(start), 0.0
    start = time.perf_counter()
    keys = _keys(tag, len(images))
    per_worker: list[list[Any]]
    if fmt.startswith("pickle"):
        pickled = pickle_frames(mm_kwargs(images, numpy=fmt == "pickle_numpy"))
        size, per_worker = frames_size(pickled), [list(pickled)] * group.n
    elif fmt == "frames":
        frames = codec.encode(features_delta(images, keys))
        size, per_worker = codec.encoded_size(frames), [frames] * group.n
    elif fmt in ("store_first", "store_hit"):
        for key, img in zip(keys, images, strict=True):
            group.store.put(key, img)  # store_hit: already there, adds a reference
        per_worker = [[encode_refs(group.store.refs_for(rid, keys))] for rid in group.rids]
        size = len(per_worker[0][0])
    else:  # vllm_shm
        assert group.vllm is not None
        per_worker = [[group.vllm.put(keys, images)]] * group.n
        size = len(per_worker[0][0])
    encode = _us(start)
    group.send(fmt, per_worker)
    worker_us, held = group.collect()
    assert held >= 2 * len(images), f"{fmt}: workers hold {held} tensors"
    return size, encode, worker_us


def _us(start: float) -> float:
    return (time.perf_counter() - start) * 1e6


def _release(group: Group, fmt: str, images: list[Image], tag: str) -> None:
    """Workers drop what they hold; store items lose their references."""
    group.send("release", [[] for _ in range(group.n)])
    group.collect()
    for key in _keys(tag, len(images)) if fmt == "store_hit" else ():
        group.store.unref(key)  # once for store_first's put, once for store_hit's
        group.store.unref(key)


def run_cases(batches: tuple[int, ...], workers: tuple[int, ...], hw: int,
              formats: tuple[str, ...], emit: Callable[[Row], None],
              max_repeats: int = 5) -> list[Row]:
    """Every (workers, batch, format) case; small batches repeat and report medians."""
    rows: list[Row] = []
    all_images = make_images(max(batches), hw)
    per_image = sum(v.nbytes for v in all_images[0].values())
    capacity = int(per_image * max(batches) * 1.1) + (1 << 20)
    for n in workers:
        with _group(n, capacity, "vllm_shm" in formats) as group:
            for batch in batches:
                repeats = max(1, min(max_repeats, 20 // batch))
                samples = _samples(group, all_images[:batch], formats, repeats)
                for fmt in formats:
                    size, encode, total, worker_us = (_median(v) for v in zip(*samples[fmt],
                                                                              strict=True))
                    row = make_row("mm_pixels", batch, n, fmt, int(size), encode, total - encode,
                                   worker_decode_us=round(worker_us, 2), image_bytes=per_image,
                                   repeats=repeats)
                    rows.append(row)
                    emit(row)
    return rows


def _samples(group: Group, images: list[Image], formats: tuple[str, ...],
             repeats: int) -> dict[str, list[tuple[float, float, float, float]]]:
    """(bytes, encode µs, total µs, worker µs) per format per repeat; frees between formats."""
    out: dict[str, list[tuple[float, float, float, float]]] = {f: [] for f in formats}
    for rep in range(repeats):
        for fmt in formats:
            tag = f"{group.n}:{len(images)}:{rep}:{'store' if fmt.startswith('store') else fmt}"
            t0 = time.perf_counter()
            size, encode, worker_us = measure(group, fmt, images, tag)
            out[fmt].append((size, encode, _us(t0), worker_us))
            if fmt not in ("memcpy", "store_first"):  # store_hit reuses store_first's items
                _release(group, fmt, images, tag)
            gc.collect()
    return out


def _median(values: tuple[float, ...]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


@contextlib.contextmanager
def _group(n: int, capacity: int, use_vllm: bool) -> Iterator[Group]:
    group = Group(n, capacity, use_vllm)
    try:
        yield group
    finally:
        group.close()


# ---------------------------------------------------------------- CLI


def _table_line(row: Row) -> str:
    return (f"{row['batch']:>4} img  {row['workers']} w  {row['format']:<13}"
            f"{row['bytes']:>14,} B  encode {row['encode_us'] / 1e3:>9.1f} ms  "
            f"total {row['total_us'] / 1e3:>9.1f} ms")


def run(args: argparse.Namespace) -> int:
    """Entry point for ``deltacast bench mm`` (options read defensively)."""
    cfg = QUICK if getattr(args, "quick", False) else FULL
    batches = tuple(getattr(args, "batches", None) or cfg["batches"])
    formats = FORMATS if vllm_available() else FORMATS[:-1]
    as_json = bool(getattr(args, "json", False))
    if "vllm_shm" not in formats:
        print("bench mm: vLLM is not importable here; skipping the vllm_shm rows",
              file=sys.stderr)

    def emit(row: Row) -> None:
        print(dumps(row) if as_json else _table_line(row), flush=True)

    run_cases(batches, tuple(cfg["workers"]), int(cfg["hw"]), formats, emit, cfg["repeats"])
    return 0
