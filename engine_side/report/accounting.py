"""Per-field byte accounting of a deltacast message and of the pickled baseline.

deltacast: frame 0 is ``[tag, epoch, seq, digest, {body map}]``.  msgpack map
entries are encoded independently and concatenated, so each body entry's size
(key + value) is exact; whatever frame 0 holds beyond the entries is the
header.  Inside new requests the ids, prompt tokens and prefix references are
split out the same way.  Tensor frames count as their own category.  The
categories therefore always sum to the measured message size.

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
from protocol.messages import Delta, DeltaBody, NewRequest
from protocol.tensors import make_enc_hook

CATEGORIES = ("header", "new requests", "prompt tokens", "prefix references", "ids", "tokens",
              "blocks", "schedule changes", "extension slot", "tensor frames")

# DeltaBody short key -> category (keys not listed are "schedule changes").
_BODY_CATEGORY = {
    "a": "new requests", "fx": "ids", "ot": "tokens", "tr": "tokens", "sp": "tokens",
    "ba": "blocks", "br": "blocks", "bz": "blocks", "x": "extension slot",
}
# NewRequest short key -> category split out of "new requests".
_ADD_CATEGORY = {"i": "ids", "p": "prompt tokens", "ph": "prefix references",
                 "pl": "prefix references"}


def _sizer() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=make_enc_hook([]))


def _entries(struct: msgspec.Struct, enc: msgspec.msgpack.Encoder) -> dict[str, int]:
    """Encoded size of each present (non-default) map entry of a sparse Struct, by short key."""
    sizes: dict[str, int] = {}
    for field in msgspec.structs.fields(struct):
        value = getattr(struct, field.name)
        default = field.default if field.default is not msgspec.NODEFAULT else (
            field.default_factory() if field.default_factory is not msgspec.NODEFAULT else None)
        if field.required or value != default:
            sizes[field.encode_name] = len(enc.encode(field.encode_name)) + len(enc.encode(value))
    return sizes


def _split_adds(adds: Sequence[NewRequest], enc: msgspec.msgpack.Encoder,
                out: dict[str, int]) -> None:
    """Move ids / prompt tokens / prefix references out of the "new requests" entry."""
    for add in adds:
        for key, size in _entries(add, enc).items():
            category = _ADD_CATEGORY.get(key)
            if category is not None:
                out[category] += size
                out["new requests"] -= size


def delta_breakdown(delta: Delta, frames: Sequence[Any]) -> dict[str, int]:
    """Bytes of ``delta`` (encoded as ``frames``) per category; sums to the message size."""
    enc = _sizer()
    out = dict.fromkeys(CATEGORIES, 0)
    body_entries = _entries(delta.body, enc)
    for key, size in body_entries.items():
        out[_BODY_CATEGORY.get(key, "schedule changes")] += size
    _split_adds(delta.body.added, enc, out)
    frame0 = len(frames[0])
    out["header"] = frame0 - sum(body_entries.values())
    out["tensor frames"] = encoded_size(frames) - frame0
    return out


def body_field_sizes(body: DeltaBody) -> dict[str, int]:
    """Encoded size of each present DeltaBody entry, by short key (for tests and tables)."""
    return field_sizes(body)


def field_sizes(struct: msgspec.Struct) -> dict[str, int]:
    """Encoded size of each present entry of any sparse (map-encoded) Struct, by short key."""
    return _entries(struct, _sizer())


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
