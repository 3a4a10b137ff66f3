"""The fuzz campaign's seed corpus: real frames of every message kind, and the states
they apply to (:mod:`engine_side.bench.fuzz`).

* **core**: two core step streams (a seeded :class:`~engine_side.workloads.Workload`
  through :class:`~engine_side.request_diff.RequestDiffer`, engine-sent and
  worker-owned tokens, arrivals, finishes, chunked prefill, drafts), their
  snapshots, heartbeats, hellos, goodbyes, check-ins, snapshot requests and the golden
  fixtures of ``tests/golden/*.hex``; each Delta with the replica state it applies to
  (:class:`CoreChain`);
* **replies**: one :class:`~protocol.replies.StepResult` and each other reply kind;
* **store**: store refs and one packed item of the shared-memory store;
* **recording**: a recording file of core frames and replies;
* **seal**: sealed control-call blobs;
* **calls**: the executor channel's messages (SPEC §16): hellos, check-ins, call
  heads and numbers, ``K`` answers, relayed messages (plain and deflated), ring records,
  ready times and identities, each with the parser that reads it (:func:`read_call`);
* **vllm**: the golden vLLM object streams (``tests/golden/streams/*.dcobj``) and a short
  one with multimodal items (:func:`mm_objects`), inline and through a shared-memory
  store, encoded by :class:`~engine_side.vllm.encoder.SchedulerOutputEncoder`: step,
  grammar and reply frames, each step with its decoder's state (:class:`VllmChain`).
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protocol import codec
from protocol.messages import CheckIn, Delta, Goodbye, Heartbeat, Hello, SnapshotRequest
from protocol.replies import StepResult, encode_reply, pack_tokens
from protocol.snapshot import build_snapshot, load_snapshot
from protocol.state import ReplicaState

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
SECRET = b"f" * 32
Frames = list[bytes]


def fingerprint(state: ReplicaState) -> str:
    """A hash of everything a ReplicaState holds (digest and sums, schedule, columns,
    requests and specs by identity, block tables and token histories)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((state.digest, state.sched_term, state.advance)).encode())
    for arr in (state.schedule, state.nsched):
        h.update(np.ascontiguousarray(arr).tobytes())
    cols = state.cols
    for name in (*type(cols)._FLAT, "block_len", "block_sum"):  # type: ignore[attr-defined]
        h.update(np.ascontiguousarray(getattr(cols, name)).tobytes())
    h.update(repr([id(r) for r in state.requests]).encode())
    h.update(repr([id(s) for s in state.specs]).encode())
    for table in [*(state.tables or []), *([state.tokens] if state.tokens is not None else [])]:
        h.update(np.ascontiguousarray(table.table).tobytes())
        h.update(np.ascontiguousarray(table.lengths).tobytes())
    return h.hexdigest()


@dataclass
class CoreChain:
    """A core stream: each step's frames and a live replica state before it."""

    name: str
    frames: list[Frames]
    deltas: list[Delta]
    snaps: list[Any]  # the Snapshot of the state before each step
    states: list[ReplicaState] = field(default_factory=list)

    def state(self, k: int) -> ReplicaState:
        return self.states[k]

    def restore(self, k: int) -> None:
        """Step ``k``'s state afresh (a mutated step applied: it changed)."""
        self.states[k] = load_snapshot(self.snaps[k])


def core_chain(name: str, scenario: str, batch: int, steps: int, seed: int) -> CoreChain:
    from engine_side.mirror import EngineMirror
    from engine_side.request_diff import RequestDiffer
    from engine_side.workloads import Workload

    workload = Workload(scenario, batch, seed=seed, prompt_tokens=(8, 64),
                        history_tokens=(0, 8), headroom=16)
    mirror = EngineMirror(epoch=7, token_mode=workload.token_mode)
    differ = RequestDiffer(mirror)
    replica = ReplicaState(token_mode=workload.token_mode)
    chain = CoreChain(name, [], [], [])
    requests = [*workload.warmup(), *(workload.step() for _ in range(steps))]
    for request in requests:
        delta = differ.diff(request)
        chain.snaps.append(build_snapshot(replica, 7, delta.seq - 1))
        chain.frames.append([bytes(f) for f in codec.encode(delta)])
        chain.deltas.append(delta)
        replica.apply(delta.body, expected_digest=delta.digest)
    chain.states = [load_snapshot(s) for s in chain.snaps]
    return chain


def core_chains() -> list[CoreChain]:
    return [core_chain("engine-tokens", "decode_tokens_blocks", 12, 40, 1),
            core_chain("mixed", "mixed_chat", 10, 60, 2),
            core_chain("drafts", "spec_decode", 6, 30, 3)]


def core_seeds(chains: list[CoreChain]) -> list[Frames]:
    """Every core message kind: steps, snapshots, the small ones, the golden fixtures."""
    out: list[Frames] = []
    for chain in chains:
        out += chain.frames[:: max(1, len(chain.frames) // 12)]
        snap = chain.snaps[len(chain.snaps) // 2]
        out.append([bytes(f) for f in codec.encode(snap)])
    for msg in (Heartbeat(7, 3, digest=12345), Hello(7, 0, role="engine"),
                Hello(7, 0, role="worker", rank=2, config="c", version="1"),
                Goodbye(7, 9, reason="done"),
                CheckIn(7, 3, rank=1, state="synced", token_hash=99, token_hash_seq=2, pid=5),
                SnapshotRequest(7, -1, rank=1)):
        out.append([bytes(f) for f in codec.encode(msg)])
    for path in sorted(GOLDEN.glob("*.hex")):
        out.append([bytes.fromhex(line) for line in path.read_text().split()])
    return out


def reply_seeds() -> list[Frames]:
    msgs = [StepResult(7, 3, rank=1, rows=pack_tokens([0, 2, 5]),
                       tokens=pack_tokens([17, 4, 511]), rejoined=True),
            StepResult(7, 4, rank=0, rows=pack_tokens(list(range(40))),
                       tokens=pack_tokens(list(range(40)))),
            CheckIn(7, 3, rank=1, state="synced", token_hash=99, token_hash_seq=2, pid=5),
            SnapshotRequest(7, -1, rank=1), Hello(7, 0, role="worker", rank=1),
            Goodbye(7, 9, reason="rank 1 exiting")]
    return [[encode_reply(m)] for m in msgs]  # type: ignore[arg-type]


def store_seeds() -> tuple[list[Frames], list[tuple[Frames, int]]]:
    from protocol.store_handles import PackedItem, encode_refs, make_handle

    refs = [[encode_refs([make_handle(SECRET, "img-1", 3, 9), "img-2"])],
            [encode_refs([make_handle(SECRET, f"k{i}", i, i + 1) for i in range(5)])]]
    items = []
    for obj in ({"pixels": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
                 "meta": ["a", 1, {"b": 2.5}]}, [np.zeros((3, 0), np.int16), "x", None]):
        packed = PackedItem(obj)
        dest = bytearray(packed.length)
        packed.write_into(memoryview(dest))
        items.append(([bytes(dest)], len(packed.layout)))
    return refs, items


def recording_seed(core: list[Frames], replies: list[Frames]) -> Frames:
    from protocol.recording import RecordWriter

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.rec"
        with RecordWriter(path, meta={"model": "toy"}) as writer:
            for frames in core[:6]:
                writer.write("execute_model", frames)
            writer.write("reply", replies[0])
        return [path.read_bytes()]


def read_call(kind: str, frames: Frames) -> Any:
    """``frames`` read as the executor channel reads a message of ``kind``."""
    from protocol import calls
    from protocol.ring import unpack_frames

    first = frames[0] if frames else b""
    if kind == "hello":
        return calls.parse_hello(first)
    if kind == "check_in":
        return calls.parse_check_in(first)
    if kind == "call":
        return calls.parse_call(frames)
    if kind == "number":
        return calls.parse_number(first)
    if kind == "done":
        return calls.done_count(frames)
    if kind == "relayed":
        return [bytes(f) for f in calls.unpack_relayed(first)]
    if kind == "ring":
        return [bytes(f) for f in unpack_frames(first)]
    if kind == "ready":
        return calls.ready_seconds(frames)
    return calls.rank_of(first, 8), calls.relay_node(first)


def call_seeds() -> list[tuple[str, Frames]]:
    from protocol import calls
    from protocol.ring import pack_frames

    step = [b"\x01" * 40, bytes(range(200))]
    big = [bytes(range(256)) * 24]  # 6 KiB: relayed deflated
    return [
        ("hello", [calls.pack_hello(node="1", vllm="0.32.0", protocol="3", config="ab" * 32)]),
        ("check_in", [calls.pack_check_in(12, 0xFEEDFACE)]),
        ("call", [calls.call_head(calls.EXECUTE, 7, step), *step]),
        ("call", [calls.call_head(calls.QUIT, 9, [])]),
        ("number", [calls.NUMBER.pack(41)]),
        ("done", calls.done_answer(1)), ("done", calls.done_answer(5)),
        ("relayed", [calls.pack_relayed([b"1", calls.OUTPUT, *step])]),
        ("relayed", [calls.pack_relayed([calls.RELAY_ALL, *big])]),
        ("ring", [b"".join(bytes(p) for p in pack_frames([calls.DONE, *step]))]),
        ("ready", [b"2.5"]), ("identity", [b"3"]), ("identity", [b"node1/0"]),
    ]


def seal_seeds() -> list[Frames]:
    from protocol.seal import Sealer

    sealer = Sealer(SECRET, b"call")
    return [[sealer.seal({"method": "execute_model", "args": (1, "x")})],
            [sealer.seal({})]]


# ---------------------------------------------------------------- vLLM streams
@dataclass
class VllmChain:
    """A vLLM stream through its adapter: per record its kind, its vLLM object and the
    frames it encodes to; :meth:`replay` makes the (decoder, encoder) pair as it was
    just before record ``k``."""

    name: str
    objects: list[tuple[str, Any]]
    records: list[tuple[str, Frames]]
    kv_groups: int | None
    store: bool = False  # items by reference through a store of the pair's own

    def replay(self, k: int) -> tuple[Any, Any]:
        dec, enc = fresh_pair(self.kv_groups, self.store)
        for kind, obj in self.objects[:k]:
            step(dec, enc, kind, copy.deepcopy(obj))
        return dec, enc


def step(dec: Any, enc: Any, kind: str, obj: Any) -> Frames:
    """One record of a stream: its object encoded by the side that sends it and fed to
    the side that receives it; returns the frames."""
    if kind == "execute_model":
        frames = [bytes(f) for f in enc.encode(obj)]
    elif kind == "sample_tokens":
        frames = [bytes(f) for f in enc.encode_grammar(obj)]
    else:
        frames = [bytes(f) for f in dec.encode_reply(obj)]
    feed(dec, enc, kind, frames)
    return frames


def fresh_pair(kv_groups: int | None, store: bool = False) -> tuple[Any, Any]:
    """A (decoder, encoder) pair; with ``store`` joined by a small store of their own
    (closed when the pair is collected)."""
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    dec = SchedulerOutputDecoder(secret=SECRET)
    if not store:
        return dec, SchedulerOutputEncoder(kv_groups, secret=SECRET)
    from engine_side.shm_store import ShmStore
    from worker_side.shm_reader import ShmReader

    shm = ShmStore(1 << 20, max_items=64)
    reader = ShmReader.attach(shm.add_reader(os.getpid()))
    dec.attach_store(reader)
    enc = SchedulerOutputEncoder(kv_groups, secret=SECRET, store=shm)
    weakref.finalize(enc, shm.close)
    weakref.finalize(dec, reader.close)
    return dec, enc


def feed(dec: Any, enc: Any, kind: str, frames: Frames) -> Any:
    """One record's frames through the side that receives them."""
    if kind == "execute_model":
        return dec.decode(frames)
    if kind == "sample_tokens":
        return dec.decode_grammar(frames)
    return enc.decode_reply(frames)


def mm_objects() -> list[tuple[str, Any]]:
    """A short vLLM stream whose new requests carry multimodal items (batched and flat
    fields, a tuple, a placeholder mask) and prompt embeds, some leaving the encoder
    cache."""
    import torch
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalFlatField,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    def item(k: int) -> Any:
        patches: Any = [(torch.arange(2), torch.arange(4)), [torch.ones(2)]]
        return MultiModalKwargsItem({
            "pixel_values": MultiModalFieldElem(torch.full((3, 4, 4), float(k)),
                                                MultiModalBatchedField()),
            "patches": MultiModalFieldElem(patches,
                                           MultiModalFlatField(slices=[slice(0, 2), slice(2, 6)],
                                                               dim=0))})

    def new(rid: str, k: int) -> Any:
        mask = torch.tensor([True, False, True]) if k % 2 else None
        features = [MultiModalFeatureSpec(item(k), "image", f"{rid}-i", PlaceholderRange(
            1, 3, mask), f"{rid}-i")]
        return NewRequestData(rid, [1, 2, 3, 4, 5], features, SamplingParams(), None, ([k],),
                              0, None, prompt_embeds=torch.ones(5, 2) * k if k % 2 else None)

    def step(news: list[Any], running: list[str], finished: set[str],
             freed: tuple[str, ...] = ()) -> Any:
        cached = CachedRequestData(list(running), set(), [], {}, [None] * len(running),
                                   [5] * len(running), [1] * len(running))
        sched = {**{nr.req_id: 5 for nr in news}, **dict.fromkeys(running, 1)}
        return SchedulerOutput(
            scheduled_new_reqs=news, scheduled_cached_reqs=cached, num_scheduled_tokens=sched,
            total_num_scheduled_tokens=sum(sched.values()), scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={nr.req_id: [0] for nr in news},
            num_common_prefix_blocks=[], finished_req_ids=finished,
            free_encoder_mm_hashes=list(freed))

    return [("execute_model", step([new("a", 1)], [], set())),
            ("execute_model", step([new("b", 2)], ["a"], set())),
            ("execute_model", step([], ["a", "b"], set())),
            ("execute_model", step([new("c", 3)], ["b"], {"a"}, ("a-i",)))]


def vllm_chains(names: tuple[str, ...] | None = None, max_records: int = 120
                ) -> list[VllmChain]:
    """The golden streams encoded (needs vLLM; the synthetic streams need tests/ on the
    path for their opaque connector metadata class)."""
    from engine_side.bench.objstream import read_stream

    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    chains = []
    for path in sorted((GOLDEN / "streams").glob("*.dcobj")):
        if names is not None and path.stem not in names:
            continue
        meta, objects = read_stream(path, allow=("vllm_streams.",))
        objects = objects[:max_records]
        dec, enc = fresh_pair(meta.get("kv_groups"))
        records = [(kind, step(dec, enc, kind, copy.deepcopy(obj))) for kind, obj in objects]
        chains.append(VllmChain(path.stem, objects, records, meta.get("kv_groups")))
    for name, store in (("mm", False), ("mm-store", True)):
        if names is None or name in names:
            objects = mm_objects()
            dec, enc = fresh_pair(1, store)
            records = [(kind, step(dec, enc, kind, copy.deepcopy(obj))) for kind, obj in objects]
            chains.append(VllmChain(name, objects, records, 1, store))
    return chains
