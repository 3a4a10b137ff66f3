"""Multimodal items through the shared-memory store: lifetimes and the worker's resolver.

Theory of operation
-------------------
On a *local* channel the engine (``engine_side.mm_items``) writes each item's
data (the nested dicts/lists of tensors of an :class:`MMFeatureRef`) into the
store once, under its content hash, and the delta carries a :class:`StoreRef`
in ``data`` instead: a handle for every reader that does not hold the item yet,
nothing at all for readers that do.  On a *remote* channel (a worker without
access to the store) the engine leaves ``data`` inline and the tensors travel
as frames; the choice is per channel, i.e. per :class:`EngineMirror`.

Lifetime rule (:class:`ItemLifetimes`, the same code on both sides, fed the same
request stream, so both sides agree on every count at every seq).  For each
stored identifier (a feature whose ``data`` is a ``StoreRef``)::

    count = (stored features of live requests carrying it)
          + (1 while it is in the encoder cache)

* a request is live from the step it first appears in ``req_ids`` until its id
  appears in ``finished_req_ids`` (finishes apply before adds; a request whose
  spec changes is an end and a new start);
* an identifier enters the encoder cache in the step one of its encoder inputs
  is scheduled (``encoder_inputs`` indexes the request's ``mm_features``) and
  leaves it in the step it appears in ``free_encoder_mm_hashes`` (frees apply
  before the step's schedule, as in vLLM's runner);
* counts are compared before and after the whole step: an identifier is
  *acquired* when it goes from 0 to more, *released* when it comes back to 0.

The engine ``put``s an item when it is acquired and ``unref``s it when it is
released; the worker resolves handles when a spec first appears and calls
``ShmReader.release`` when it is released.  An item that every scheduled
request of a step needs therefore has a positive count, so the views the
worker hands out stay valid while any live request or encoder-cache entry can
use them.

If an engine re-acquires an identifier while some reader has not yet applied
the step that released it (its pin is still set), the engine writes a fresh
copy under a new store key (``StoreRef.key``): the late release clears only
the old pin (without it that reader would get a bare key for an item it has
just released; ``tests/test_mm_wiring.py`` shows the race).

Not covered: a worker that resyncs from a snapshot keeps its counts (a gap may
hide finishes and frees), and a reader attached after a request was added has
no handle for its items; both should re-attach (a fresh reader and replica).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocol.errors import LocalProtocolError, MalformedMessage
from protocol.params import MMFeatureRef
from protocol.request import ExecuteModelRequest, RequestSpec
from protocol.store_handles import ItemHandle, UnknownItem
from worker_side.shm_reader import ShmReader

REF_TAG_FIELD = "@"
REF_TAG = "store"


class StoreRef(msgspec.Struct, frozen=True, omit_defaults=True, tag_field=REF_TAG_FIELD,
               tag=REF_TAG, rename={"key": "k", "handles": "h"}):
    """What ``MMFeatureRef.data`` carries on a local channel instead of the tensors.

    Inside the ``Any``-typed ``data`` it decodes as a plain map (``{"@": "store",
    ...}``); :func:`as_store_ref` turns it back.  A store hit encodes as 9 bytes.
    """

    #: store key when it is not the feature's ``identifier`` (a fresh copy)
    key: str = ""
    #: reader id -> handle, for the readers that do not hold the item yet
    handles: dict[int, ItemHandle] = msgspec.field(default_factory=dict)

    def store_key(self, feature: MMFeatureRef) -> str:
        return self.key or feature.identifier


def as_store_ref(data: Any) -> StoreRef | None:
    """The :class:`StoreRef` in a feature's ``data`` (decoded or not), else None.

    Raises :class:`MalformedMessage` for a tagged map that is not a valid ref.
    """
    if isinstance(data, StoreRef):
        return data
    if type(data) is not dict or data.get(REF_TAG_FIELD) != REF_TAG:
        return None
    try:
        return msgspec.convert(data, StoreRef)
    except msgspec.ValidationError as exc:
        raise MalformedMessage("bad store reference", cause=str(exc)[:200]) from exc


def is_stored(feature: MMFeatureRef) -> bool:
    return as_store_ref(feature.data) is not None


# ---------------------------------------------------------------- lifetimes


@dataclass
class LifetimePlan:
    """What one step changes; computed without touching the tracker (two-phase)."""

    finished: list[str] = field(default_factory=list)  # live ids that end
    #: req_id -> (spec, stored identifiers) for requests that start (or restart)
    added: dict[str, tuple[RequestSpec, tuple[str, ...]]] = field(default_factory=dict)
    cache_out: list[str] = field(default_factory=list)
    cache_in: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # new counts of touched ids
    acquired: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    specs: list[RequestSpec] = field(default_factory=list)  # the step's, for the fast path


def same_objects(a: list[RequestSpec], b: list[RequestSpec]) -> bool:
    """True when both lists hold the very same objects (C-speed identity check)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class ItemLifetimes:
    """Reference counts of stored items, driven by the per-step request stream.

    Pure and deterministic; see the module docstring for the rule.  ``plan``
    raises :class:`LocalProtocolError` (tracker unchanged) for an encoder input
    index outside the request's features.
    """

    def __init__(self) -> None:
        self.live: dict[str, tuple[RequestSpec, tuple[str, ...]]] = {}
        self.cached: set[str] = set()  # identifiers in the encoder cache
        self.counts: dict[str, int] = {}  # identifier -> count (> 0 only)
        self._last: list[RequestSpec] = []  # the last committed step's specs

    def plan(self, request: ExecuteModelRequest,
             stored: Callable[[MMFeatureRef], bool] = is_stored) -> LifetimePlan:
        plan, delta = LifetimePlan(specs=request.specs), Counter[str]()
        ended = request.finished_req_ids
        if (not ended and not request.free_encoder_mm_hashes
                and not request.encoder_inputs.values.size
                and same_objects(request.specs, self._last)):
            return plan  # a steady step: nothing starts, ends or enters the cache
        plan.finished = [rid for rid in sorted(ended) if rid in self.live]
        for rid in plan.finished:
            delta.subtract(self.live[rid][1])
        for rid, spec in zip(request.req_ids, request.specs, strict=True):
            entry = None if rid in ended else self.live.get(rid)
            if entry is not None and entry[0] is spec:
                continue
            if entry is not None:  # the spec changed: the old one ends
                delta.subtract(entry[1])
            idents = tuple(f.identifier for f in spec.mm_features if stored(f))
            plan.added[rid] = (spec, idents)
            delta.update(idents)
        self._plan_cache(request, stored, plan, delta)
        self._plan_counts(plan, delta)
        return plan

    def _plan_cache(self, request: ExecuteModelRequest, stored: Callable[[MMFeatureRef], bool],
                    plan: LifetimePlan, delta: Counter[str]) -> None:
        plan.cache_out = [h for h in dict.fromkeys(request.free_encoder_mm_hashes)
                          if h in self.cached]
        delta.subtract(plan.cache_out)
        after = self.cached.difference(plan.cache_out)
        if not request.encoder_inputs.values.size:
            return
        for spec, row in zip(request.specs, request.encoder_inputs.to_lists(), strict=True):
            for j in row:
                if not 0 <= j < len(spec.mm_features):
                    raise LocalProtocolError("encoder input index out of range",
                                             req_id=spec.req_id, index=j)
                feature = spec.mm_features[j]
                if stored(feature) and feature.identifier not in after:
                    after.add(feature.identifier)
                    plan.cache_in.append(feature.identifier)
                    delta[feature.identifier] += 1

    def _plan_counts(self, plan: LifetimePlan, delta: Counter[str]) -> None:
        for ident, change in delta.items():
            if change == 0:
                continue
            old = self.counts.get(ident, 0)
            new = old + change
            if new < 0:
                raise LocalProtocolError("item reference count below zero", key=ident[:80])
            plan.counts[ident] = new
            if old == 0:
                plan.acquired.append(ident)
            elif new == 0:
                plan.released.append(ident)

    def commit(self, plan: LifetimePlan) -> None:
        self._last = list(plan.specs)
        for rid in plan.finished:
            del self.live[rid]
        self.live.update(plan.added)
        self.cached.difference_update(plan.cache_out)
        self.cached.update(plan.cache_in)
        for ident, count in plan.counts.items():
            if count:
                self.counts[ident] = count
            else:
                self.counts.pop(ident, None)


# ---------------------------------------------------------------- worker


class MultimodalWorker:
    """Turns a rebuilt request's store refs into zero-copy tensor views; releases items.

    Args:
        reader: this worker's attached store reader, or None on a remote channel
            (items then arrive inline, as frames, and pass through untouched).

    Call :meth:`resolve` once per applied step, in order (right after
    ``replica.request()``).  Resolved specs are cached per request, so an
    unchanged request keeps its resolved spec object from step to step.
    """

    def __init__(self, reader: ShmReader | None = None) -> None:
        self.reader = reader
        self.lifetimes = ItemLifetimes()
        self._specs: dict[str, tuple[RequestSpec, RequestSpec]] = {}  # id -> (wire, resolved)
        self._keys: dict[str, str] = {}  # identifier -> store key held

    def resolve(self, request: ExecuteModelRequest) -> ExecuteModelRequest:
        """The same step with every feature's data resolved (the input is not mutated).

        Raises ``RemoteProtocolError`` (ForgedHandle, StaleHandle,
        UnknownItem, MalformedMessage) for refs that do not resolve; the
        worker's item state is then unreliable and it should re-attach.
        """
        try:
            plan = self.lifetimes.plan(request)
        except LocalProtocolError as exc:  # the engine sent it: a remote fault here
            raise MalformedMessage("bad multimodal item stream", cause=str(exc)) from exc
        resolved = {rid: (spec, self._resolve_spec(spec))
                     for rid, (spec, idents) in plan.added.items() if idents}
        self.lifetimes.commit(plan)
        for rid in plan.finished:
            self._specs.pop(rid, None)
        for rid in plan.added:
            self._specs.pop(rid, None)
        self._specs.update(resolved)
        self._release(plan.released)
        specs = [self._output_spec(rid, spec) for rid, spec in zip(request.req_ids, request.specs,
                                                                   strict=True)]
        return msgspec.structs.replace(request, specs=specs)

    def _output_spec(self, rid: str, spec: RequestSpec) -> RequestSpec:
        entry = self._specs.get(rid)
        return entry[1] if entry is not None and entry[0] is spec else spec

    def _resolve_spec(self, spec: RequestSpec) -> RequestSpec:
        features = tuple(self._resolve_feature(f) for f in spec.mm_features)
        return msgspec.structs.replace(spec, mm_features=features)

    def _resolve_feature(self, feature: MMFeatureRef) -> MMFeatureRef:
        ref = as_store_ref(feature.data)
        if ref is None:
            return feature
        if self.reader is None:
            raise UnknownItem("store reference on a channel without a store",
                              key=feature.identifier[:80])
        key = ref.store_key(feature)
        handle = ref.handles.get(self.reader.info.reader_id)
        data = self.reader.resolve(handle if handle is not None else key)
        self._keys[feature.identifier] = key
        return msgspec.structs.replace(feature, data=data)

    def _release(self, idents: Iterable[str]) -> None:
        for ident in idents:
            key = self._keys.pop(ident, None)
            if key is not None and self.reader is not None:
                self.reader.release(key)

    @property
    def held(self) -> dict[str, str]:
        """identifier -> store key, for the items this worker holds."""
        return dict(self._keys)


__all__ = ["ItemLifetimes", "LifetimePlan", "MultimodalWorker", "StoreRef", "as_store_ref",
           "is_stored"]
