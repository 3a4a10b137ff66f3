"""The vLLM schema this adapter was built for (vLLM 0.32.x), and its own wire Structs.

Schema pinning: :func:`check_schema` compares the field lists of every vLLM
class the adapter maps with the lists below and raises :class:`SchemaMismatch`
naming the class and field when they differ.  A new vLLM field would otherwise
be dropped silently on the way to the workers.

The wire Structs carry what ``ExecuteModelRequest`` has no column for.  They
are msgpack maps with short keys and ``omit_defaults``, so a field that matches
its prediction costs nothing; integer lists are :mod:`protocol.packing` bytes.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Literal

import msgspec
import numpy as np

from protocol.errors import (
    DECODE_ERRORS,
    LocalProtocolError,
    MalformedMessage,
    ProtocolError,
    malformed,
)
from protocol.packing import pack_uints, unpack_uints
from protocol.speedups import C as _C
from protocol.tensors import make_ext_hook

SUPPORTED_VLLM = "0.32"  # vLLM minor series this schema was read from

PINNED: dict[str, tuple[str, ...]] = {
    "SchedulerOutput": (
        "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
        "total_num_scheduled_tokens", "scheduled_spec_decode_tokens", "scheduled_encoder_inputs",
        "finished_req_ids", "free_encoder_mm_hashes", "scheduled_encoder_input_stats",
        "preempted_req_ids", "has_structured_output_requests",
        "pending_structured_output_tokens", "num_invalid_spec_tokens", "kv_connector_metadata",
        "has_sync_kv_loads", "aux_output_connector_metadata", "ec_connector_metadata",
        "ec_manager_metadata", "new_block_ids_to_zero", "kv_cache_block_copies",
        "kv_connector_block_state", "num_spec_tokens_to_schedule", "num_common_prefix_blocks"),
    "NewRequestData": (
        "req_id", "prompt_token_ids", "mm_features", "sampling_params", "pooling_params",
        "block_ids", "num_computed_tokens", "lora_request", "prompt_embeds",
        "prompt_is_token_ids", "prefill_token_ids", "replay_start"),
    "CachedRequestData": (
        "req_ids", "resumed_req_ids", "new_token_ids", "all_token_ids", "new_block_ids",
        "num_computed_tokens", "num_output_tokens"),
    "ScheduledEncoderInputStats": ("num_inputs", "output_tokens"),
    "SamplingParams": (
        "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
        "watermarking", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
        "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
        "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids",
        "flat_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "output_kind", "stream_interval", "skip_clone",
        "output_text_buffer_length", "_eos_token_id", "_all_stop_token_ids",
        "_watermarking_skipped", "structured_outputs", "logit_bias", "allowed_token_ids",
        "extra_args", "bad_words", "_bad_words_token_ids", "skip_reading_prefix_cache",
        "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start",
        "trace_decode_token_ids"),
    "StructuredOutputsParams": (
        "json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
        "disable_additional_properties", "whitespace_pattern", "structural_tag", "_backend",
        "_backend_was_auto"),
    "RepetitionDetectionParams": ("max_pattern_size", "min_pattern_size", "min_count"),
    "PoolingParams": (
        "use_activation", "dimensions", "step_tag_id", "returned_token_ids", "task",
        "requires_token_ids", "skip_reading_prefix_cache", "late_interaction_params",
        "extra_kwargs", "output_kind"),
    "LateInteractionParams": ("mode", "query_key", "query_uses"),
    "LoRARequest": (
        "lora_name", "lora_int_id", "lora_path", "base_model_name", "load_inplace",
        "is_3d_lora_weight"),
    "MultiModalFeatureSpec": ("data", "modality", "identifier", "mm_position", "mm_hash"),
    "PlaceholderRange": ("offset", "length", "is_embed"),
    "GrammarOutput": ("structured_output_request_ids", "grammar_bitmask", "num_acceptable_drafts"),
    "ModelRunnerOutput": (
        "req_ids", "req_id_to_index", "sampled_token_ids", "logprobs", "prompt_logprobs_dict",
        "prompt_token_id_logprobs_dict", "pooler_output", "kv_connector_output",
        "ec_connector_output", "num_nans_in_logits", "cudagraph_stats",
        "aux_output_connector_output", "sampling_masks"),
    "LogprobsLists": (
        "logprob_token_ids", "logprobs", "sampled_token_ranks", "cu_num_generated_tokens"),
    "LogprobsTensors": (
        "logprob_token_ids", "logprobs", "selected_token_ranks", "cu_num_generated_tokens",
        "cu_num_generated_tokens_tensor"),
    "SamplingMaskLists": ("token_ids", "offsets", "cu_num_generated_tokens"),
    "KVConnectorOutput": (
        "finished_sending", "finished_recving", "kv_connector_stats", "kv_cache_events",
        "kv_connector_worker_meta", "invalid_block_ids", "failed_recving",
        "expected_finished_count"),
    "KVCacheBlockCopy": ("src_block_id", "dst_block_id"),
}


class SchemaMismatch(LocalProtocolError):
    """The installed vLLM has a field (or lacks one) this adapter does not know."""


def field_names(cls: type) -> tuple[str, ...]:
    """Field names of a dataclass, msgspec Struct or NamedTuple class."""
    if hasattr(cls, "__struct_fields__"):
        return tuple(cls.__struct_fields__)
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return tuple(getattr(cls, "_fields", ()))


def vllm_classes() -> dict[str, type]:
    """The installed vLLM's classes named in :data:`PINNED`."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.pooling_params import LateInteractionParams, PoolingParams
    from vllm.sampling_params import (
        RepetitionDetectionParams,
        SamplingParams,
        StructuredOutputsParams,
    )
    from vllm.v1 import outputs as out
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched import output as so

    found: dict[str, type] = {
        "SamplingParams": SamplingParams, "StructuredOutputsParams": StructuredOutputsParams,
        "RepetitionDetectionParams": RepetitionDetectionParams, "PoolingParams": PoolingParams,
        "LateInteractionParams": LateInteractionParams, "LoRARequest": LoRARequest,
        "MultiModalFeatureSpec": MultiModalFeatureSpec, "PlaceholderRange": PlaceholderRange,
        "KVCacheBlockCopy": KVCacheBlockCopy,
    }
    for name in PINNED:
        if name not in found:
            found[name] = getattr(so, name, None) or getattr(out, name)
    return found


def check_schema(classes: dict[str, type] | None = None) -> None:
    """Refuse (SchemaMismatch naming class and field) a vLLM this adapter was not built for."""
    classes = vllm_classes() if classes is None else classes
    for name, pinned in PINNED.items():
        actual = field_names(classes[name])
        for extra in [f for f in actual if f not in pinned]:
            raise SchemaMismatch(f"vLLM {name} has field {extra!r} unknown to this adapter "
                                 f"(built for vLLM {SUPPORTED_VLLM}.x)", cls=name, field=extra)
        for missing in [f for f in pinned if f not in actual]:
            raise SchemaMismatch(f"vLLM {name} lacks field {missing!r} this adapter maps "
                                 f"(built for vLLM {SUPPORTED_VLLM}.x)", cls=name, field=missing)


# ---------------------------------------------------------------- adapter wire Structs


class _Map(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Base: sparse map, defaults omitted."""


class TokenRef(_Map, frozen=True):
    """A token list as ``prompt[:p] + ledger[:l] + tail`` (references tokens workers hold)."""

    p: int = 0
    l: int = 0  # noqa: E741 - wire key
    t: bytes = b""


#: SamplingParams' float fields, which vLLM also accepts as ints (NewFix.int_floats)
FloatField = Literal["presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"]
#: the dtype of a prompt_logprob_token_ids ndarray: integers, either byte order ("": a list)
IntDtype = Literal["", "|i1", "<i2", "<i4", "<i8", ">i2", ">i4", ">i8",
                   "|u1", "<u2", "<u4", "<u8", ">u2", ">u4", ">u8"]


class NewFix(_Map, frozen=True):
    """Per new request: what its RequestSpec cannot say exactly (index into the new list).
    Its names are typed: a worker decodes no other (MalformedMessage)."""

    i: int
    int_floats: tuple[FloatField, ...] = msgspec.field(default=(), name="f")
    logprob_ids_dtype: IntDtype = msgspec.field(default="", name="d")
    lora_3d: bool | None = msgspec.field(default=None, name="l3")
    replay_start: int = msgspec.field(default=0, name="r")


class StepExt(_Map, frozen=True):
    """Departures of one SchedulerOutput from what the decoder predicts (``extension["v"]``)."""

    kv_groups: int = msgspec.field(default=0, name="kg")
    new_flip: bytes = msgspec.field(default=b"", name="nf")
    new_order: bytes = msgspec.field(default=b"", name="no")
    cached_order: bytes = msgspec.field(default=b"", name="co")
    none_flip: bytes = msgspec.field(default=b"", name="bn")
    out_pos: bytes = msgspec.field(default=b"", name="op")
    out_delta: bytes = msgspec.field(default=b"", name="od")
    new_tokens: tuple[bytes, bytes] | None = msgspec.field(default=None, name="nt")
    all_keys: bytes | None = msgspec.field(default=None, name="ak")
    all_tokens: tuple[TokenRef, ...] = msgspec.field(default=(), name="at")
    prefill: tuple[TokenRef | None, ...] = msgspec.field(default=(), name="pf")
    fixes: tuple[NewFix, ...] = msgspec.field(default=(), name="fx")
    spec_keys: bytes | None = msgspec.field(default=None, name="sk")
    enc_keys: bytes | None = msgspec.field(default=None, name="ek")
    total: int = msgspec.field(default=-1, name="tt")
    preempted_none: bool = msgspec.field(default=False, name="pn")
    zero_empty: bool = msgspec.field(default=False, name="ze")
    enc_stats: tuple[int, int] | None = msgspec.field(default=None, name="es")
    invalid_spec: dict[str, int] | None = msgspec.field(default=None, name="is")
    sync_kv: bool = msgspec.field(default=False, name="sy")
    block_copies: bytes | None = msgspec.field(default=None, name="bc")
    prefix_blocks: bytes | None = msgspec.field(default=None, name="cb")
    sealed: bytes = msgspec.field(default=b"", name="k")


class Deflated(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An integer array as zlib-deflated little-endian bytes (sparse grammar bitmasks)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


MAX_INFLATED = 1 << 28  # bytes a Deflated may claim; larger is MalformedMessage


def deflate_sparse(a: Any, min_bytes: int = 256) -> Deflated | None:
    """``a`` deflated when it is an integer ndarray that deflating at least halves."""
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu" or a.nbytes < min_bytes:
        return None
    raw = np.ascontiguousarray(a).tobytes()
    packed = zlib.compress(raw, 1)
    return Deflated(a.dtype.str, a.shape, packed) if 2 * len(packed) <= len(raw) else None


def inflate(d: Deflated) -> Any:
    """A fresh writable array; MalformedMessage unless the bytes match dtype and shape."""
    dtype, count = int_array_type(d.dtype, d.shape, "deflated array")
    size = count * dtype.itemsize
    unzip = zlib.decompressobj()
    try:
        raw = unzip.decompress(d.data, size + 1)
    except zlib.error as exc:
        raise MalformedMessage("deflated array: corrupt data", cause=str(exc)) from exc
    if len(raw) != size or not unzip.eof:
        raise MalformedMessage("deflated array: length mismatch", expected=size, got=len(raw))
    return np.frombuffer(raw, dtype).reshape(d.shape).copy()


#: integer arrays up to this size are deflated (zlib finds the rows many requests share);
#: larger ones (a real vocabulary: 4,009 words a row at 128k tokens) are sent as
#: SparseWords, measured 5x faster than zlib there (``engine_side.bench.bitmask``)
DEFLATE_MAX = 16 << 10


class SparseWords(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An integer array as its rows' background words and the words that differ.

    Row ``r`` (``shape[0]`` rows; one row for a 1-D array) is all-zero words when bit
    ``r`` of ``background`` is 0 and all-one words when it is 1, except at the flat
    positions ``p_k = p_{k-1} + gaps[k] + 1`` (``p_{-1} = -1``), which hold ``values``
    (raw words of ``dtype``, in position order).
    """

    dtype: str
    shape: tuple[int, ...]
    background: bytes  # packed uints, one 0/1 per row
    gaps: bytes  # packed uints, one per exception
    values: bytes


def compact_ways(a: Any) -> tuple[Deflated | None, SparseWords | None]:
    """(deflated, sparse words) of an integer array, the way its size picks: sparse
    words above :data:`DEFLATE_MAX` bytes, deflated up to it; None where that way does
    not halve it (then it travels raw)."""
    if getattr(a, "nbytes", 0) > DEFLATE_MAX:
        return None, sparse_words(a)
    return deflate_sparse(a), None


def sparse_words(a: Any) -> SparseWords | None:
    """``a`` as SparseWords when it is a non-empty integer ndarray that this halves at least."""
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu" or a.size == 0:
        return None
    rows = np.ascontiguousarray(a.reshape(a.shape[0] if a.ndim > 1 else 1, -1))
    scanned = None
    if _C is not None and a.dtype.isnative and rows.flags.aligned:
        scanned = _C.sparse_scan(rows, rows.shape[0], a.itemsize)
    background, gaps, values = scanned if scanned is not None else scan_py(rows)
    if 2 * len(values) > a.nbytes:
        return None
    return SparseWords(a.dtype.str, a.shape, pack_uints(np.frombuffer(background, np.uint8)),
                       pack_uints(np.frombuffer(gaps, np.int64)), values)


def scan_py(rows: Any) -> tuple[bytes, bytes, bytes]:
    """(one byte per row: 1 when more than half its words are all ones, else 0; the gaps
    between the flat positions of the words that differ from their row's background,
    as int64; those words' bytes): the reference of the C ``sparse_scan``."""
    zero: Any = np.zeros((), rows.dtype)
    ones = rows == ~zero
    background = np.add.reduce(ones, axis=1) * 2 > rows.shape[1]
    at = np.flatnonzero(np.where(background[:, None], ~ones, rows != 0))
    gaps = np.diff(at, prepend=-1) - 1
    return (background.astype(np.uint8).tobytes(), gaps.astype(np.int64).tobytes(),
            rows.ravel()[at].tobytes())


def expand(w: SparseWords) -> Any:
    """A fresh writable array; MalformedMessage unless rows, positions and words fit
    dtype and shape."""
    dtype, size = int_array_type(w.dtype, w.shape, "sparse words")
    rows = w.shape[0] if len(w.shape) > 1 else 1
    background = unpack_uints(w.background, limit=max(rows, 1))
    gaps = unpack_uints(w.gaps, limit=max(size, 1))
    if not w.shape or background.size != rows or int(background.max(initial=0)) > 1:
        raise MalformedMessage("sparse words: bad background", rows=rows)
    if gaps.size * dtype.itemsize != len(w.values) or int(gaps.max(initial=0)) >= size:
        raise MalformedMessage("sparse words: gaps and values disagree", count=gaps.size)
    at = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if at.size and int(at[-1]) >= size:
        raise MalformedMessage("sparse words: position out of range", size=size)
    zero: Any = np.zeros((), dtype)
    fill = np.where(background.astype(bool), ~zero, zero).astype(dtype)
    out = np.repeat(fill, size // rows if rows else 0)
    out[at] = np.frombuffer(w.values, dtype)
    return out.reshape(w.shape)


_DTYPES: dict[str, np.dtype[Any]] = {}  # integer dtypes by the names peers sent


def int_array_type(name: str, shape: tuple[int, ...], what: str) -> tuple[np.dtype[Any], int]:
    """(dtype, element count) of an integer array a peer describes; MalformedMessage for
    a bad dtype, a negative dimension or more than MAX_INFLATED bytes."""
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        try:
            dtype = np.dtype(name)
        except TypeError as exc:
            raise MalformedMessage(f"{what}: bad dtype", dtype=name[:20]) from exc
        if dtype.kind in "iu" and len(_DTYPES) < 64:
            _DTYPES[name] = dtype
    size = math.prod(shape)
    if dtype.kind not in "iu" or min(shape, default=0) < 0 or size * dtype.itemsize > MAX_INFLATED:
        raise MalformedMessage(f"{what}: bad dtype or shape", shape=shape[:8])
    return dtype, size


class RowRefs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A 2-D integer bitmask as one reference per row (see :mod:`engine_side.vllm.rowrefs`).

    ``refs`` (packed, one per row): below ``table``, a row of the receiver's row table
    (which then MUST hold exactly ``table`` rows of this dtype and width); from
    ``table`` on, the fresh rows the message carries, each first used in order.  The
    fresh rows travel raw in ``fresh``, or -- ``fresh`` empty -- as the GrammarMsg's
    deflated or sparse (k, words) array.
    """

    dtype: str
    shape: tuple[int, ...]
    table: int
    refs: bytes
    fresh: bytes


class GrammarMsg(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """sample_tokens(GrammarOutput): request ids as positions in step ``seq``'s batch.

    The bitmask is a zero-copy frame, or nil with ``deflated`` set (up to
    :data:`DEFLATE_MAX` bytes) or ``sparse`` set (larger) when that halves it at
    least (a bitmask is mostly 0 and -1 words).  With ``rows`` set, those ways carry
    only the fresh rows (none: no way) and ``rows`` the references that rebuild it.
    """

    seq: int
    positions: bytes
    names: tuple[str, ...]
    bitmask: Any
    drafts: list[int] | None = None
    deflated: Deflated | None = None
    sparse: SparseWords | None = None
    rows: RowRefs | None = None


class LogprobsWire(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """LogprobsLists / LogprobsTensors fields (arrays travel as zero-copy frames)."""

    token_ids: Any
    logprobs: Any
    ranks: Any
    cu: list[int] | None = None
    cu_tensor: Any = None


class KVOutputWire(_Map, frozen=True):
    """KVConnectorOutput: typed id sets; connector objects sealed."""

    sending: list[str] | None = msgspec.field(default=None, name="s")
    recving: list[str] | None = msgspec.field(default=None, name="r")
    invalid_blocks: list[int] = msgspec.field(default_factory=list, name="ib")
    failed: list[str] = msgspec.field(default_factory=list, name="fr")
    expected: int = msgspec.field(default=0, name="e")
    sealed: bytes = msgspec.field(default=b"", name="k")


class ReplyMsg(_Map, frozen=True):
    """ModelRunnerOutput, worker → engine; request ids as positions in step ``seq``'s batch."""

    seq: int = msgspec.field(name="q")
    positions: bytes = msgspec.field(default=b"", name="p")
    names: tuple[str, ...] = msgspec.field(default=(), name="n")
    index_map: bytes | None = msgspec.field(default=None, name="x")
    counts: bytes = msgspec.field(default=b"", name="c")
    tokens: bytes = msgspec.field(default=b"", name="t")
    logprobs: LogprobsWire | None = msgspec.field(default=None, name="lp")
    prompt_lp: tuple[tuple[int, LogprobsWire | None], ...] = msgspec.field(default=(), name="pl")
    prompt_tid: tuple[tuple[int, Any], ...] = msgspec.field(default=(), name="pt")
    pooler: list[Any] | None = msgspec.field(default=None, name="po")
    kv: KVOutputWire | None = msgspec.field(default=None, name="kv")
    nans: tuple[tuple[int, int], ...] | None = msgspec.field(default=None, name="nn")
    masks: tuple[Any, Any, list[int] | None] | None = msgspec.field(default=None, name="sm")
    sealed: bytes = msgspec.field(default=b"", name="k")
    none: bool = msgspec.field(default=False, name="z")


def decode_frames(frames: list[Any], single: msgspec.msgpack.Decoder[Any], kind: type,
                  what: str) -> Any:
    """Frame 0 of a GrammarMsg or ReplyMsg as ``kind``, its tensors from the other frames
    (copied); ``single`` serves one-frame messages (no hook state to set up).  Raises
    MalformedMessage naming ``what`` for frames that do not decode."""
    if not frames:
        raise MalformedMessage(f"{what} without frames")
    decoder = single if len(frames) == 1 else \
        msgspec.msgpack.Decoder(kind, ext_hook=make_ext_hook(frames[1:], copy=True))
    try:
        return decoder.decode(frames[0])
    except ProtocolError:
        raise
    except DECODE_ERRORS as exc:
        raise malformed(f"{what} frames do not decode", exc) from exc
