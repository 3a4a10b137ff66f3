"""vLLM's request parameters → deltacast's typed specs (the engine's half).

``SamplingParams`` → ``SamplingSpec`` (private normalised fields included, so the
worker's :mod:`worker_side.vllm.params` rebuilds one equal in every field),
``PoolingParams``, ``LoRARequest``, structured outputs; :class:`SpecReader` caches
the conversion of repeated parameters; :func:`request_entry` reads a whole new
request into the mirror's :class:`Entry` and its exactness fixes.
"""

from __future__ import annotations

import copy
import functools
from operator import attrgetter
from typing import Any, cast, get_args

import msgspec
import numpy as np

from engine_side.mirror import Entry
from engine_side.vllm.mm import item_to_wire
from protocol.errors import LocalProtocolError
from protocol.ext import FloatField, IntDtype, NewFix
from protocol.messages import MMItem, Spec
from protocol.packing import pack_uints
from protocol.params import (
    PER_REQUEST_FIELDS,
    LoRASpec,
    PoolingSpec,
    RepetitionDetectionSpec,
    SamplingSpec,
    StructuredOutputsSpec,
)

_FLOAT_FIELDS: tuple[FloatField, ...] = get_args(FloatField)
_INT_DTYPES = frozenset(get_args(IntDtype))
_SPEC_FIELDS = SamplingSpec.__struct_fields__
#: distinct sampling parameters remembered (then all forgotten)
SAMPLING_CACHE = 64


def _structured_to_spec(so: Any) -> StructuredOutputsSpec | None:
    if so is None:
        return None
    return StructuredOutputsSpec(
        json=so.json, regex=so.regex, choice=so.choice, grammar=so.grammar,
        json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
        disable_additional_properties=so.disable_additional_properties,
        whitespace_pattern=so.whitespace_pattern, structural_tag=so.structural_tag,
        backend=so._backend, backend_was_auto=so._backend_was_auto)


@functools.cache
def _sampling_reader(cls: type) -> attrgetter[Any]:
    """One C call reading a SamplingParams class's values in ``SamplingSpec`` field order."""
    return attrgetter(*(name if hasattr(cls, name) else "_" + name for name in _SPEC_FIELDS))


def sampling_to_spec(sp: Any) -> tuple[SamplingSpec, tuple[FloatField, ...], IntDtype]:
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
    dtype: IntDtype = ""
    plt = values["prompt_logprob_token_ids"]
    if isinstance(plt, np.ndarray):
        if plt.dtype.str not in _INT_DTYPES:
            raise LocalProtocolError("prompt_logprob_token_ids must hold integer token ids",
                                     dtype=plt.dtype.str)
        dtype, values["prompt_logprob_token_ids"] = cast(IntDtype, plt.dtype.str), plt.tolist()
    return SamplingSpec(**values), int_floats, dtype


class SpecReader:
    """:func:`sampling_to_spec` that reuses an earlier result for parameters that encode
    to the same msgpack bytes but for their ``PER_REQUEST_FIELDS``, which it sets on the
    result (SamplingSpec is frozen: sharing it is safe; an int and a float,
    or 0.0 and -0.0, encode differently).  Parameters msgspec cannot encode are converted
    every time."""

    _encode = msgspec.msgpack.Encoder().encode

    def __init__(self) -> None:
        self._read: dict[bytes, tuple[SamplingSpec, tuple[FloatField, ...], IntDtype]] = {}

    def read(self, sp: Any) -> tuple[SamplingSpec, tuple[FloatField, ...], IntDtype]:
        own = {f: getattr(sp, f, None) for f in PER_REQUEST_FIELDS}
        shared = sp
        if any(v is not None for v in own.values()) and isinstance(sp, msgspec.Struct):
            shared = copy.copy(sp)  # (msgspec's C-level __copy__: no __post_init__)
            for f in PER_REQUEST_FIELDS:
                msgspec.structs.force_setattr(shared, f, None)
        try:
            key = self._encode(shared)
        except (TypeError, ValueError, msgspec.EncodeError):
            return sampling_to_spec(sp)
        out = self._read.get(key)
        if out is None:
            out = sampling_to_spec(shared)
            if len(self._read) >= SAMPLING_CACHE:
                self._read.clear()
            self._read[key] = out
        if shared is not sp:
            return msgspec.structs.replace(out[0], **own), out[1], out[2]
        return out


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


def lora_to_spec(lr: Any) -> tuple[LoRASpec | None, bool | None]:
    if lr is None:
        return None, None
    spec = LoRASpec(lora_name=lr.lora_name, lora_int_id=lr.lora_int_id, lora_path=lr.lora_path,
                    base_model_name=lr.base_model_name, load_inplace=lr.load_inplace)
    return spec, (lr.is_3d_lora_weight or None)


def request_entry(nr: Any, index: int, reader: SpecReader) -> tuple[Entry, NewFix | None, int]:
    """(the mirror entry of a new request, its exactness fixes if any, its prompt length)."""
    sampling: SamplingSpec | None = None
    int_floats: tuple[FloatField, ...] = ()
    dtype: IntDtype = ""
    if nr.sampling_params is not None:
        sampling, int_floats, dtype = reader.read(nr.sampling_params)
    lora, is_3d = lora_to_spec(nr.lora_request)
    prompt, embeds = nr.prompt_token_ids, nr.prompt_embeds
    features = nr.mm_features
    mm = tuple(MMItem(f.modality, f.identifier, f.mm_position.offset, f.mm_position.length,
                      f.mm_hash) for f in features)
    spec = Spec(req_id=nr.req_id, prompt=b"" if prompt is None else pack_uints(prompt),
                prompt_none=prompt is None, sampling=sampling,
                pooling=pooling_to_spec(nr.pooling_params), lora=lora, mm=mm,
                prompt_is_token_ids=None if nr.prompt_is_token_ids is None
                else tuple(nr.prompt_is_token_ids),
                embeds=None if embeds is None else (str(embeds.dtype), tuple(embeds.shape)))
    entry = Entry(spec, nr.num_computed_tokens,
                  mm_data=tuple(item_to_wire(f.data) for f in features) if features else (),
                  mm_embed=tuple(f.mm_position.is_embed for f in features) if features else (),
                  embeds=embeds)
    fix = NewFix(index, int_floats, dtype, is_3d, nr.replay_start)
    plen = len(prompt) if prompt is not None else 0 if embeds is None else int(embeds.shape[0])
    return entry, None if fix == NewFix(index) else fix, plen
