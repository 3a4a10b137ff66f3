"""Item lifetimes at both ends agree with a simple model over random steps.

Hypothesis draws step sequences for the core API -- requests joining with features
(some with no data: the receivers' own cache has them) and prompt embeddings from
small pools, finishes, an id finished and re-added in one step, a live id re-sent,
encoder inputs, frees (some of names never cached) -- and runs them through
``StoreMirror`` (its ``ItemWriter``) → codec → ``ReplicaState`` → ``ItemResolver``
on a prompt reader and on a lagging one.  After every step the engine's and the
prompt reader's counts equal the model's: per identifier, the stored items of live
requests (what the Delta carried as a StoreRef) plus one while it is in the encoder
cache; the reader holds exactly the counted items, and the store holds an engine
reference exactly for them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from nested import assert_same

from engine_side.item_writer import StoreMirror, content_key
from engine_side.mirror import Entry
from engine_side.mirror import rows as make_rows
from engine_side.shm_store import ShmStore
from protocol import codec
from protocol.items import COPY_SEPARATOR, as_store_ref
from protocol.messages import Delta, MMItem, NewRequest, Spec
from protocol.packing import pack_uints
from protocol.state import ReplicaState
from worker_side.item_resolver import ItemResolver
from worker_side.shm_reader import ShmReader

IDENTS = 5
PROMPT = pack_uints(list(range(16)))
EMBEDS = 3


def item(k: int) -> dict[str, Any]:
    return {"pixel_values": np.full((3, 4), float(k), np.float32), "grid": [k, "x"]}


def embeds(k: int) -> Any:
    return np.full((6, 2), float(k), np.float16)


class Model:
    """Who needs which identifier: stored items of live requests, the encoder cache."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[list[str | None], str | None]] = {}  # rid -> stored ids
        self.features: dict[str, list[str]] = {}  # rid -> feature identifiers
        self.cached: set[str] = set()

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for feats, emb in self.live.values():
            for ident in [*feats, emb]:
                if ident is not None:
                    out[ident] = out.get(ident, 0) + 1
        for ident in self.cached:
            out[ident] = out.get(ident, 0) + 1
        return out


@st.composite
def steps(draw: Any) -> list[dict[str, Any]]:
    """Step plans: finished, re-added, joining (rid, idents with data flags, embeds),
    encoder inputs drawn later against what was stored, frees."""
    live: dict[str, int] = {}  # rid -> feature count
    out = []
    for n in range(draw(st.integers(1, 12))):
        finished = [r for r in live if draw(st.integers(0, 3)) == 0]
        readd = [r for r in finished if draw(st.booleans())]
        resend = [r for r in live if r not in finished and draw(st.integers(0, 9)) == 0]
        for r in finished:
            del live[r]
        joining = []
        for rid in readd + resend + [f"r{n}-{i}" for i in range(draw(st.integers(0, 3)))]:
            feats = draw(st.lists(st.tuples(st.integers(0, IDENTS - 1),
                                            st.integers(0, 7).map(bool)), max_size=3))
            emb = draw(st.none() | st.integers(0, EMBEDS - 1))
            joining.append((rid, feats, emb))
            live[rid] = len(feats)
        encode = {r: draw(st.lists(st.integers(0, c - 1), max_size=2, unique=True))
                  for r, c in live.items() if c and draw(st.booleans())}
        frees = draw(st.lists(st.integers(0, IDENTS + 1), max_size=3, unique=True))
        out.append({"finished": finished + ([f"ghost{n}"] if n % 5 == 4 else []),
                    "joining": joining, "encode": encode,
                    "free": [f"img{k}" for k in frees], "drain": draw(st.booleans())})
    return out


class Reader:
    """A receiver: its state, resolver and reader."""

    def __init__(self, store: ShmStore) -> None:
        self.reader = ShmReader.attach(store.add_reader(os.getpid()))
        self.state = ReplicaState(keep_tables=False)
        self.items = ItemResolver(self.reader)

    def apply(self, frames: list[Any], sent: dict[str, Entry]) -> None:
        msg = codec.decode(frames, copy=True)
        assert isinstance(msg, Delta)
        news: list[Sequence[NewRequest]] = []  # resolved while the step can be refused
        applied = self.state.apply(
            msg.body, expected_digest=msg.digest, before_commit=lambda a, schedule:
            news.append(self.items.resolve(self.state, a, schedule)))
        self.items.commit()
        for h, new in zip(applied.added, news[0], strict=True):
            spec = self.state.spec_of(h)
            entry = sent[spec.req_id]
            assert new is not None
            assert_same(tuple(new.mm_data), tuple(entry.mm_data))
            assert_same(new.embeds, entry.embeds)


def _run(plan: list[dict[str, Any]]) -> None:
    store = ShmStore(1 << 20, max_items=64)
    mirror = StoreMirror(store, keep_tables=False)
    prompt, late = Reader(store), Reader(store)
    queue: list[tuple[list[Any], dict[str, Entry]]] = []
    model = Model()
    batch: list[str] = []
    try:
        for step in plan:
            entries, sent = [], {}
            for rid, feats, emb in step["joining"]:
                idents = [f"img{k}" for k, _ in feats]
                spec = Spec(req_id=rid, prompt=PROMPT, mm=tuple(MMItem("image", i, 4 * j, 4, i)
                                                  for j, i in enumerate(idents)),
                            embeds=None if emb is None else ("float16", (6, 2)))
                data = tuple(item(k) if has else None for k, has in feats)
                entry = Entry(spec, mm_data=data if any(has for _, has in feats) else (),
                              embeds=None if emb is None else embeds(emb))
                entries.append(entry)
                sent[rid] = entry
            gone = set(step["finished"])
            batch = [r for r in batch if r not in gone] + [e.spec.req_id for e in entries
                                                           if e.spec.req_id not in batch
                                                           or e.spec.req_id in gone]
            pos = {r: p for p, r in enumerate(batch)}
            encode = step["encode"]
            rows = None
            if encode:
                keys = sorted(encode, key=pos.__getitem__)
                rows = make_rows([pos[r] for r in keys], [len(encode[r]) for r in keys],
                            [j for r in keys for j in encode[r]])
            delta, _ = mirror.step(batch, [1] * len(batch), finished=step["finished"],
                                   added=entries, encoder_inputs=rows,
                                   free_encoder_mm_hashes=tuple(step["free"]))
            frames = codec.encode(delta)
            # the model: finishes, adds (what the wire stored), frees, then inputs
            for rid in step["finished"]:
                model.live.pop(rid, None)
            for a, entry in zip(delta.body.added, entries, strict=True):
                spec = entry.spec
                stored = [m.identifier if as_store_ref(d) is not None else None
                          for m, d in zip(spec.mm, a.mm_data or (None,) * len(spec.mm),
                                          strict=True)]
                eref = as_store_ref(a.embeds)
                emb = None if eref is None else eref.key.partition(COPY_SEPARATOR)[0]
                assert emb is None or emb == content_key(entry.embeds)
                model.live[spec.req_id] = (stored, emb)
            model.cached.difference_update(step["free"])
            for rid, js in encode.items():
                for j in js:
                    ident = model.live[rid][0][j]
                    if ident is not None:
                        model.cached.add(ident)
            prompt.apply(frames, sent)
            queue.append((frames, sent))
            if step["drain"]:
                for f, s in queue:
                    late.apply(f, s)
                queue.clear()
            counts = model.counts()
            assert mirror.items.counts == counts == prompt.items.counts
            held = {mirror.items.key_of(i) for i in counts}
            assert set(prompt.reader.held_keys) == held == set(prompt.items.held.values())
            for key in list(store._entries):  # test-only peek at the engine references
                assert store._entries[key].refs == (key in held)
        for f, s in queue:
            late.apply(f, s)
        assert late.items.counts == mirror.items.counts
        assert set(late.reader.held_keys) == {mirror.items.key_of(i) for i in model.counts()}
    finally:
        prompt.reader.close()
        late.reader.close()
        store.close()


@settings(max_examples=60, deadline=None)
@given(plan=steps())
def test_both_ends_count_like_the_model(plan: list[dict[str, Any]]) -> None:
    _run(plan)
