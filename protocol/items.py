"""Multimodal items in the shared-memory store: the reference both ends read, and lifetimes.

On a *local* channel (every receiver attached to the host's store) the engine writes an
item's data once, under its identifier, and a :class:`NewRequest` carries a
:class:`StoreRef` instead of the data: in ``mm_data[i]`` for the spec's item ``i``, in
``embeds`` for the prompt embeddings (keyed by a hash of their content).  The spec's item
descriptions (hashed with the spec) are the same either way; only what travels beside
them changes.

Lifetime rule (:class:`ItemLifetimes`, the same code at both ends, fed the same step
fields, so both agree on every count at every seq).  For each stored identifier::

    count = (stored items of live requests carrying it)
          + (1 while it is in the encoder cache)

* a request is live from the step that adds it until the step that finishes it
  (finishes apply before adds; an add of a live id ends the old entry);
* a request's stored items are its features whose data is a StoreRef (under the
  feature's identifier) and its prompt embeddings when they are one (under the
  identifier of their store key, :func:`item_identifier`);
* an identifier enters the encoder cache in the step an encoder input of a stored
  feature names it (inputs index the request's features) and leaves it in the step
  that frees it (frees apply before the step's encoder inputs);
* counts are compared before and after the whole step: an identifier is *acquired*
  when it goes from 0 to more, *released* when it comes back to 0.

The engine writes (adds a store reference to) an item when it is acquired and drops
that reference when it is released; a receiver resolves the references of the
requests a step adds and releases what the step released.  A view handed out for an
item is therefore valid while a live request or an encoder-cache entry can use it.

Fresh copies: an engine that re-acquires an identifier while a reader still pins the
copy it released (that reader has not applied the releasing step yet) writes a new copy
under ``identifier ‖ COPY_SEPARATOR ‖ n``; the late release then frees only the old one.

Pure: no store, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocol.errors import LocalProtocolError, MalformedMessage
from protocol.messages import Rows
from protocol.packing import unpack_uint_list
from protocol.store_handles import ItemHandle

REF_TAG_FIELD = "@"
REF_TAG = "store"
COPY_SEPARATOR = "#copy"  # a fresh copy's store key: identifier + separator + n


class StoreRef(msgspec.Struct, frozen=True, omit_defaults=True, tag_field=REF_TAG_FIELD,
               tag=REF_TAG, rename={"key": "k", "handles": "h"}):
    """An item in the store, where its data would travel (``Any``-typed fields).

    There it decodes as a plain map (``{"@": "store", ...}``); :func:`as_store_ref`
    turns it back.  A hit for a feature (no handle, the identifier as key) encodes
    in 9 bytes.
    """

    #: the store key when it is not the feature's identifier (a fresh copy; always
    #: set for prompt embeddings, which have no identifier in the spec)
    key: str = ""
    #: reader id -> handle, for the readers that do not hold the item yet
    handles: dict[int, ItemHandle] = msgspec.field(default_factory=dict)

    def store_key(self, identifier: str) -> str:
        """The store key of the item whose spec identifier is ``identifier``."""
        return self.key or identifier


def as_store_ref(data: Any) -> StoreRef | None:
    """The :class:`StoreRef` in an item's data slot (decoded or not), else None.

    Raises :class:`MalformedMessage` for a tagged map that is not a valid reference.
    """
    if type(data) is StoreRef:
        return data
    if type(data) is not dict or data.get(REF_TAG_FIELD) != REF_TAG:
        return None
    try:
        return msgspec.convert(data, StoreRef)
    except msgspec.ValidationError as exc:
        raise MalformedMessage("bad store reference", cause=str(exc)[:200]) from exc


def item_identifier(key: str) -> str:
    """The identifier a store key holds (the key without a fresh copy's suffix)."""
    return key.partition(COPY_SEPARATOR)[0]


def rows_by_position(rows: Rows | None, n: int) -> dict[int, list[int]]:
    """Rows keyed by positions ``< n`` (absent keys: every position) as a dict, in the
    rows' order.  Raises MalformedMessage for rows that do not add up."""
    if rows is None:
        return {}
    keys = unpack_uint_list(rows.keys) if rows.keys else list(range(n))
    counts = unpack_uint_list(rows.counts) if rows.counts else [1] * len(keys)
    values = unpack_uint_list(rows.values) if rows.values else []
    if len(counts) != len(keys) or sum(counts) != len(values) or len(set(keys)) != len(keys) \
            or (keys and max(keys) >= n):
        raise MalformedMessage("rows do not fit the schedule", rows=len(keys), positions=n)
    out: dict[int, list[int]] = {}
    at = 0
    for p, c in zip(keys, counts, strict=True):
        out[p] = values[at:at + c]
        at += c
    return out


# ---------------------------------------------------------------- lifetimes

#: a live request's stored items: per feature its identifier (None: not stored), and
#: its prompt embeddings' identifier (None: not stored)
Held = tuple[tuple[str | None, ...], str | None]
_NOTHING: Held = ((), None)


def _held_ids(held: Held) -> list[str]:
    ids = [i for i in held[0] if i is not None]
    if held[1] is not None:
        ids.append(held[1])
    return ids


@dataclass
class LifetimePlan:
    """What one step changes; computed without touching the tracker (two-phase)."""

    ended: list[str] = field(default_factory=list)  # live ids that end (or restart)
    started: dict[str, Held] = field(default_factory=dict)  # ids that start (or restart)
    cache_out: list[str] = field(default_factory=list)
    cache_in: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # new counts of touched ids
    acquired: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)


class ItemLifetimes:
    """Reference counts of stored items, driven by each step's fields (rule above).

    Pure and deterministic.  Tracks only requests with features or stored prompt
    embeddings.
    """

    def __init__(self) -> None:
        self.live: dict[str, Held] = {}
        self.cached: set[str] = set()  # identifiers in the encoder cache
        self.counts: dict[str, int] = {}  # identifier -> count (> 0 only)

    def plan(self, ended: Iterable[str], started: Mapping[str, tuple[str | None, ...]],
             encoder_inputs: Mapping[str, Iterable[int]], freed: Iterable[str],
             embeds: Mapping[str, str] | None = None) -> LifetimePlan:
        """The step's changes.

        ``ended``: ids that finished; ``started``: for each request the step adds, per
        feature its stored identifier or None; ``encoder_inputs``: per request, the
        feature indices whose encoder inputs are scheduled; ``freed``: identifiers
        leaving the encoder cache; ``embeds``: for added requests whose prompt
        embeddings are stored, their identifier.

        Raises LocalProtocolError (the tracker unchanged) for an encoder input index
        outside its request's features, or a count that would go below zero.
        """
        embeds = embeds or {}
        plan = LifetimePlan()
        if not (ended or started or encoder_inputs or freed or embeds):
            return plan  # a steady step: nothing starts, ends or enters the cache
        delta = Counter[str]()
        live = self.live
        plan.ended = [rid for rid in sorted(set(ended)) if rid in live]
        for rid in plan.ended:
            delta.subtract(_held_ids(live[rid]))
        gone = set(plan.ended)
        for rid in dict.fromkeys((*started, *embeds)):
            if rid in live and rid not in gone:  # re-added while live: the old entry ends
                plan.ended.append(rid)
                gone.add(rid)
                delta.subtract(_held_ids(live[rid]))
            held: Held = (tuple(started.get(rid, ())), embeds.get(rid))
            if held != _NOTHING:
                plan.started[rid] = held
                delta.update(_held_ids(held))
        plan.cache_out = [i for i in dict.fromkeys(freed) if i in self.cached]
        delta.subtract(plan.cache_out)
        after = self.cached.difference(plan.cache_out)
        for rid, indices in encoder_inputs.items():
            features = (plan.started.get(rid) or (live.get(rid, _NOTHING) if rid not in gone
                                                  else _NOTHING))[0]
            for j in indices:
                if not 0 <= j < len(features):
                    raise LocalProtocolError("encoder input index out of range",
                                             req_id=rid, index=j)
                ident = features[j]
                if ident is not None and ident not in after:
                    after.add(ident)
                    plan.cache_in.append(ident)
                    delta[ident] += 1
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
        return plan

    def commit(self, plan: LifetimePlan) -> None:
        """Apply a plan made by :meth:`plan` on this very state (cannot fail)."""
        for rid in plan.ended:
            del self.live[rid]
        self.live.update(plan.started)
        self.cached.difference_update(plan.cache_out)
        self.cached.update(plan.cache_in)
        for ident, count in plan.counts.items():
            if count:
                self.counts[ident] = count
            else:
                self.counts.pop(ident, None)


__all__ = ["COPY_SEPARATOR", "ItemLifetimes", "LifetimePlan", "StoreRef", "as_store_ref",
           "item_identifier", "rows_by_position"]
