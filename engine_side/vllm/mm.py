"""vLLM multimodal items and prompt embeddings on the deltacast path (engine side).

Wire form of a ``MultiModalFeatureSpec``: its description is an ``MMItem`` of the
request's spec (modality, identifier, placeholder offset and length, mm hash), its
placeholder mask ``is_embed`` travels in ``NewRequest.mm_embed`` and its ``data``
(a vLLM ``MultiModalKwargsItem``, or None for an item the workers get from vLLM's
own mm cache) in ``NewRequest.mm_data``, as a plain, msgpack-encodable map::

    {"@": "vllm", "i": [[key, nested, field], ...]}      # the item's keys, in order

* ``nested`` is the field element's ``NestedTensors``: tensors and numpy arrays
  as themselves (zero-copy frames, or one copy into the store), lists as lists,
  a tuple as ``{"T": [...]}``, ``int`` / ``float`` / ``bool`` / None as such;
* ``field`` is ``["b", keep_on_cpu]`` (``MultiModalBatchedField``),
  ``["f", keep_on_cpu, slices, dim]`` (``MultiModalFlatField``; a slice is
  ``{"s": [start, stop, step]}``, tuples of slices as above) or
  ``["s", keep_on_cpu, batch_size]`` (``MultiModalSharedField``).

Anything else (another field class, a value of another type) is refused with
:class:`UnsupportedItem` before anything is sent.  The worker side
(``worker_side.vllm.mm``) rebuilds fresh, exactly equal objects.

Channels.  Without a store (a *remote* channel) the map travels inline, in
``NewRequest.mm_data``, and its tensors as zero-copy frames; so do prompt embeds
(``NewRequest.embeds``).  With a store (:class:`StoreChannel`, a *local* channel)
``engine_side.item_writer.ItemWriter`` writes each item once under its
``identifier`` (the mm hash), and prompt embeds under a hash of their content
(:func:`content_key`), and those slots carry a ``StoreRef`` instead (a hit: the tag
alone).  The spec's item descriptions, hashed with the spec, are the same on both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine_side.item_writer import ItemStats, ItemWriter, content_key
from engine_side.mirror import Entry
from engine_side.shm_store import ShmStore
from protocol.errors import LocalProtocolError

ITEM_TAG = ("@", "vllm")  # (tag field, value) of an item map (a StoreRef's tag is "store")
TUPLE = "T"
SLICE = "s"
MAX_DEPTH = 32  # lists and tuples nested in an item's value or slices, at most


class UnsupportedItem(LocalProtocolError):
    """A multimodal item holding something the wire form cannot carry exactly."""


# ---------------------------------------------------------------- item -> wire


def _nested(x: Any, depth: int = 0) -> Any:
    t = type(x)
    if t in (list, tuple) and depth == MAX_DEPTH:
        raise UnsupportedItem("a multimodal item's value nested too deep", limit=MAX_DEPTH)
    if t is list:
        return [_nested(v, depth + 1) for v in x]
    if t is tuple:
        return {TUPLE: [_nested(v, depth + 1) for v in x]}
    if x is None or t in (int, float, bool) or isinstance(x, np.ndarray) or _is_torch(x):
        return x
    raise UnsupportedItem("unsupported value in a multimodal item", type=t.__name__)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def _slices(x: Any, depth: int = 0) -> Any:
    if depth == MAX_DEPTH:
        raise UnsupportedItem("a multimodal field's slices nested too deep", limit=MAX_DEPTH)
    if type(x) is slice:
        parts = [x.start, x.stop, x.step]
        if any(p is not None and type(p) is not int for p in parts):
            raise UnsupportedItem("slice bounds must be int or None", slice=repr(x)[:80])
        return {SLICE: parts}
    if type(x) in (list, tuple):
        out = [_slices(v, depth + 1) for v in x]
        return out if type(x) is list else {TUPLE: out}
    raise UnsupportedItem("unsupported value in flat-field slices", type=type(x).__name__)


def _field(field: Any) -> list[Any]:
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFlatField,
        MultiModalSharedField,
    )

    t, keep = type(field), field.keep_on_cpu
    if t is MultiModalBatchedField:
        out = ["b", keep]
    elif t is MultiModalFlatField:
        out = ["f", keep, _slices(field.slices), field.dim]
    elif t is MultiModalSharedField:
        out = ["s", keep, field.batch_size]
    else:
        raise UnsupportedItem("unsupported multimodal field class", cls=t.__name__)
    fields = {f.name for f in dataclasses.fields(field)}
    if fields - {"keep_on_cpu", "slices", "dim", "batch_size"}:
        raise UnsupportedItem("multimodal field has fields unknown to this adapter",
                              cls=t.__name__, fields=sorted(fields))
    return out


def item_to_wire(item: Any) -> Any:
    """The wire map of a ``MultiModalKwargsItem`` (None stays None); tensors are not copied."""
    if item is None:
        return None
    from vllm.multimodal.inputs import MultiModalFieldElem, MultiModalKwargsItem

    if type(item) is not MultiModalKwargsItem:
        raise UnsupportedItem("feature data is not a MultiModalKwargsItem",
                              type=type(item).__name__)
    rows = []
    for key, elem in item.items():
        if type(key) is not str or type(elem) is not MultiModalFieldElem:
            raise UnsupportedItem("bad multimodal item entry", key=repr(key)[:80])
        rows.append([key, _nested(elem.data), _field(elem.field)])
    return {ITEM_TAG[0]: ITEM_TAG[1], "i": rows}


class StoreChannel:
    """A local channel: the step's multimodal items and prompt embeds go through ``store``.

    The encoder calls :meth:`place` with the step's new-request entries, then
    :meth:`commit` once the mirror took the step or :meth:`abort` if it did not.
    Steady steps (nothing joins, finishes, is encoded or freed) cost a few tests.
    """

    def __init__(self, store: ShmStore) -> None:
        self.store = store
        self.writer = ItemWriter(store)

    def place(self, entries: Sequence[Entry], so: Any) -> list[Entry]:
        """``entries`` (the step's ``scheduled_new_reqs``, in order) with their items
        and prompt embeds in the store, fed with the SchedulerOutput's finishes,
        encoder inputs and frees (two-phase: then :meth:`commit` or :meth:`abort`)."""
        return self.writer.place(entries, so.finished_req_ids, so.scheduled_encoder_inputs,
                                 so.free_encoder_mm_hashes)

    def commit(self) -> None:
        self.writer.commit()

    def abort(self) -> None:
        self.writer.abort()

    @property
    def stats(self) -> ItemStats:
        return self.writer.stats

    @property
    def counts(self) -> dict[str, int]:
        """identifier -> reference count (live requests' stored items + encoder cache)."""
        return self.writer.counts

    def key_of(self, identifier: str) -> str:
        return self.writer.key_of(identifier)


__all__ = ["StoreChannel", "UnsupportedItem", "content_key", "item_to_wire"]
