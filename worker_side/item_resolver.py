"""The receiver's half of the multimodal store: store references → zero-copy views.

On a local channel the engine (``engine_side.item_writer``) sends a
:class:`~protocol.items.StoreRef` where a joining request's item data or prompt
embeddings would travel.  While each step can still be refused (before its state
changes), :meth:`ItemResolver.resolve` turns the references of the requests the step
adds into the structures the store holds (tensors are views of its read-only mapping:
no copy) and runs the lifetime rule of :mod:`protocol.items` on what the step named --
finished ids, added requests and their items, encoder inputs (rows keyed by schedule
position), frees; once the step has applied, :meth:`ItemResolver.commit` releases
(``ShmReader.release``) every item whose count went back to zero.  The engine runs
the same rule on the same fields, so both agree on every count at every seq.

Not covered: a receiver that resyncs from a snapshot keeps its counts (a gap may hide
finishes and frees), and a reader attached after a request was added has no handle
for its items; both should re-attach (a fresh reader and state).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from protocol.columns import I64
from protocol.errors import LocalProtocolError, MalformedMessage
from protocol.items import (
    ItemLifetimes,
    LifetimePlan,
    StoreRef,
    as_store_ref,
    item_identifier,
    rows_by_position,
)
from protocol.messages import NewRequest, Spec
from protocol.state import Applied, ReplicaState
from protocol.store_handles import UnknownItem
from worker_side.shm_reader import ShmReader


class ItemResolver:
    """Resolves each step's store references; releases items.

    Args:
        reader: this receiver's attached store reader, or None on a remote channel
            (items arrive inline; a store reference is then refused).

    Per step, in order: :meth:`resolve` before the state changes, then :meth:`commit`
    (or :meth:`abandon`).
    """

    def __init__(self, reader: ShmReader | None = None) -> None:
        self.reader = reader
        self.lifetimes = ItemLifetimes()
        self._keys: dict[str, str] = {}  # identifier -> store key held
        self._plan: LifetimePlan | None = None  # the step resolved, not yet committed:
        self._pending: dict[str, str] = {}  # its identifiers -> store keys, and
        self._taken: list[str] = []  # the keys it made the reader hold first

    @property
    def counts(self) -> dict[str, int]:
        """identifier -> reference count (live requests' stored items + encoder cache)."""
        return dict(self.lifetimes.counts)

    @property
    def held(self) -> dict[str, str]:
        """identifier -> store key, for the items this receiver holds."""
        return dict(self._keys)

    def resolve(self, state: ReplicaState, applied: Applied,
                schedule: I64) -> Sequence[NewRequest]:
        """Phase one of a step: the NewRequests it adds, in body order, each store
        reference resolved (``mm_data`` and ``embeds``; the state's are not touched),
        and its lifetime changes planned, nothing committed.

        Call it with what ``ReplicaState.apply`` gives ``before_commit`` (the state
        before the step, ``applied`` and the step's schedule), so a reference that does
        not resolve refuses the step before the state changes; then :meth:`commit`
        once the state has applied it, or :meth:`abandon` if it did not.  Raises
        ``RemoteProtocolError`` (ForgedHandle, StaleHandle, UnknownItem,
        MalformedMessage) for references that do not resolve or a step whose items do
        not fit, holding nothing it did not hold before.
        """
        self.abandon()
        body = applied.body
        assert body is not None  # noqa: S101 - an applied step's body
        rare = body.rare
        if not (applied.finished_ids or applied.added or rare.encoder_inputs is not None
                or rare.free_encoder_mm_hashes):
            return body.added
        specs = dict(zip(applied.added, applied.specs, strict=True))  # (handles reused)
        started: dict[str, tuple[str | None, ...]] = {}
        embeds: dict[str, str] = {}
        for spec, new in zip(applied.specs, body.added, strict=True):
            refs = [as_store_ref(d) for d in new.mm_data]
            started[spec.req_id] = tuple(m.identifier if r is not None else None
                                         for m, r in zip(spec.mm, refs or [None] * len(spec.mm),
                                                         strict=True))
            eref = as_store_ref(new.embeds)
            if eref is not None:
                if not eref.key:
                    raise MalformedMessage("a prompt-embeds reference without its key",
                                           req_id=spec.req_id)
                embeds[spec.req_id] = item_identifier(eref.key)
        hs = schedule.tolist()
        inputs = {(specs.get(hs[p]) or state.spec_of(hs[p])).req_id: v for p, v in
                  rows_by_position(rare.encoder_inputs, len(hs)).items()}
        try:
            self._plan = self.lifetimes.plan(applied.finished_ids, started, inputs,
                                             rare.free_encoder_mm_hashes, embeds)
        except LocalProtocolError as exc:  # the engine sent it: a remote fault here
            raise MalformedMessage("bad multimodal item stream", cause=str(exc)) from exc
        try:
            return [self._resolved(spec, new) if new.mm_data or new.embeds is not None else new
                    for spec, new in zip(applied.specs, body.added, strict=True)]
        except BaseException:
            self.abandon()
            raise

    def commit(self) -> None:
        """Phase two, once the state has applied the step :meth:`resolve` read: counts
        move on, released items are let go (cannot fail)."""
        plan, self._plan = self._plan, None
        self._taken.clear()
        if plan is None:
            return
        self.lifetimes.commit(plan)
        self._keys.update(self._pending)
        self._pending.clear()
        for ident in plan.released:
            key = self._keys.pop(ident, None)
            if key is not None and self.reader is not None:
                self.reader.release(key)

    def abandon(self) -> None:
        """The step :meth:`resolve` read was not applied after all: the reader holds
        what it held before (its items stay pinned, so the step resolves again)."""
        self._plan = None
        self._pending.clear()
        if self.reader is not None:
            for key in self._taken:
                self.reader.forget(key)
        self._taken.clear()

    def _resolved(self, spec: Spec, new: NewRequest) -> NewRequest:
        """``new`` with its references resolved (its items, if any, as many as the
        spec's: checked before)."""
        data = tuple(self._fetch(r, m.identifier) if (r := as_store_ref(d)) is not None else d
                     for m, d in zip(spec.mm, new.mm_data, strict=True)) if new.mm_data else ()
        eref = as_store_ref(new.embeds)
        return msgspec.structs.replace(new, mm_data=data, embeds=new.embeds if eref is None
                                       else self._fetch(eref, item_identifier(eref.key)))

    def _fetch(self, ref: StoreRef, ident: str) -> Any:
        reader = self.reader
        if reader is None:
            raise UnknownItem("store reference on a channel without a store", key=ident[:80])
        key = ref.store_key(ident)
        handle = ref.handles.get(reader.info.reader_id)
        held = reader.holds(key)
        obj = reader.resolve(handle if handle is not None else key)
        if not held:
            self._taken.append(key)
        self._pending[ident] = key
        return obj


__all__ = ["ItemResolver"]
