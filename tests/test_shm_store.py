"""Shared-memory object store: round trips, eviction vs pins, handles, crash cleanup."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from nested import assert_same, tensors

from engine_side.shm_store import ShmStore
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.store_handles import (
    AttachInfo,
    ForgedHandle,
    ItemHandle,
    StaleHandle,
    StoreClosed,
    StoreFull,
    UnknownItem,
    decode_refs,
    encode_refs,
    make_handle,
)
from worker_side.shm_reader import ShmReader

REPO_ROOT = Path(__file__).resolve().parent.parent


def mm_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()  # 64 chars, like vLLM's mm hashes


@pytest.fixture
def pair() -> Iterator[tuple[ShmStore, ShmReader, int]]:
    store = ShmStore(4 << 20, max_items=64)
    info = store.add_reader(os.getpid())
    reader = ShmReader.attach(info)
    yield store, reader, info.reader_id
    reader.close()
    store.close()


def through(store: ShmStore, reader: ShmReader, rid: int, key: str, obj: Any) -> Any:
    store.put(key, obj)
    (ref,) = decode_refs(encode_refs(store.refs_for(rid, [key])))
    return reader.resolve(ref)


# ---------------------------------------------------------------- round trips

ZOO: dict[str, Any] = {
    "bf16": lambda: torch.tensor([1.5, -2.0, float("inf"), float("nan")], dtype=torch.bfloat16),
    "bf16_t": lambda: torch.randn(3, 5).to(torch.bfloat16).t(),
    "scalar_0d": lambda: torch.tensor(3.25),
    "empty": lambda: torch.empty(0, 3),
    "transposed": lambda: torch.arange(20.0).reshape(4, 5).t(),
    "sliced": lambda: torch.arange(40, dtype=torch.int64)[::2],
    "c64": lambda: torch.tensor([1 + 2j, float("nan")], dtype=torch.complex64),
    "large": lambda: torch.randn(3, 256, 256),
    "np_fortran": lambda: np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "np_0d": lambda: np.array(7, np.int32),
    "np_bool": lambda: np.array([True, False, True]),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_roundtrip_nested(pair: tuple[ShmStore, ShmReader, int], name: str) -> None:
    store, reader, rid = pair
    t = ZOO[name]()
    obj = {"pixel_values": [t, {"x": [t, 1, "s"]}], "image_grid_thw": [[t]], "n": None}
    assert_same(obj, through(store, reader, rid, mm_hash(name), obj))


_DTYPES = ("bool", "uint8", "int16", "int64", "uint64", "float16", "float32", "float64",
           "complex128")  # fmt: skip


nested = st.recursive(
    tensors(_DTYPES, 5) | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=3) | st.none(),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids,
                                                                max_size=3),
    max_leaves=8,
)


@given(st.lists(nested, min_size=1, max_size=4))
def test_random_nested_roundtrip_and_eviction(items: list[Any]) -> None:
    # A small store: every example evicts earlier examples' items.
    with ShmStore(64 << 10, max_items=8) as store:
        reader = ShmReader.attach(store.add_reader(os.getpid()))
        for i, obj in enumerate(items):
            key = mm_hash(f"{i}:{obj!r}")
            assert_same(obj, through(store, reader, 0, key, obj))
            reader.release(key)
            store.unref(key)
        reader.close()


def test_reads_are_views_over_the_mapping(pair: tuple[ShmStore, ShmReader, int]) -> None:
    store, reader, rid = pair
    out = through(store, reader, rid, mm_hash("v"), {"t": torch.ones(1000), "a": np.ones(9)})
    base = np.frombuffer(reader._map, np.uint8).ctypes.data
    end = base + len(reader._map)
    assert base <= out["t"].data_ptr() < end
    assert base <= out["a"].ctypes.data < end
    assert not out["a"].flags.writeable


# ---------------------------------------------------------------- refs, hits, bytes


def test_held_items_travel_as_bare_keys(pair: tuple[ShmStore, ShmReader, int]) -> None:
    store, reader, rid = pair
    keys = [mm_hash(str(i)) for i in range(4)]
    for k in keys:
        store.put(k, {"pixel_values": torch.zeros(3, 8, 8)})
    first = store.refs_for(rid, keys)
    assert all(isinstance(r, ItemHandle) for r in first)
    reader.resolve_all(first)
    hit = store.refs_for(rid, keys)
    assert hit == keys
    assert len(encode_refs(hit)) <= 100 * len(keys)
    assert len(encode_refs(first)) <= 100 * len(keys)
    assert all(store.holds(rid, k) for k in keys)
    reader.release(keys[0])
    assert not store.holds(rid, keys[0])
    assert isinstance(store.refs_for(rid, keys[:1])[0], ItemHandle)


def test_put_existing_key_adds_a_reference_without_writing() -> None:
    with ShmStore(4096, max_items=4) as store:
        assert store.put("k", {"t": torch.zeros(256)})
        assert not store.put("k", {"t": torch.ones(256)})
        store.unref("k")
        with pytest.raises(StoreFull):  # one reference left
            store.put("other", {"t": torch.zeros(900)})
        store.unref("k")
        assert store.put("other", {"t": torch.zeros(900)}) and "k" not in store


def test_eviction_is_lru_and_spares_pinned_items(pair: tuple[ShmStore, ShmReader, int]) -> None:
    store, reader, rid = pair
    item = {"t": torch.zeros(256 << 10, dtype=torch.uint8)}  # 256 KiB: 16 fit in 4 MiB
    keys = [mm_hash(str(i)) for i in range(40)]
    pinned = keys[0]
    for k in keys:
        store.put(k, item)
        if k == pinned:
            reader.resolve_all(store.refs_for(rid, [k]))
        store.unref(k)
    assert pinned in store and store.evictions == 40 - len(store)
    assert keys[-1] in store and keys[1] not in store
    assert_same(item, reader.resolve(pinned))


def test_store_full_when_everything_is_pinned(pair: tuple[ShmStore, ShmReader, int]) -> None:
    store, reader, rid = pair
    with pytest.raises(StoreFull):
        store.put("huge", {"t": torch.zeros(5 << 20, dtype=torch.uint8)})
    for i in range(3):
        store.put(f"k{i}", {"t": torch.zeros(1 << 20, dtype=torch.uint8)})
        reader.resolve_all(store.refs_for(rid, [f"k{i}"]))
        store.unref(f"k{i}")
    k3 = {"t": torch.zeros(3 << 19, dtype=torch.uint8)}  # 1.5 MiB
    with pytest.raises(StoreFull):
        store.put("k3", k3)
    reader.release("k2")  # frees the extent next to the free tail
    store.put("k3", k3)
    assert "k2" not in store and "k0" in store and "k1" in store


# ---------------------------------------------------------------- forged / stale


def test_forged_handles_are_refused(pair: tuple[ShmStore, ShmReader, int]) -> None:
    store, reader, rid = pair
    store.put("k", {"t": torch.ones(4)})
    (h,) = store.refs_for(rid, ["k"])
    assert isinstance(h, ItemHandle)
    forged = [
        ItemHandle(h.key, h.slot, h.generation, bytes(16)),
        ItemHandle(h.key, h.slot, h.generation + 1, h.mac),
        ItemHandle(h.key, h.slot + 1, h.generation, h.mac),
        ItemHandle("other", h.slot, h.generation, h.mac),
        ItemHandle(h.key, 10**9, h.generation, h.mac),
        ItemHandle(h.key, h.slot, 0, h.mac),
    ]
    forged.append(make_handle(secrets.token_bytes(32), h.key, h.slot, h.generation))
    for f in forged:
        with pytest.raises(ForgedHandle):
            reader.resolve(f)
    assert issubclass(ForgedHandle, RemoteProtocolError)
    assert_same({"t": torch.ones(4)}, reader.resolve(h))


def test_stale_handles_are_refused(pair: tuple[ShmStore, ShmReader, int]) -> None:
    store, reader, rid = pair
    store.put("old", {"t": torch.ones(3 << 20, dtype=torch.uint8)})
    (h,) = store.refs_for(rid, ["old"])
    store.unref("old")
    reader.resolve(h)
    reader.release("old")
    store.put("new", {"t": torch.ones(3 << 20, dtype=torch.uint8)})  # evicts, reuses the slot
    assert "old" not in store
    with pytest.raises(StaleHandle):
        reader.resolve(h)
    # A genuine handle pinned for another reader is refused here too.
    other = store.add_reader(os.getpid())
    (h2,) = store.refs_for(other.reader_id, ["new"])
    with pytest.raises(StaleHandle):
        reader.resolve(h2)
    with pytest.raises(UnknownItem):
        reader.resolve("new")
    assert issubclass(StaleHandle, RemoteProtocolError)


def test_misuse_raises_local_errors(pair: tuple[ShmStore, ShmReader, int]) -> None:
    store, _, rid = pair
    with pytest.raises(LocalProtocolError):
        store.refs_for(rid, ["absent"])
    with pytest.raises(LocalProtocolError):
        store.refs_for(99, [])
    store.close()
    with pytest.raises(StoreClosed):
        store.put("k", {})


# ---------------------------------------------------------------- processes

# A reader process: attaches with the AttachInfo on its first stdin line, then
# per command line releases keys, resolves refs and re-checks every held item.
# Item i is {"t": uint8 tensor filled with i % 251, "n": i}.
_READER = """
import json, sys, msgspec
from protocol.store_handles import AttachInfo, decode_refs
from worker_side.shm_reader import ShmReader
info = msgspec.msgpack.decode(bytes.fromhex(sys.stdin.readline()), type=AttachInfo)
reader = ShmReader.attach(info)
print("ready", flush=True)
bad = checked = 0
for line in sys.stdin:
    cmd = json.loads(line)
    for key in cmd["release"]:
        reader.release(key)
    reader.resolve_all(decode_refs(bytes.fromhex(cmd["refs"])))
    for key in reader.held_keys:
        obj = reader.resolve(key)
        bad += int(not bool((obj["t"] == obj["n"] % 251).all()))
        checked += 1
    print(json.dumps({"bad": bad, "checked": checked}), flush=True)
"""


class ReaderProc:
    """A reader subprocess driven over stdin/stdout."""

    def __init__(self, store: ShmStore) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _READER], cwd=REPO_ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        info = store.add_reader(self.proc.pid)
        self.rid = info.reader_id
        self._send(msgspec.msgpack.encode(info).hex())
        assert self._recv() == "ready"

    def _send(self, line: str) -> None:
        assert self.proc.stdin
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _recv(self) -> str:
        assert self.proc.stdout
        return self.proc.stdout.readline().strip()

    def send(self, refs: bytes, release: list[str]) -> None:
        self._send(json.dumps({"refs": refs.hex(), "release": release}))

    def report(self) -> dict[str, int]:
        return dict(json.loads(self._recv()))

    def command(self, refs: bytes, release: list[str]) -> dict[str, int]:
        self.send(refs, release)
        return self.report()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def item(i: int) -> dict[str, Any]:
    return {"t": np.full(100_000 + 997 * (i % 7), i % 251, dtype=np.uint8), "n": i}


def test_concurrent_reader_processes_with_eviction() -> None:
    # Two readers hold item 0 throughout and a sliding window of 4 items, and
    # re-check them while the writer writes the next item, evicting: item 0 is
    # soon the least recently used, so eviction must skip it because it is pinned.
    with ShmStore(900_000, max_items=32) as store:
        readers = [ReaderProc(store), ReaderProc(store)]
        window = 4
        for i in range(60):
            key = mm_hash(str(i))
            store.put(key, item(i))  # concurrent with the readers' round i - 1
            store.unref(key)
            if i:
                assert all(r.report()["bad"] == 0 for r in readers)
            old = [mm_hash(str(i - window))] if i > window else []
            for r in readers:
                r.send(encode_refs(store.refs_for(r.rid, [key])), old)
        assert all(r.report()["bad"] == 0 for r in readers)
        assert store.evictions > 50
        assert all(r.command(encode_refs([]), [])["checked"] > 200 for r in readers)
        for r in readers:
            r.stop()


def memfd_holders(ino: int) -> list[str]:
    """Processes that still have a descriptor or a mapping of inode ``ino``."""
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if "memfd:" in os.readlink(f"/proc/{pid}/fd/{fd}") and os.stat(
                    f"/proc/{pid}/fd/{fd}"
                ).st_ino == ino:
                    holders.append(f"{pid}:fd{fd}")
            with open(f"/proc/{pid}/maps") as maps:
                holders += [f"{pid}:map" for line in maps
                            if "memfd:" in line and line.split()[4] == str(ino)]
        except OSError:
            continue
    return holders


def test_killed_reader_is_reaped_and_nothing_leaks() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    store = ShmStore(1_550_000, max_items=8)
    ino = os.fstat(store._fd).st_ino
    reader = ReaderProc(store)
    store.put("a", item(1))
    store.unref("a")
    assert reader.command(encode_refs(store.refs_for(reader.rid, ["a"])), [])["bad"] == 0
    big = {"t": np.zeros(1_500_000, dtype=np.uint8), "n": 0}
    with pytest.raises(StoreFull):  # "a" is pinned by a live reader
        store.put("b", big)
    reader.kill()
    assert store.put("b", big) and "a" not in store  # the dead reader was reaped
    assert store.readers == []
    holders = memfd_holders(ino)
    assert holders and {h.split(":")[0] for h in holders} == {str(os.getpid())}
    store.close()
    assert memfd_holders(ino) == []
    assert set(os.listdir("/dev/shm")) == shm_before


_WRITER = """
import os, sys, torch, msgspec
from engine_side.shm_store import ShmStore
from protocol.store_handles import encode_refs
store = ShmStore(1 << 20, max_items=8)
info = store.add_reader(int(sys.argv[1]))
store.put("k", {"t": torch.full((1000,), 7, dtype=torch.uint8), "n": 7})
refs = encode_refs(store.refs_for(info.reader_id, ["k"]))
print(msgspec.msgpack.encode(info).hex(), refs.hex(), os.fstat(store._fd).st_ino, flush=True)
sys.stdin.read()
"""


def test_killed_writer_leaves_nothing_behind() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(os.getpid())], cwd=REPO_ROOT,
                              text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert writer.stdout
    info_hex, refs_hex, ino = writer.stdout.readline().split()
    reader = ShmReader.attach(msgspec.msgpack.decode(bytes.fromhex(info_hex), type=AttachInfo))
    (obj,) = reader.resolve_all(decode_refs(bytes.fromhex(refs_hex)))
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert bool((obj["t"] == 7).all())  # still mapped here after the writer died
    del obj
    reader.close()
    assert memfd_holders(int(ino)) == []
    assert set(os.listdir("/dev/shm")) == shm_before
