"""vLLM's request parameters ⇄ deltacast's typed specs (a part of the adapter both ends share).

``SamplingParams`` ⇄ ``SamplingSpec`` (private normalised fields included, so a
round trip is equal in every field), ``PoolingParams``, ``LoRARequest`` and
structured outputs; :class:`SpecReader` and :class:`SamplingMaker` cache the
conversions of repeated parameters; :func:`new_request_spec` reads a whole
``NewRequestData``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from operator import attrgetter
from typing import Any, cast, get_args

import msgspec
import numpy as np

from engine_side.vllm.mm import features_to_refs
from engine_side.vllm.schema import FloatField, IntDtype, NewFix
from protocol.errors import LocalProtocolError, MalformedMessage
from protocol.packing import int64_array
from protocol.params import (
    LoRASpec,
    PoolingSpec,
    RepetitionDetectionSpec,
    SamplingSpec,
    StructuredOutputsSpec,
)
from protocol.request import RequestSpec

_FLOAT_FIELDS: tuple[FloatField, ...] = get_args(FloatField)
_INT_DTYPES = frozenset(get_args(IntDtype))
_SPEC_FIELDS = SamplingSpec.__struct_fields__
#: SamplingSpec fields whose type admits a list (a decoded spec holds its declared types,
#: so no other field can hold one)
_LIST_FIELDS = frozenset(f.name for f in msgspec.structs.fields(SamplingSpec)
                         if "list" in repr(f.type))


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


def _output_kind(value: int) -> Any:
    """vLLM's RequestOutputKind of a wire value; MalformedMessage for one it lacks."""
    from vllm.sampling_params import RequestOutputKind

    try:
        return RequestOutputKind(value)
    except ValueError:
        raise MalformedMessage("unknown output_kind", value=value) from None


def spec_to_sampling(spec: SamplingSpec, int_floats: Iterable[str] = (), dtype: str = "") -> Any:
    """A fresh ``SamplingParams`` equal in every field (private ones included)."""
    from vllm.sampling_params import RepetitionDetectionParams, SamplingParams

    names, read, lists = _spec_reader()
    values = dict(zip(names, read(spec), strict=True))
    for name in lists:  # the caller's lists are its own: fresh ones
        v = values[name]
        if isinstance(v, list):
            values[name] = list(v)
    for f in int_floats:
        values[f] = int(values[f])
    values["output_kind"] = _output_kind(values["output_kind"])
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

    values = {f: getattr(spec, f) for f in PoolingSpec.__struct_fields__}
    li = values["late_interaction_params"]
    values["late_interaction_params"] = None if li is None else _bare(LateInteractionParams, **li)
    values["output_kind"] = _output_kind(values["output_kind"])
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
        self._read: dict[bytes, tuple[SamplingSpec, tuple[FloatField, ...], IntDtype]] = {}

    def read(self, sp: Any) -> tuple[SamplingSpec, tuple[FloatField, ...], IntDtype]:
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
    sampling: SamplingSpec | None = None
    int_floats: tuple[FloatField, ...] = ()
    dtype: IntDtype = ""
    if nr.sampling_params is not None:
        sampling, int_floats, dtype = read(nr.sampling_params)
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
