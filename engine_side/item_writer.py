"""The engine's half of the multimodal store: write items once, send references, free them.

:class:`ItemWriter` serves one local channel (every receiver on it attached to the
host's :class:`ShmStore`).  Each step, before the mirror writes the Delta,
:meth:`ItemWriter.place` takes the entries of the requests joining and the step's
finishes, encoder inputs and frees, and:

* writes each feature's item (``Entry.mm_data[i]``) into the store under its
  identifier unless the identifier is already held, and each request's prompt
  embeddings under their :func:`content_key`, then rewrites that slot to a
  :class:`~protocol.items.StoreRef` -- with a handle for each reader that does not
  hold the item yet, for a hit nothing but the tag;
* plans the step's lifetimes (:class:`~protocol.items.ItemLifetimes`, rule there).

Two-phase: :meth:`ItemWriter.commit` (the mirror took the step) applies the plan and
drops the store reference of every released item; :meth:`ItemWriter.abort` (it did
not) drops the references this step added, so the counts and the store's references
are as before.  Handles issued for an aborted step stay pinned for their readers
(the store has no unpin for a writer), which never got them: those copies stay
unevictable until the readers detach, and the next acquire of such an identifier
sees the pin and writes a fresh copy (as for a lagging reader), so nothing resolves
wrong; a failed step ends the epoch anyway.

An item whose data is None (the receivers' own cache has it), or that does not fit
(:class:`StoreFull`), stays inline and is not counted.

:class:`StoreMirror` is an :class:`EngineMirror` whose steps do all of that (the
reference engine's local channel; the vLLM adapter calls the writer itself).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine_side.mirror import EngineMirror, Entry
from engine_side.shm_store import ShmStore
from protocol.errors import LocalProtocolError, MalformedMessage
from protocol.items import (
    COPY_SEPARATOR,
    ItemLifetimes,
    LifetimePlan,
    StoreRef,
    item_identifier,
    rows_by_position,
)
from protocol.messages import Delta, Rows
from protocol.state import Applied
from protocol.store_handles import ItemHandle, StoreFull

EMBEDS_PREFIX = "pe:"  # content keys of prompt embeddings


def content_key(tensor: Any) -> str:
    """A key naming a tensor's dtype, shape and bytes (BLAKE2b-128 over them)."""
    from protocol.tensors import make_enc_hook

    aux: list[Any] = []
    header = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux)).encode(tensor)
    h = hashlib.blake2b(header, digest_size=16)
    for frame in aux:
        h.update(frame)
    return EMBEDS_PREFIX + h.hexdigest()


@dataclass
class ItemStats:
    """Counters since creation (per item occurrence in a joining request)."""

    written: int = 0  # items copied into the store
    hits: int = 0  # items already in the store (nothing copied)
    inline: int = 0  # items left inline (no room)
    fresh_copies: int = 0  # re-acquired while a reader still pinned the released copy


@dataclass
class _Step:
    """What one ``place`` did to the store, and what ``commit`` will apply."""

    plan: LifetimePlan = field(default_factory=LifetimePlan)
    puts: list[str] = field(default_factory=list)  # store keys given one reference
    keys: dict[str, str] = field(default_factory=dict)  # identifier -> key, acquired now


class ItemWriter:
    """One local channel's items in ``store`` (see the module docstring)."""

    def __init__(self, store: ShmStore) -> None:
        self.store = store
        self.lifetimes = ItemLifetimes()
        self.stats = ItemStats()
        self._keys: dict[str, str] = {}  # identifier -> store key, only for fresh copies
        self._copies = itertools.count(1)
        self._pending: _Step | None = None

    @property
    def counts(self) -> dict[str, int]:
        """identifier -> reference count (live requests' stored items + encoder cache)."""
        return dict(self.lifetimes.counts)

    def key_of(self, identifier: str) -> str:
        """The store key holding ``identifier``'s item (now or when last held)."""
        return self._keys.get(identifier, identifier)

    # ------------------------------------------------------------ phase one

    def place(self, entries: Sequence[Entry], ended: Iterable[str] = (),
              encoder_inputs: Mapping[str, Iterable[int]] | None = None,
              freed: Iterable[str] = ()) -> list[Entry]:
        """``entries`` with their items in the store and StoreRefs in their slots.

        ``ended``: ids finished this step; ``encoder_inputs``: per request id, the
        feature indices whose encoder inputs are scheduled; ``freed``: identifiers the
        step frees from the encoder cache.  Then :meth:`commit` or :meth:`abort`
        (placing again first aborts a step left pending).  Raises LocalProtocolError
        (nothing changed) for an encoder input outside its request's features or an
        entry whose item data does not match its spec.
        """
        self.abort()
        ended, freed = tuple(ended), tuple(freed)
        if not entries and not ended and not encoder_inputs and not freed:
            return []  # a steady step
        step = _Step()
        try:
            out = [self._entry(e, step) for e in entries]
            started: dict[str, tuple[str | None, ...]] = {}
            embeds: dict[str, str] = {}
            for e in out:
                rid = e.spec.req_id
                started[rid] = tuple(m.identifier if type(d) is StoreRef else None
                                     for m, d in zip(e.spec.mm, e.mm_data or
                                                     (None,) * len(e.spec.mm), strict=True))
                if type(e.embeds) is StoreRef:
                    embeds[rid] = item_identifier(e.embeds.key)
            step.plan = self.lifetimes.plan(ended, started, encoder_inputs or {}, freed, embeds)
        except BaseException:
            self._undo(step)
            raise
        self._pending = step
        return out

    def _entry(self, entry: Entry, step: _Step) -> Entry:
        spec, data, embeds = entry.spec, entry.mm_data, entry.embeds
        if data and len(data) != len(spec.mm):
            raise LocalProtocolError("item data must match the spec's items",
                                     req_id=spec.req_id)
        if data and any(d is not None for d in data):
            data = tuple(d if d is None else self._place(m.identifier, d, step, False)
                         for m, d in zip(spec.mm, data, strict=True))
        if embeds is not None:
            embeds = self._place(content_key(embeds), embeds, step, True)
        if data is entry.mm_data and embeds is entry.embeds:
            return entry
        return entry._replace(mm_data=data, embeds=embeds)

    def _place(self, ident: str, obj: Any, step: _Step, keyed: bool) -> Any:
        """A StoreRef for ``ident``'s item (written now if needed), or ``obj`` itself
        (inline) when the store has no room for it."""
        store = self.store
        key = step.keys.get(ident)
        if key is None and self.lifetimes.counts.get(ident, 0) > 0:
            key = self.key_of(ident)
        if key is not None:
            self.stats.hits += 1
        else:
            key = self.key_of(ident)
            if key in store and any(store.holds(r, key) for r in store.readers):
                key = f"{ident}{COPY_SEPARATOR}{next(self._copies)}"  # a reader lags
                self.stats.fresh_copies += 1
            try:
                written = store.put(key, obj)
            except StoreFull:
                self.stats.inline += 1
                return obj
            step.puts.append(key)
            step.keys[ident] = key
            self.stats.written += written
            self.stats.hits += not written
        handles: dict[int, ItemHandle] = {}
        for reader in store.readers:
            ref = store.refs_for(reader, [key])[0]
            if isinstance(ref, ItemHandle):  # a bare key: that reader holds it
                handles[reader] = ref
        return StoreRef(key if keyed or key != ident else "", handles)

    # ------------------------------------------------------------ phase two

    def commit(self) -> None:
        """The placed step was sent: apply its lifetimes, unref what it released."""
        step, self._pending = self._pending, None
        if step is None:
            return
        self.lifetimes.commit(step.plan)
        for ident, key in step.keys.items():
            if key == ident:
                self._keys.pop(ident, None)
            else:
                self._keys[ident] = key
        for ident in step.plan.released:
            self.store.unref(self.key_of(ident))

    def abort(self) -> None:
        """The placed step was not sent: drop the store references it added."""
        step, self._pending = self._pending, None
        if step is not None:
            self._undo(step)

    def _undo(self, step: _Step) -> None:
        for key in step.puts:
            self.store.unref(key)
        step.puts.clear()


class StoreMirror(EngineMirror):
    """An :class:`EngineMirror` whose steps place their joining requests' items in
    ``store`` through an :class:`ItemWriter` (``self.items``): a local channel of the
    reference engine.  Same arguments as EngineMirror after ``store``."""

    def __init__(self, store: ShmStore, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.items = ItemWriter(store)

    def step(self, batch: list[str], nsched: list[int], *, finished: Collection[str] = (),
             added: Sequence[Entry] = (), encoder_inputs: Rows | None = None,
             free_encoder_mm_hashes: tuple[str, ...] = (),
             **kwargs: Any) -> tuple[Delta, Applied]:
        try:
            rows = rows_by_position(encoder_inputs, len(batch))
        except MalformedMessage as exc:
            raise LocalProtocolError("encoder inputs do not fit the batch",
                                     cause=str(exc)[:200]) from exc
        inputs = {batch[p]: v for p, v in rows.items()}
        placed = self.items.place(added, finished, inputs, free_encoder_mm_hashes)
        try:
            out = super().step(batch, nsched, finished=finished, added=placed,
                               encoder_inputs=encoder_inputs,
                               free_encoder_mm_hashes=free_encoder_mm_hashes, **kwargs)
        except BaseException:
            self.items.abort()
            raise
        self.items.commit()
        return out


__all__ = ["EMBEDS_PREFIX", "ItemStats", "ItemWriter", "StoreMirror", "content_key"]
