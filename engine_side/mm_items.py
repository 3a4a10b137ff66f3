"""The engine side of multimodal items: store them once, send references, free them.

:class:`MultimodalEngine` wraps one :class:`EngineMirror` (one channel).  With a
:class:`ShmStore` (a *local* channel: every worker on it is attached to the
store) each new request's ``mm_features`` data is written into the store under
its ``identifier`` (the content hash) unless already there, and replaced by a
:class:`~worker_side.mm_items.StoreRef` before ``mirror.diff``: deltas and
snapshots then carry handles or nothing, never the tensors.  Without a store (a
*remote* channel) requests pass through untouched and the tensors travel as
zero-copy frames.  An engine with both kinds of workers runs one mirror (and
one ``MultimodalEngine``) per channel.

Lifetimes follow :class:`~worker_side.mm_items.ItemLifetimes` (rule in that
module): the engine holds one store reference per identifier while its count is
positive (``put`` when acquired, ``unref`` when released), and the workers apply
the same rule to the same stream.  A feature whose item cannot be stored
(:class:`StoreFull`, or ``data`` None for an item the store lost) stays inline.

Failure: if ``diff`` raises, the mirror, the counts and the store references
are as before; handles issued for that step stay pinned for their readers
until they detach (a later ref to them would be a bare key the reader lacks),
so a failed diff on a local channel calls for re-attaching its readers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import msgspec

from engine_side.diffing import BlockHint
from engine_side.mirror import EngineMirror
from engine_side.shm_store import ShmStore
from protocol.messages import Delta, Snapshot
from protocol.params import MMFeatureRef
from protocol.request import ExecuteModelRequest, RequestSpec, _same_value
from protocol.store_handles import ItemHandle, StoreFull
from worker_side.mm_items import ItemLifetimes, LifetimePlan, StoreRef, same_objects

COPY_SEPARATOR = "#copy"  # store key of a fresh copy: identifier + separator + n


@dataclass
class ItemStats:
    """Counters since creation (per item occurrence in a new request)."""

    written: int = 0  # items copied into the store
    hits: int = 0  # items already in the store (nothing copied)
    inline: int = 0  # items left inline (no room, or remote channel)
    fresh_copies: int = 0  # re-acquired while a reader still released the old copy


@dataclass
class _Step:
    """What one ``diff`` call did to the store, and what it will commit."""

    puts: list[str] = field(default_factory=list)  # store keys given one reference
    keys: dict[str, str] = field(default_factory=dict)  # identifier -> key, acquired now
    specs: dict[str, tuple[RequestSpec, RequestSpec]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # ids whose spec lost its features


def _static_equal(a: RequestSpec, b: RequestSpec) -> bool:
    """Equal apart from feature data (an identifier names its content)."""
    def strip(s: RequestSpec) -> RequestSpec:
        features = tuple(msgspec.structs.replace(f, data=None) for f in s.mm_features)
        return msgspec.structs.replace(s, mm_features=features)

    return _same_value(strip(a), strip(b))


class MultimodalEngine:
    """One channel's mirror plus its multimodal items.

    Args:
        mirror: the channel's mirror (its deltas carry the rewritten requests).
        store: the host's store for a local channel; None for a remote one.
    """

    def __init__(self, mirror: EngineMirror, store: ShmStore | None = None) -> None:
        self.mirror = mirror
        self.store = store
        self.lifetimes = ItemLifetimes()
        self.stats = ItemStats()
        self._specs: dict[str, tuple[RequestSpec, RequestSpec]] = {}  # id -> (engine, wire)
        self._keys: dict[str, str] = {}  # identifier -> store key, only for fresh copies
        self._copies = itertools.count(1)
        self._last: tuple[list[RequestSpec], list[RequestSpec]] = ([], [])  # (engine, wire)

    @property
    def counts(self) -> dict[str, int]:
        """identifier -> reference count (live request features + encoder cache)."""
        return dict(self.lifetimes.counts)

    def key_of(self, identifier: str) -> str:
        return self._keys.get(identifier, identifier)

    def snapshot(self) -> Snapshot:
        return self.mirror.snapshot()

    def diff(self, request: ExecuteModelRequest, hint: BlockHint | None = None) -> Delta:
        """``mirror.diff`` of ``request`` (and ``hint``) with its items stored and referenced.

        Raises what ``mirror.diff`` raises (LocalProtocolError), and
        LocalProtocolError for an encoder input index outside a request's
        features; the mirror, counts and store references are then unchanged.
        """
        if self.store is None:
            self.stats.inline += sum(len(s.mm_features) for s in self._new_specs(request))
            return self.mirror.diff(request, hint)
        step = _Step()
        try:
            wire = self._rewrite(request, step)
            plan = self.lifetimes.plan(wire)
            delta = self.mirror.diff(wire, hint)
        except BaseException:
            for key in step.puts:
                self.store.unref(key)
            raise
        self._commit(request, plan, step)
        return delta

    # ------------------------------------------------------------ rewriting

    def _new_specs(self, request: ExecuteModelRequest) -> list[RequestSpec]:
        """Specs the mirror has not seen under their id (remote-channel accounting)."""
        known = self.mirror.engine_specs
        handles = self.mirror.handles
        return [s for rid, s in zip(request.req_ids, request.specs, strict=True)
                if rid not in handles or known.get(handles[rid]) is not s]

    def _rewrite(self, request: ExecuteModelRequest, step: _Step) -> ExecuteModelRequest:
        ended = request.finished_req_ids
        if not ended and same_objects(request.specs, self._last[0]):
            return msgspec.structs.replace(request, specs=list(self._last[1]))
        specs = []
        for rid, spec in zip(request.req_ids, request.specs, strict=True):
            entry = None if rid in ended else self._specs.get(rid)
            if not spec.mm_features:
                if entry is not None:
                    step.dropped.append(rid)
                specs.append(spec)
            elif entry is not None and entry[0] is spec:
                specs.append(entry[1])
            elif entry is not None and _static_equal(entry[0], spec):
                step.specs[rid] = (spec, entry[1])  # same content: keep the wire spec
                specs.append(entry[1])
            else:
                wire = self._store_spec(spec, step)
                step.specs[rid] = (spec, wire)
                specs.append(wire)
        return msgspec.structs.replace(request, specs=specs)

    def _store_spec(self, spec: RequestSpec, step: _Step) -> RequestSpec:
        features = tuple(self._store_feature(f, step) for f in spec.mm_features)
        return msgspec.structs.replace(spec, mm_features=features)

    def _store_feature(self, feature: MMFeatureRef, step: _Step) -> MMFeatureRef:
        assert self.store is not None
        key = self._acquire(feature, step)
        if key is None:
            self.stats.inline += feature.data is not None
            return feature
        handles: dict[int, ItemHandle] = {}
        for reader in self.store.readers:
            ref = self.store.refs_for(reader, [key])[0]
            if isinstance(ref, ItemHandle):  # a bare key: that reader holds it
                handles[reader] = ref
        ref_key = "" if key == feature.identifier else key
        return msgspec.structs.replace(feature, data=StoreRef(ref_key, handles))

    def _acquire(self, feature: MMFeatureRef, step: _Step) -> str | None:
        """The store key holding ``feature``'s item (written now if needed), or None."""
        assert self.store is not None
        ident = feature.identifier
        key = step.keys.get(ident)
        if key is None and self.lifetimes.counts.get(ident, 0) > 0:
            key = self.key_of(ident)
        if key is not None:
            self.stats.hits += 1
            return key
        key = self.key_of(ident)
        if key in self.store and self._pinned(key):  # a reader has yet to apply its release
            key = f"{ident}{COPY_SEPARATOR}{next(self._copies)}"
            self.stats.fresh_copies += 1
        if feature.data is None and key not in self.store:
            return None
        try:
            written = self.store.put(key, feature.data)
        except StoreFull:
            return None
        step.puts.append(key)
        step.keys[ident] = key
        self.stats.written += written
        self.stats.hits += not written
        return key

    def _pinned(self, key: str) -> bool:
        assert self.store is not None
        return any(self.store.holds(reader, key) for reader in self.store.readers)

    # ------------------------------------------------------------ lifetimes

    def _commit(self, request: ExecuteModelRequest, plan: LifetimePlan, step: _Step) -> None:
        assert self.store is not None
        self.lifetimes.commit(plan)
        self._last = (list(request.specs), plan.specs)
        for rid in (*request.finished_req_ids, *step.dropped):
            self._specs.pop(rid, None)
        self._specs.update(step.specs)
        for ident, key in step.keys.items():
            if key == ident:
                self._keys.pop(ident, None)
            else:
                self._keys[ident] = key
        for ident in plan.released:
            self.store.unref(self.key_of(ident))
