"""The receiver's half of the multimodal store: store references → zero-copy views.

On a local channel the engine (``engine_side.item_writer``) sends a
:class:`~protocol.items.StoreRef` where a joining request's item data or prompt
embeddings would travel.  After each applied step, :meth:`ItemResolver.resolve`
turns the references of the requests the step added into the structures the store
holds (tensors are views of its read-only mapping: no copy) and runs the lifetime
rule of :mod:`protocol.items` on what the step named -- finished ids, added requests
and their items, encoder inputs (rows keyed by schedule position), frees -- releasing
(``ShmReader.release``) every item whose count went back to zero.  The engine runs
the same rule on the same fields, so both agree on every count at every seq.

Not covered: a receiver that resyncs from a snapshot keeps its counts (a gap may hide
finishes and frees), and a reader attached after a request was added has no handle
for its items; both should re-attach (a fresh reader and state).
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.errors import LocalProtocolError, MalformedMessage
from protocol.items import ItemLifetimes, StoreRef, as_store_ref, item_identifier, rows_by_position
from protocol.messages import DeltaBody, NewRequest
from protocol.state import Applied, ReplicaState
from protocol.store_handles import UnknownItem
from worker_side.shm_reader import ShmReader


class ItemResolver:
    """Resolves each applied step's store references; releases items.

    Args:
        reader: this receiver's attached store reader, or None on a remote channel
            (items arrive inline; a store reference is then refused).

    Call :meth:`resolve` once per applied step, in order.
    """

    def __init__(self, reader: ShmReader | None = None) -> None:
        self.reader = reader
        self.lifetimes = ItemLifetimes()
        self._keys: dict[str, str] = {}  # identifier -> store key held

    @property
    def counts(self) -> dict[str, int]:
        """identifier -> reference count (live requests' stored items + encoder cache)."""
        return dict(self.lifetimes.counts)

    @property
    def held(self) -> dict[str, str]:
        """identifier -> store key, for the items this receiver holds."""
        return dict(self._keys)

    def resolve(self, state: ReplicaState, applied: Applied,
                body: DeltaBody) -> dict[int, NewRequest]:
        """Per handle the step added with a store reference, its NewRequest with every
        reference resolved (``mm_data`` and ``embeds``; the state's is not touched).

        ``state`` is the state after ``body`` applied and ``applied`` what it did.
        Raises ``RemoteProtocolError`` (ForgedHandle, StaleHandle, UnknownItem,
        MalformedMessage) for references that do not resolve or a step whose items do
        not fit; the receiver's items are then unreliable: re-attach.
        """
        rare = body.rare
        if not (applied.finished_ids or applied.added or rare.encoder_inputs is not None
                or rare.free_encoder_mm_hashes):
            return {}
        started: dict[str, tuple[str | None, ...]] = {}
        embeds: dict[str, str] = {}
        todo: list[tuple[int, NewRequest, list[StoreRef | None], StoreRef | None]] = []
        for h in applied.added:
            spec, new = state.specs[h], state.requests[h]
            assert spec is not None and new is not None  # noqa: S101 - added this step
            refs: list[StoreRef | None] = [as_store_ref(d) for d in new.mm_data] \
                if new.mm_data else [None] * len(spec.mm)
            eref = as_store_ref(new.embeds)
            started[spec.req_id] = tuple(m.identifier if r is not None else None
                                         for m, r in zip(spec.mm, refs, strict=True))
            if eref is not None:
                if not eref.key:
                    raise MalformedMessage("a prompt-embeds reference without its key",
                                           req_id=spec.req_id)
                embeds[spec.req_id] = item_identifier(eref.key)
            if eref is not None or any(r is not None for r in refs):
                todo.append((h, new, refs, eref))
        sched = state.schedule
        inputs = {state.spec_of(int(sched[p])).req_id: v for p, v in
                  rows_by_position(rare.encoder_inputs, sched.size).items()}
        try:
            plan = self.lifetimes.plan(applied.finished_ids, started, inputs,
                                       rare.free_encoder_mm_hashes, embeds)
        except LocalProtocolError as exc:  # the engine sent it: a remote fault here
            raise MalformedMessage("bad multimodal item stream", cause=str(exc)) from exc
        keys: dict[str, str] = {}
        out = {}
        for h, new, refs, eref in todo:
            spec = state.spec_of(h)
            data = tuple(d if r is None else self._fetch(r, m.identifier, keys)
                         for m, d, r in zip(spec.mm, new.mm_data or refs, refs, strict=True))
            emb = new.embeds if eref is None else \
                self._fetch(eref, item_identifier(eref.key), keys)
            out[h] = msgspec.structs.replace(new, mm_data=data if new.mm_data else (),
                                             embeds=emb)
        self.lifetimes.commit(plan)
        self._keys.update(keys)
        for ident in plan.released:
            key = self._keys.pop(ident, None)
            if key is not None and self.reader is not None:
                self.reader.release(key)
        return out

    def _fetch(self, ref: StoreRef, ident: str, keys: dict[str, str]) -> Any:
        if self.reader is None:
            raise UnknownItem("store reference on a channel without a store", key=ident[:80])
        key = ref.store_key(ident)
        handle = ref.handles.get(self.reader.info.reader_id)
        obj = self.reader.resolve(handle if handle is not None else key)
        keys[ident] = key
        return obj


__all__ = ["ItemResolver"]
