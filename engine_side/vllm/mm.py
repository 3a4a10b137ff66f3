"""vLLM multimodal items and prompt embeddings on the deltacast path (engine side).

Wire form of a ``MultiModalFeatureSpec`` (an :class:`MMFeatureRef`).  Its
``data`` (a vLLM ``MultiModalKwargsItem``, or None for an item the workers get
from vLLM's own mm cache) becomes a plain, msgpack-encodable map::

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

Channels.  Without a store (a *remote* channel) the map travels inline and its
tensors as zero-copy frames.  With a store (:class:`StoreChannel`, a *local*
channel) ``engine_side.mm_items.MultimodalEngine`` writes each item once under
its ``identifier`` (the mm hash) and the delta carries a ``StoreRef`` (a hit:
the key only).  ``prompt_embeds`` then travel the same way: the encoder's spec
keeps them, and :class:`StoreChannel` moves them, on the wire only, into one
extra trailing feature of modality :data:`EMBEDS_MODALITY` keyed by a hash of
their content; the worker moves them back.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import msgspec
import numpy as np

from engine_side.diffing import BlockHint
from engine_side.mirror import EngineMirror
from engine_side.mm_items import MultimodalEngine
from engine_side.shm_store import ShmStore
from protocol.errors import LocalProtocolError
from protocol.messages import Delta
from protocol.params import MMFeatureRef
from protocol.request import ExecuteModelRequest, RequestSpec
from protocol.tensors import make_enc_hook
from worker_side.mm_items import same_objects

ITEM_TAG = ("@", "vllm")  # (tag field, value) of an item map (a StoreRef's tag is "store")
TUPLE = "T"
SLICE = "s"
EMBEDS_MODALITY = "@prompt_embeds"  # never a vLLM modality (wire-only, local channels)
EMBEDS_PREFIX = "pe:"


class UnsupportedItem(LocalProtocolError):
    """A multimodal item holding something the wire form cannot carry exactly."""


# ---------------------------------------------------------------- item -> wire


def _nested(x: Any) -> Any:
    t = type(x)
    if t is list:
        return [_nested(v) for v in x]
    if t is tuple:
        return {TUPLE: [_nested(v) for v in x]}
    if x is None or t in (int, float, bool) or isinstance(x, np.ndarray) or _is_torch(x):
        return x
    raise UnsupportedItem("unsupported value in a multimodal item", type=t.__name__)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def _slices(x: Any) -> Any:
    if type(x) is slice:
        parts = [x.start, x.stop, x.step]
        if any(p is not None and type(p) is not int for p in parts):
            raise UnsupportedItem("slice bounds must be int or None", slice=repr(x)[:80])
        return {SLICE: parts}
    if type(x) in (list, tuple):
        out = [_slices(v) for v in x]
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


def features_to_refs(features: list[Any]) -> tuple[MMFeatureRef, ...]:
    """``NewRequestData.mm_features`` as MMFeatureRefs, their data in wire form."""
    refs = []
    for f in features:
        pos = f.mm_position
        refs.append(MMFeatureRef(modality=f.modality, identifier=f.identifier, offset=pos.offset,
                                 length=pos.length, mm_hash=f.mm_hash, is_embed=pos.is_embed,
                                 data=item_to_wire(f.data)))
    return tuple(refs)


# ---------------------------------------------------------------- prompt embeds


def content_key(tensor: Any) -> str:
    """A key naming a tensor's dtype, shape and bytes (BLAKE2b-128 over them)."""
    aux: list[Any] = []
    header = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux)).encode(tensor)
    h = hashlib.blake2b(header, digest_size=16)
    for frame in aux:
        h.update(frame)
    return EMBEDS_PREFIX + h.hexdigest()


def embeds_feature(spec: RequestSpec) -> RequestSpec:
    """``spec`` with its prompt_embeds moved into a trailing wire-only feature."""
    embeds = spec.prompt_embeds
    feature = MMFeatureRef(modality=EMBEDS_MODALITY, identifier=content_key(embeds), offset=0,
                           length=int(embeds.shape[0]) if embeds.ndim else 0, data=embeds)
    return msgspec.structs.replace(spec, prompt_embeds=None,
                                   mm_features=(*spec.mm_features, feature))


class StoreChannel:
    """A local channel: multimodal items and prompt embeds go through ``store``.

    Wraps the encoder's mirror in a :class:`MultimodalEngine` (which keeps item
    lifetimes: written when first needed, released when no live request nor
    encoder-cache entry needs them).  Steady steps cost one identity check.
    """

    def __init__(self, store: ShmStore) -> None:
        self.store = store
        self.engine: MultimodalEngine | None = None
        self._wire: dict[str, tuple[RequestSpec, RequestSpec]] = {}  # id -> (spec, wire spec)
        self._last: tuple[list[RequestSpec], list[RequestSpec]] = ([], [])

    def diff(self, mirror: EngineMirror, request: ExecuteModelRequest,
             hint: BlockHint | None = None) -> Delta:
        if self.engine is None or self.engine.mirror is not mirror:
            self.engine = MultimodalEngine(mirror, self.store)
        wire = self._embeds_as_features(request)
        delta = self.engine.diff(wire, hint)
        self._last = (request.specs, wire.specs)
        return delta

    def _embeds_as_features(self, request: ExecuteModelRequest) -> ExecuteModelRequest:
        if same_objects(request.specs, self._last[0]) and not request.finished_req_ids:
            return msgspec.structs.replace(request, specs=self._last[1])
        for rid in request.finished_req_ids:
            self._wire.pop(rid, None)
        if not self._wire and all(s.prompt_embeds is None for s in request.specs):
            return request
        specs = []
        for rid, spec in zip(request.req_ids, request.specs, strict=True):
            entry = self._wire.get(rid)
            if spec.prompt_embeds is None:
                specs.append(spec)
            elif entry is not None and entry[0] is spec:
                specs.append(entry[1])
            else:
                wire = embeds_feature(spec)
                self._wire[rid] = (spec, wire)
                specs.append(wire)
        return msgspec.structs.replace(request, specs=specs)


__all__ = ["EMBEDS_MODALITY", "StoreChannel", "UnsupportedItem", "content_key",
           "features_to_refs", "item_to_wire"]
