"""vLLM objects ⇄ deltacast's typed ones, plus what both adapter ends must share.

Shared by the engine-side encoder and the worker-side decoder: parameter
conversion (``SamplingParams`` ⇄ ``SamplingSpec`` ...), token references,
the per-step memory whose predictions both ends compute identically, and the
HMAC seal for opaque connector objects (the only pickle in the adapter: the MAC
is checked with ``hmac.compare_digest`` before anything is unpickled).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import pickle
from collections.abc import Iterable
from operator import attrgetter, itemgetter
from typing import Any

import msgspec
import numpy as np

from engine_side.vllm.mm import features_to_refs
from engine_side.vllm.schema import NewFix, TokenRef
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.packing import int64_array, pack_sints, pack_uints, unpack_sints, unpack_uint_list
from protocol.params import (
    LoRASpec,
    PoolingSpec,
    RepetitionDetectionSpec,
    SamplingSpec,
    StructuredOutputsSpec,
)
from protocol.request import IntArray, RequestSpec
from protocol.speedups import C as _C

_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                 "top_p", "min_p")
_SPEC_FIELDS = SamplingSpec.__struct_fields__
#: SamplingSpec fields whose type admits a list (a decoded spec holds its declared types,
#: so no other field can hold one)
_LIST_FIELDS = frozenset(f.name for f in msgspec.structs.fields(SamplingSpec)
                         if "list" in repr(f.type))
_MAC_BYTES = 32


class BadSeal(RemoteProtocolError):
    """A sealed (HMAC-authenticated) payload whose MAC does not verify; nothing was unpickled."""


def _bare(cls: Any, **values: Any) -> Any:
    """An instance of a vLLM class with exactly ``values`` (no ``__post_init__`` re-run)."""
    try:
        obj = cls.__new__(cls)
    except TypeError:  # a plain msgspec Struct: construct, then overwrite every field
        obj = cls(**values)
    setter = msgspec.structs.force_setattr if isinstance(obj, msgspec.Struct) \
        else object.__setattr__
    for name, value in values.items():
        setter(obj, name, value)
    return obj


# ---------------------------------------------------------------- SamplingParams
def _structured_to_spec(so: Any) -> StructuredOutputsSpec | None:
    if so is None:
        return None
    return StructuredOutputsSpec(
        json=so.json, regex=so.regex, choice=so.choice, grammar=so.grammar,
        json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
        disable_additional_properties=so.disable_additional_properties,
        whitespace_pattern=so.whitespace_pattern, structural_tag=so.structural_tag,
        backend=so._backend, backend_was_auto=so._backend_was_auto)


def _structured_from_spec(spec: StructuredOutputsSpec | None) -> Any:
    if spec is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    values = {f: getattr(spec, f) for f in StructuredOutputsSpec.__struct_fields__}
    values["_backend"] = values.pop("backend")
    values["_backend_was_auto"] = values.pop("backend_was_auto")
    return _bare(StructuredOutputsParams, **values)


@functools.cache
def _sampling_reader(cls: Any) -> attrgetter[Any]:
    """One C call reading a SamplingParams class's values in ``SamplingSpec`` field order
    (vLLM keeps some of them private: ``_all_stop_token_ids`` ...)."""
    return attrgetter(*(name if hasattr(cls, name) else "_" + name for name in _SPEC_FIELDS))


@functools.cache
def _spec_reader() -> tuple[tuple[str, ...], attrgetter[Any], tuple[str, ...]]:
    """SamplingParams' fields, one C call reading them from a ``SamplingSpec``, and
    those that may hold a list."""
    from vllm.sampling_params import SamplingParams

    names = SamplingParams.__struct_fields__
    lists = tuple(name for name in names if name.lstrip("_") in _LIST_FIELDS)
    return names, attrgetter(*(name.lstrip("_") for name in names)), lists


def sampling_to_spec(sp: Any) -> tuple[SamplingSpec, tuple[str, ...], str]:
    """(spec, float fields holding ints, dtype of an ndarray prompt_logprob_token_ids)."""
    cls: Any = type(sp)
    values = dict(zip(_SPEC_FIELDS, _sampling_reader(cls)(sp), strict=True))
    int_floats = tuple(f for f in _FLOAT_FIELDS if type(values[f]) is int)
    for f in int_floats:
        values[f] = float(values[f])
    values["output_kind"] = int(values["output_kind"].value)
    values["all_stop_token_ids"] = sorted(values["all_stop_token_ids"])
    values["structured_outputs"] = _structured_to_spec(values["structured_outputs"])
    rd = values["repetition_detection"]
    if rd is not None:
        values["repetition_detection"] = RepetitionDetectionSpec(
            rd.max_pattern_size, rd.min_pattern_size, rd.min_count)
    dtype = ""
    plt = values["prompt_logprob_token_ids"]
    if isinstance(plt, np.ndarray):
        dtype, values["prompt_logprob_token_ids"] = plt.dtype.str, plt.tolist()
    return SamplingSpec(**values), int_floats, dtype


def spec_to_sampling(spec: SamplingSpec, int_floats: Iterable[str] = (), dtype: str = "") -> Any:
    """A fresh ``SamplingParams`` equal in every field (private ones included)."""
    from vllm.sampling_params import RepetitionDetectionParams, RequestOutputKind, SamplingParams

    names, read, lists = _spec_reader()
    values = dict(zip(names, read(spec), strict=True))
    for name in lists:  # the caller's lists are its own: fresh ones
        v = values[name]
        if isinstance(v, list):
            values[name] = list(v)
    for f in int_floats:
        values[f] = int(values[f])
    values["output_kind"] = RequestOutputKind(values["output_kind"])
    values["_all_stop_token_ids"] = set(values["_all_stop_token_ids"])
    values["structured_outputs"] = _structured_from_spec(spec.structured_outputs)
    rd = spec.repetition_detection
    if rd is not None:
        values["repetition_detection"] = RepetitionDetectionParams(
            rd.max_pattern_size, rd.min_pattern_size, rd.min_count)
    if dtype and values["prompt_logprob_token_ids"] is not None:
        values["prompt_logprob_token_ids"] = np.array(values["prompt_logprob_token_ids"],
                                                      dtype=np.dtype(dtype))
    return _bare(SamplingParams, **values)


#: distinct sampling parameters the engine and worker conversions remember (then forget all)
SAMPLING_CACHE = 64


class SamplingMaker:
    """:func:`spec_to_sampling` that copies an earlier result when a spec encodes to the
    same bytes (requests mostly share a few parameter sets): a C-level copy with fresh
    lists and sets, instead of ~40 field writes.  Specs holding nested objects, dicts or
    lists of lists are always made afresh, so no two results share a mutable object."""

    _NESTED = ("structured_outputs", "logit_bias", "extra_args", "repetition_detection",
               "prompt_logprob_token_ids", "bad_words_token_ids")
    _encode = msgspec.msgpack.Encoder().encode
    _nested = staticmethod(attrgetter(*_NESTED))
    _NONE = (None,) * len(_NESTED)

    def __init__(self) -> None:
        #: (spec bytes, int floats) -> (a made SamplingParams, its list and set fields)
        self._made: dict[tuple[bytes, tuple[str, ...]], tuple[Any, tuple[str, ...]]] = {}

    def make(self, spec: SamplingSpec, int_floats: tuple[str, ...] = (), dtype: str = "") -> Any:
        if self._nested(spec) != self._NONE or dtype:
            return spec_to_sampling(spec, int_floats, dtype)
        key = (self._encode(spec), tuple(int_floats))
        known = self._made.get(key)
        if known is not None:  # (__copy__ runs no __init__ or __post_init__)
            return _own_containers(known[0].__copy__(), known[1])
        made = spec_to_sampling(spec, int_floats, dtype)
        if len(self._made) >= SAMPLING_CACHE:
            self._made.clear()
        names = _container_fields(made)
        self._made[key] = (_own_containers(made.__copy__(), names), names)
        return made


def _container_fields(sp: Any) -> tuple[str, ...]:
    """The fields of ``sp`` holding a list or a set."""
    return tuple(name for name in _spec_reader()[2]
                 if isinstance(getattr(sp, name), list | set))


def _own_containers(sp: Any, names: tuple[str, ...]) -> Any:
    """``sp`` with fresh copies of its list and set fields ``names`` (the callers' own)."""
    for name in names:
        value = getattr(sp, name)
        msgspec.structs.force_setattr(sp, name, type(value)(value))
    return sp


# ---------------------------------------------------------------- pooling, LoRA
def pooling_to_spec(pp: Any) -> PoolingSpec | None:
    if pp is None:
        return None
    li = pp.late_interaction_params
    return PoolingSpec(
        use_activation=pp.use_activation, dimensions=pp.dimensions, step_tag_id=pp.step_tag_id,
        returned_token_ids=pp.returned_token_ids, task=pp.task,
        requires_token_ids=pp.requires_token_ids,
        skip_reading_prefix_cache=pp.skip_reading_prefix_cache,
        late_interaction_params=None if li is None else msgspec.structs.asdict(li),
        extra_kwargs=pp.extra_kwargs, output_kind=int(pp.output_kind.value))


def spec_to_pooling(spec: PoolingSpec | None) -> Any:
    if spec is None:
        return None
    from vllm.pooling_params import LateInteractionParams, PoolingParams
    from vllm.sampling_params import RequestOutputKind

    values = {f: getattr(spec, f) for f in PoolingSpec.__struct_fields__}
    li = values["late_interaction_params"]
    values["late_interaction_params"] = None if li is None else _bare(LateInteractionParams, **li)
    values["output_kind"] = RequestOutputKind(values["output_kind"])
    return _bare(PoolingParams, **values)


def lora_to_spec(lr: Any) -> tuple[LoRASpec | None, bool | None]:
    if lr is None:
        return None, None
    spec = LoRASpec(lora_name=lr.lora_name, lora_int_id=lr.lora_int_id, lora_path=lr.lora_path,
                    base_model_name=lr.base_model_name, load_inplace=lr.load_inplace)
    return spec, (lr.is_3d_lora_weight or None)


def spec_to_lora(spec: LoRASpec | None, is_3d: bool | None) -> Any:
    if spec is None:
        return None
    from vllm.lora.request import LoRARequest

    return _bare(LoRARequest, lora_name=spec.lora_name, lora_int_id=spec.lora_int_id,
                 lora_path=spec.lora_path, base_model_name=spec.base_model_name,
                 load_inplace=spec.load_inplace, is_3d_lora_weight=bool(is_3d))


class SpecReader:
    """:func:`sampling_to_spec` that returns an earlier result again for SamplingParams
    encoding to the same msgpack bytes (SamplingSpec is frozen: sharing it is safe; an
    int and a float, or 0.0 and -0.0, encode differently).  Parameters msgspec cannot
    encode (an ndarray field, say) are converted every time."""

    _encode = msgspec.msgpack.Encoder().encode

    def __init__(self) -> None:
        self._read: dict[bytes, tuple[SamplingSpec, tuple[str, ...], str]] = {}

    def read(self, sp: Any) -> tuple[SamplingSpec, tuple[str, ...], str]:
        try:
            key = self._encode(sp)
        except (TypeError, ValueError, msgspec.EncodeError):
            return sampling_to_spec(sp)
        out = self._read.get(key)
        if out is None:
            out = sampling_to_spec(sp)
            if len(self._read) >= SAMPLING_CACHE:
                self._read.clear()
            self._read[key] = out
        return out


def new_request_spec(nr: Any, index: int, reader: SpecReader | None = None,
                     ) -> tuple[RequestSpec, NewFix | None]:
    """The RequestSpec of a NewRequestData and, if needed, its exactness fixes."""
    read = sampling_to_spec if reader is None else reader.read
    sampling, int_floats, dtype = (None, (), "") if nr.sampling_params is None else \
        read(nr.sampling_params)
    lora, is_3d = lora_to_spec(nr.lora_request)
    prompt = None
    if nr.prompt_token_ids is not None:
        prompt = int64_array(nr.prompt_token_ids)
        prompt.flags.writeable = False
    pit = None if nr.prompt_is_token_ids is None else tuple(nr.prompt_is_token_ids)
    spec = RequestSpec(nr.req_id, prompt, sampling, pooling_to_spec(nr.pooling_params), lora,
                       features_to_refs(nr.mm_features), nr.prompt_embeds, pit)
    fix = NewFix(index, int_floats, dtype, is_3d, nr.replay_start)
    return spec, (None if fix == NewFix(index) else fix)


# ---------------------------------------------------------------- token references
class TokenLedger:
    """Tokens the workers are known to hold per live request (sampled, as replied)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def extend(self, req_id: str, tokens: list[int]) -> None:
        self.tokens.setdefault(req_id, []).extend(tokens)

    def get(self, req_id: str) -> list[int]:
        return self.tokens.get(req_id, [])

    def forget(self, req_id: str) -> None:
        self.tokens.pop(req_id, None)


def _common(a: list[int], b: IntArray | list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def make_ref(tokens: list[int], prompt: IntArray | None, ledger: list[int]) -> TokenRef:
    """``tokens`` as a prompt prefix, then a ledger prefix, then an explicit tail."""
    p = 0 if prompt is None else _common(tokens, prompt)
    full_prompt = prompt is not None and p == len(prompt)
    held = _common(tokens[p:], ledger) if full_prompt else 0
    rest = tokens[p + held:]
    return TokenRef(p, held, pack_sints(rest) if rest else b"")


def resolve_ref(ref: TokenRef, prompt: IntArray | None, ledger: list[int]) -> list[int]:
    if ref.p > (0 if prompt is None else len(prompt)) or ref.l > len(ledger):
        raise RemoteProtocolError("token reference beyond what this worker holds",
                                  prompt=ref.p, ledger=ref.l)
    head = [] if prompt is None else prompt[:ref.p].tolist()
    tail = unpack_sints(ref.t).tolist() if ref.t else []
    return head + ledger[:ref.l] + tail


# ---------------------------------------------------------------- shared step memory
class StepMemory:
    """What both ends remember of previous steps; predictions are computed from it only."""

    def __init__(self, ledger: TokenLedger | None = None) -> None:
        self.known: set[str] = set()  # scheduled at least once, not finished since
        self.prompt: dict[str, IntArray | None] = {}
        self.plen: dict[str, int] = {}
        self.table_len: list[dict[str, int]] = []  # per KV group (decoder side)
        self.prev_batch: set[str] = set()
        self._plen_ids: list[str] | None = None
        self._plen_col: IntArray = np.zeros(0, dtype=np.int64)
        self.mrv2 = False  # Model Runner V2 stream (new requests carry prefill_token_ids)
        self.ledger = ledger

    def finish(self, ids: Iterable[str]) -> None:
        for rid in ids:
            self._plen_ids = None
            self.known.discard(rid)
            self.prompt.pop(rid, None)
            self.plen.pop(rid, None)
            for lens in self.table_len:
                lens.pop(rid, None)
            if self.ledger is not None:
                self.ledger.forget(rid)

    def remember(self, spec: RequestSpec) -> None:
        """A (re)sent request's prompt, for token references and output predictions."""
        prompt = spec.prompt_token_ids
        self._plen_ids = None
        self.prompt[spec.req_id] = prompt
        if prompt is not None:
            self.plen[spec.req_id] = int(prompt.size)
        else:
            embeds = spec.prompt_embeds
            self.plen[spec.req_id] = 0 if embeds is None else int(embeds.shape[0])

    def held(self, rid: str) -> list[int]:
        return [] if self.ledger is None else self.ledger.get(rid)

    def predicted_outputs(self, ids: list[str], computed: IntArray) -> IntArray:
        """num_output_tokens of cached requests: tokens past the prompt, last one uncomputed."""
        if ids != self._plen_ids:  # steady decode repeats the list: reuse the column
            self._plen_ids = list(ids)
            self._plen_col = np.fromiter(map(self.plen.__getitem__, ids), np.int64, len(ids))
        return np.maximum(0, computed - self._plen_col + 1)

    def output_departures(self, ids: list[str], computed: IntArray,
                          outputs: Any) -> tuple[bytes, bytes] | None:
        """(positions, deltas) packed where cached requests' ``outputs`` depart from
        :meth:`predicted_outputs`; None when none does."""
        diff = np.asarray(outputs, dtype=np.int64) - self.predicted_outputs(ids, computed)
        off = np.flatnonzero(diff)
        return (pack_uints(off), pack_sints(diff[off])) if off.size else None

    def record_output(self, out: Any) -> None:
        """A ModelRunnerOutput's sampled tokens into the ledger (nothing without one)."""
        ledger, known = self.ledger, self.known
        if ledger is None:
            return
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids, strict=False):
            if rid in known:
                ledger.extend(rid, tokens)


def cached_order(positions: list[int], batch: list[str], resumed: set[str]) -> list[int]:
    """vLLM lists running requests first, then resumed ones (each in batch order)."""
    if not resumed:
        return positions
    return ([i for i in positions if batch[i] not in resumed]
            + [i for i in positions if batch[i] in resumed])


# ---------------------------------------------------------------- replies' lists
def single_items(rows: Any) -> list[Any] | None:
    """``[row[0] for row in rows]`` when ``rows`` is a list of one-item lists (a step's
    sampled tokens, one per request), else None (C when built)."""
    if _C is not None:
        return _C.single_items(rows)
    return single_items_py(rows)


def single_items_py(rows: Any) -> list[Any] | None:
    """:func:`single_items` without the speedups (the reference)."""
    if type(rows) is not list or any(type(r) is not list or len(r) != 1 for r in rows):
        return None
    return [r[0] for r in rows]


def singletons(items: list[Any]) -> list[list[Any]]:
    """``[[item] for item in items]``: fresh one-item lists (C when built)."""
    made = _C.singletons(items) if _C is not None else None
    return made if made is not None else [[item] for item in items]


def draft_rows(drafts: Any, pos: dict[str, int], n: int) -> tuple[list[int], list[int]] | None:
    """A step's draft tokens (``scheduled_spec_decode_tokens``) as (tokens per batch
    position, every token in dict order), ``pos`` mapping ids to positions; None unless
    non-empty lists keyed in strictly increasing batch order.  One C call when built."""
    got = _C.draft_rows(drafts, pos, n) if _C is not None else None
    return got if got is not None else draft_rows_py(drafts, pos, n)


def draft_rows_py(drafts: Any, pos: dict[str, int], n: int,
                  ) -> tuple[list[int], list[int]] | None:
    """:func:`draft_rows` without the speedups (the reference)."""
    if type(drafts) is not dict:
        return None
    lengths, flat, last = [0] * n, [], -1
    for key, row in drafts.items():
        p = pos.get(key)
        if type(p) is not int or not last < p < n or type(row) is not list or not row:
            return None
        lengths[p] = len(row)
        flat += row
        last = p
    return lengths, flat


def split_rows(keys: list[str], lengths: list[int], flat: list[int]) -> dict[str, list[int]]:
    """``{keys[i]: row i}`` for the rows of non-zero length, rows consecutive in ``flat``
    (fresh lists; a step's draft tokens by request); one C call when built.  The caller
    vouches that the lengths are one per key and add up to ``len(flat)``."""
    got = _C.split_rows(keys, lengths, flat) if _C is not None else None
    return got if got is not None else split_rows_py(keys, lengths, flat)


def split_rows_py(keys: list[str], lengths: list[int], flat: list[int]) -> dict[str, list[int]]:
    """:func:`split_rows` without the speedups (the reference)."""
    out, start = {}, 0
    for key, n in zip(keys, lengths, strict=True):
        if n:
            out[key] = flat[start:start + n]
            start += n
    return out


def index_is_positions(index: dict[str, int], req_ids: list[str]) -> bool:
    """``list(index) == req_ids`` and its values are ``0..n-1`` (vLLM's usual
    req_id_to_index), without building the lists when C is built."""
    if _C is not None:
        got = _C.dict_matches(index, req_ids, list(range(len(req_ids))))
        if got is not None:
            return got == 2
    return list(index) == req_ids and list(index.values()) == list(range(len(index)))


# ---------------------------------------------------------------- sealing
def seal(objects: dict[str, Any], secret: bytes | None) -> bytes:
    """HMAC-SHA256-authenticated pickle of opaque connector objects (``b""`` if none)."""
    if not objects:
        return b""
    if not secret:
        raise LocalProtocolError("connector objects need a shared secret", names=sorted(objects))
    payload = pickle.dumps(objects, protocol=5)
    return hmac.new(secret, payload, hashlib.sha256).digest() + payload


def unseal(blob: bytes, secret: bytes | None) -> dict[str, Any]:
    """Verify then unpickle; raises BadSeal (nothing unpickled) on a bad or missing MAC."""
    if not blob:
        return {}
    if not secret or len(blob) < _MAC_BYTES:
        raise BadSeal("sealed payload without a usable secret or MAC")
    mac, payload = blob[:_MAC_BYTES], blob[_MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(secret, payload, hashlib.sha256).digest()):
        raise BadSeal("sealed payload MAC does not verify")
    objects: dict[str, Any] = pickle.loads(payload)  # authenticated above
    return objects


# ---------------------------------------------------------------- id references
class RefTable:
    """Request ids as small ints: a position in a step's batch, else len(batch) + name index."""

    def __init__(self, batch: list[str], names: list[str]) -> None:
        self.batch = batch
        self.names = names
        self._pos: dict[str, int] | None = None

    def _positions(self) -> dict[str, int]:
        if self._pos is None:
            self._pos = dict(zip(self.batch, range(len(self.batch)), strict=True))
        return self._pos

    def ref(self, rid: str) -> int:
        pos = self._positions()
        i = pos.get(rid)
        if i is None:
            i = len(self.batch) + len(self.names)
            pos[rid] = i
            self.names.append(rid)
        return i

    def refs(self, ids: list[str]) -> list[int]:
        """:meth:`ref` of each id (C-level maps when the table knows them all)."""
        if not ids:
            return []  # (the position map costs microseconds to build: not for nothing)
        known = list(map(self._positions().get, ids))
        return list(map(self.ref, ids)) if None in known else known  # type: ignore[return-value]

    def pack(self, ids: list[str]) -> bytes:
        return pack_uints(self.refs(ids))

    def pairs(self, by_id: dict[str, Any]) -> tuple[tuple[int, Any], ...]:
        """A per-request dict as (ref, value) pairs, in the dict's order."""
        return tuple(zip(self.refs(list(by_id)), by_id.values(), strict=True))

    def named(self, pairs: tuple[tuple[int, Any], ...]) -> dict[str, Any]:
        """Inverse of :meth:`pairs` (refs checked as :meth:`name` checks them)."""
        if not pairs:
            return {}
        names = self.names_of(list(map(itemgetter(0), pairs)))
        return dict(zip(names, map(itemgetter(1), pairs), strict=True))

    def name(self, ref: int) -> str:
        n = len(self.batch)
        if 0 <= ref < n:
            return self.batch[ref]
        if ref < 0 or ref - n >= len(self.names):
            raise RemoteProtocolError("request reference out of range", ref=ref)
        return self.names[ref - n]

    def names_of(self, refs: list[int]) -> list[str]:
        """:meth:`name` of each ref."""
        if not refs or (min(refs) >= 0 and max(refs) < len(self.batch)):
            return list(map(self.batch.__getitem__, refs))  # batch positions only: C-level
        return list(map(self.name, refs))

    def resolve(self, packed: bytes) -> list[str]:
        return self.names_of(unpack_uint_list(packed))
