"""vLLM multimodal items and prompt embeddings on the deltacast path (worker side).

Rebuilds ``MultiModalFeatureSpec`` item data and prompt embeds from the wire form
described in ``engine_side.vllm.mm`` (the constants below are that form's; the two
sides share no module) and, on a local channel (:class:`StoreResolver`), resolves
store references first.

Buffer rule (what a decoded ``NewRequestData`` shares, and with whom):

* Containers are fresh on every decode: the feature specs, their
  ``PlaceholderRange``, each ``MultiModalKwargsItem`` and ``MultiModalFieldElem``,
  and every list / tuple of the nested data.  vLLM rewrites them in place
  (``WorkerWrapperBase._apply_mm_cache`` assigns ``feature.data``; the runner
  keeps the lists), and that never reaches our state.
* Tensors (item data, ``is_embed``, ``prompt_embeds``) are fresh tensor objects
  that by default alias our memory without a copy: on a local channel the
  store's read-only shared mapping (valid while the item's count is positive,
  i.e. while a live request or encoder-cache entry needs it: the runner's whole
  use of it), on a remote channel the private buffers the decoder copied the
  frames into (shared by every re-send of the request).  They are READ-ONLY:
  vLLM 0.32's worker only reads them (``group_and_batch_mm_items`` stacks or
  concatenates into new tensors or takes views; ``prompt_embeds`` are copied into
  the runner's input buffer).  A model that writes into its multimodal inputs
  would fault on a store view (SIGSEGV): run such a model with ``copy=True``,
  which gives every decoded tensor its own writable memory (one copy per worker).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocol.errors import MalformedMessage
from worker_side.item_resolver import ItemResolver
from worker_side.shm_reader import ShmReader

ITEM_TAG = ("@", "vllm")  # (tag field, value) of an item map (a StoreRef's tag is "store")
TUPLE = "T"
SLICE = "s"
MAX_DEPTH = 32  # lists and tuples nested in an item's value or slices, at most


def fresh(x: Any, copy: bool = False) -> Any:
    """A new tensor/array object over the same memory (or its own copy if ``copy``)."""
    if isinstance(x, np.ndarray):
        return x.copy() if copy else x.view()
    if type(x).__module__.startswith("torch"):
        return x.clone() if copy else x.detach()
    return x


def _nested(x: Any, copy: bool, depth: int = 0) -> Any:
    t = type(x)
    if t in (list, dict) and depth == MAX_DEPTH:
        raise MalformedMessage("a multimodal item's value nested too deep", limit=MAX_DEPTH)
    if t is list:
        return [_nested(v, copy, depth + 1) for v in x]
    if t is dict:
        if list(x) != [TUPLE] or type(x[TUPLE]) is not list:
            raise MalformedMessage("bad nested value in a multimodal item")
        return tuple(_nested(v, copy, depth + 1) for v in x[TUPLE])
    if x is None or t in (int, float, bool):
        return x
    return _tensor(x, copy, "a value in a multimodal item that is no number")


def _slices(x: Any, depth: int = 0) -> Any:
    if depth == MAX_DEPTH:
        raise MalformedMessage("a multimodal field's slices nested too deep", limit=MAX_DEPTH)
    if type(x) is list:
        return [_slices(v, depth + 1) for v in x]
    if type(x) is dict and list(x) == [TUPLE] and type(x[TUPLE]) is list:
        return tuple(_slices(v, depth + 1) for v in x[TUPLE])
    if type(x) is dict and list(x) == [SLICE] and type(x[SLICE]) is list and \
            len(x[SLICE]) == 3 and all(p is None or type(p) is int for p in x[SLICE]):
        return slice(*x[SLICE])
    raise MalformedMessage("bad flat-field slices in a multimodal item")


def _field(wire: Any) -> Any:
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFlatField,
        MultiModalSharedField,
    )

    match wire:
        case ["b", bool(keep)]:
            return MultiModalBatchedField(keep_on_cpu=keep)
        case ["f", bool(keep), slices, int(dim)]:
            return MultiModalFlatField(keep_on_cpu=keep, slices=_slices(slices), dim=dim)
        case ["s", bool(keep), int(size)]:
            return MultiModalSharedField(keep_on_cpu=keep, batch_size=size)
    raise MalformedMessage("bad multimodal field descriptor")


def item_from_wire(data: Any, copy: bool = False) -> Any:
    """A fresh ``MultiModalKwargsItem`` from its wire map (None stays None)."""
    if data is None:
        return None
    from vllm.multimodal.inputs import MultiModalFieldElem, MultiModalKwargsItem

    if type(data) is not dict or data.get(ITEM_TAG[0]) != ITEM_TAG[1] \
            or type(data.get("i")) is not list:
        raise MalformedMessage("feature data is not a vLLM item map (a store ref without "
                               "a store?)")
    item = MultiModalKwargsItem()
    for row in data["i"]:
        if type(row) is not list or len(row) != 3 or type(row[0]) is not str:
            raise MalformedMessage("bad multimodal item entry")
        item[row[0]] = MultiModalFieldElem(data=_nested(row[1], copy), field=_field(row[2]))
    return item


def _tensor(x: Any, copy: bool, what: str) -> Any:
    if isinstance(x, np.ndarray) or type(x).__module__.startswith("torch"):
        return fresh(x, copy)
    raise MalformedMessage(f"{what} is not a tensor", type=type(x).__name__)


def mask_from_wire(x: Any, copy: bool = False) -> Any:
    """A placeholder's ``is_embed`` mask as received: None, or a fresh tensor object
    (MalformedMessage for anything else)."""
    return None if x is None else _tensor(x, copy, "a placeholder mask")


def embeds_from_wire(x: Any, copy: bool = False) -> Any:
    """Prompt embeds as received (a fresh tensor object, or its own copy if ``copy``).

    Raises MalformedMessage for anything but a tensor (a store reference without a
    store, say)."""
    return _tensor(x, copy, "prompt embeds (a store ref without a store?)")


class StoreResolver(ItemResolver):
    """A local channel's rank end (``SchedulerOutputDecoder.attach_store``): while a
    step can still be refused, the store references of the requests it adds become
    zero-copy views (items in the wire map above, prompt embeds as tensors); once it
    has applied, released items are let go
    (:class:`worker_side.item_resolver.ItemResolver`).  References that do not resolve
    (ForgedHandle, StaleHandle, UnknownItem, MalformedMessage) refuse the step with the
    rank's state and held items unchanged."""

    def __init__(self, reader: ShmReader) -> None:
        super().__init__(reader)


__all__ = ["StoreResolver", "embeds_from_wire", "fresh", "item_from_wire", "mask_from_wire"]
