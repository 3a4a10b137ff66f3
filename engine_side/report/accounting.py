"""Per-field byte accounting of a deltacast message and of the pickled baseline.

deltacast: frame 0 is ``[tag, epoch, seq, digest, {body map}]``.  msgpack map
entries are encoded independently and concatenated, so each body entry's size
(key + value), read off the encoded bytes themselves, is exact; whatever frame 0
holds beyond the entries is the header.
Nested maps are split the same way: each added request's spec (its own msgpack
bytes, :class:`protocol.messages.Spec`) gives up its id and prompt tokens, the
:class:`RareBody` its entries, and -- for :func:`message_fields` -- the vLLM
adapter's :class:`protocol.ext.StepExt` in the extension slot its fields; the
framing of a nested map (its key and map header) is header.  Tensor frames count
as their own category.  The categories therefore always sum to the measured size.

pickle baselines: pickle memoises repeated objects, so field sizes are not
additive; each top-level part is pickled on its own and the remainder
(framing, memo references) is reported as ``framing``.  The sum still equals
the measured size, but the split is an estimate -- labelled as such.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any

import msgspec

from protocol.codec import encoded_size
from protocol.ext import StepExt, decode_ext
from protocol.messages import Delta, DeltaBody, RareBody, decode_spec
from protocol.tensors import make_enc_hook

CATEGORIES = ("header", "new requests", "prompt tokens", "ids", "counts", "tokens", "blocks",
              "schedule changes", "extension slot", "tensor frames")

# DeltaBody short key -> category ("a" and "r" are split further).
_BODY_CATEGORY = {
    "f": "schedule changes", "a": "new requests", "sd": "schedule changes",
    "sa": "schedule changes", "nt": "counts", "nc": "counts", "ba": "blocks", "ot": "tokens",
    "sp": "tokens", "so": "schedule changes", "ps": "schedule changes", "x": "extension slot",
}
# RareBody short key -> category.
_RARE_CATEGORY = {
    "fx": "ids", "sf": "schedule changes", "br": "blocks", "tr": "tokens",
    "ei": "schedule changes", "pe": "schedule changes", "rs": "schedule changes",
    "fm": "ids", "bz": "blocks", "ns": "schedule changes",
}
# Spec short key -> category split out of "new requests".
_SPEC_CATEGORY = {"i": "ids", "p": "prompt tokens"}
_ITEMS = msgspec.msgpack.Decoder(list[msgspec.Raw])
_ENTRIES = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_SPECS = msgspec.msgpack.Decoder(list[dict[str, msgspec.Raw]])  # a NewRequest's entries
_KEY = msgspec.msgpack.Encoder()


def _split(data: Any) -> dict[str, int]:
    """Bytes of each entry (key + value) of the msgpack map ``data``, by key, read off
    the bytes themselves (exact: what the encoder wrote, defaults and all)."""
    return {k: len(_KEY.encode(k)) + len(v) for k, v in _ENTRIES.decode(data).items()}


def _body(frame0: Any) -> msgspec.Raw:
    """The raw body map of a Delta's frame 0 (``[tag, epoch, seq, digest, body]``)."""
    items = _ITEMS.decode(frame0)
    if len(items) != 5:
        raise ValueError(f"frame 0 is not a Delta with a body ({len(items)} items)")
    return items[-1]


def _raw_entries(raw: msgspec.Raw) -> dict[str, msgspec.Raw]:
    return _ENTRIES.decode(raw)


def _spec_parts(added: msgspec.Raw) -> dict[str, int]:
    """Bytes of the ids and prompt tokens (by Spec short key) inside the specs of the
    raw added requests: each spec is decoded as a :class:`Spec` (it must be one) and its
    entries sized as sent."""
    out = dict.fromkeys(_SPEC_CATEGORY, 0)
    for new in _SPECS.decode(added):
        spec = new["s"]
        decode_spec(spec)  # a real Spec, or msgspec's error
        for key, size in _split(spec).items():
            if key in out:
                out[key] += size
    return out


def delta_breakdown(delta: Delta, frames: Sequence[Any]) -> dict[str, int]:
    """Bytes of ``delta`` (encoded as ``frames``) per category; sums to the message size."""
    out = dict.fromkeys(CATEGORIES, 0)
    frame0 = _buffer(frames[0])
    body = _raw_entries(_body(frame0))
    entries = 0
    for key, raw in body.items():
        size = len(_KEY.encode(key)) + len(raw)
        entries += size
        if key == "r":
            rare = _split(raw)
            for rkey, rsize in rare.items():
                out[_RARE_CATEGORY.get(rkey, "schedule changes")] += rsize
            out["header"] += size - sum(rare.values())  # the nested map's key and header
            continue
        out[_BODY_CATEGORY.get(key, "schedule changes")] += size
        if key == "a":
            for skey, ssize in _spec_parts(raw).items():
                out[_SPEC_CATEGORY[skey]] += ssize
                out["new requests"] -= ssize
    out["header"] += len(frame0) - entries
    out["tensor frames"] = encoded_size(frames) - len(frame0)
    return out


def message_fields(kind: str, frames: Sequence[Any]) -> dict[str, int]:
    """Exact bytes of one vLLM request-path message per wire field; sums to the frames'
    total size.

    ``execute_model`` (a Delta): each present body entry by its DeltaBody field name;
    the rare entries as ``rare.NAME``, the added requests' ids and prompt tokens as
    ``added.req_id`` and ``added.prompt`` (the rest of them stays ``added``), the
    extension slot per :class:`StepExt` field as ``ext.NAME``; ``header`` the message
    header and the framing of the nested maps, ``tensor frames`` any frames after the
    first.  ``sample_tokens``: one ``grammar`` entry, the frames' bytes.
    """
    total = encoded_size(frames)
    if kind == "sample_tokens":
        return {"grammar": total}
    if kind != "execute_model":
        raise ValueError(f"not a request-path message kind: {kind!r}")
    frame0 = _buffer(frames[0])
    body = _raw_entries(_body(frame0))
    out: dict[str, int] = {"header": len(frame0)}
    for key, raw in body.items():
        size = len(_KEY.encode(key)) + len(raw)
        out["header"] -= size
        if key == "r":
            parts = _named(RareBody, "rare.", _split(raw))
        elif key == "x":
            extension = msgspec.msgpack.decode(raw, type=bytes)
            decode_ext(extension)  # a real StepExt, or MalformedMessage
            parts = _named(StepExt, "ext.", _split(extension) if extension else {})
        elif key == "a":
            spec = _spec_parts(raw)
            parts = {f"added.{_SPEC_NAMES[k]}": v for k, v in spec.items() if v}
            parts["added"] = size - sum(parts.values())
        else:
            parts = _named(DeltaBody, "", {key: size})
        out.update(parts)
        out["header"] += size - sum(parts.values())  # nested framing: key, map header
    if total > len(frame0):
        out["tensor frames"] = total - len(frame0)
    return out


_SPEC_NAMES = {"i": "req_id", "p": "prompt"}  # message_fields: "added.req_id", ...


def _named(kind: type[msgspec.Struct], prefix: str, sizes: dict[str, int]) -> dict[str, int]:
    """``sizes`` by short key -> by ``prefix`` + the Struct's attribute name."""
    names = {f.encode_name: f.name for f in msgspec.structs.fields(kind)}
    return {prefix + names.get(k, k): v for k, v in sizes.items()}


def _buffer(frame: Any) -> bytes | memoryview:
    data = frame.buffer if hasattr(frame, "buffer") else frame
    return data if isinstance(data, bytes) else memoryview(data).cast("B")


def body_field_sizes(body: DeltaBody) -> dict[str, int]:
    """Encoded size of each present DeltaBody entry, by short key (for tests and tables)."""
    return field_sizes(body)


def field_sizes(struct: msgspec.Struct) -> dict[str, int]:
    """Encoded size of each entry of any sparse (map-encoded) Struct as it encodes, by
    short key."""
    aux: list[Any] = []
    return _split(msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux)).encode(struct))


# -- pickle baseline ---------------------------------------------------------------------
_V1_PARTS = {
    "scheduled_new_reqs": "new requests",
    "num_scheduled_tokens": "ids",
    "finished_req_ids": "ids",
    "scheduled_spec_decode_tokens": "tokens",
    "scheduled_encoder_inputs": "schedule changes",
    "kv_connector_metadata": "extension slot",
}
_CACHED_PARTS = {
    "req_ids": "ids", "new_token_ids": "tokens", "all_token_ids": "tokens",
    "new_block_ids": "blocks", "num_computed_tokens": "counters", "num_output_tokens": "counters",
    "resumed_req_ids": "ids",
}
PICKLE_CATEGORIES = ("framing", "new requests", "ids", "counters", "tokens", "blocks",
                     "schedule changes", "extension slot")


class _IncrementalPickler:
    """Sizes parts pickled one after another through one memo, so repeats cost a reference."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._pickler = pickle.Pickler(self._buf, protocol=5)
        self._overhead = len(pickle.dumps(None, protocol=5)) - 1  # PROTO + STOP per dump

    def size(self, obj: Any) -> int:
        before = self._buf.tell()
        self._pickler.dump(obj)
        return max(0, self._buf.tell() - before - self._overhead)


def pickle_v1_breakdown(scheduler_output: Any, total: int) -> dict[str, int]:
    """Estimated split of a pickled SchedulerOutput RPC message (sums to ``total``)."""
    out = dict.fromkeys(PICKLE_CATEGORIES, 0)
    sizer = _IncrementalPickler()
    cached = scheduler_output.scheduled_cached_reqs
    parts = [(cached, n, c) for n, c in _CACHED_PARTS.items()]
    parts += [(scheduler_output, n, c) for n, c in _V1_PARTS.items()]
    for owner, name, category in parts:
        value = getattr(owner, name, None)
        if value:
            out[category] += sizer.size(value)
    out["framing"] = total - sum(out.values())
    return out
