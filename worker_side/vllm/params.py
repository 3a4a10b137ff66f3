"""deltacast's typed specs → vLLM's request parameters (the worker's half).

A fresh ``SamplingParams`` equal in every field to the engine's (private normalised
fields included), ``PoolingParams``, ``LoRARequest``; :class:`SamplingMaker` copies an
earlier result for a spec seen before (requests mostly share a few parameter sets).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np

from protocol.errors import MalformedMessage, malformed
from protocol.params import (
    PER_REQUEST_FIELDS,
    LoRASpec,
    PoolingSpec,
    SamplingSpec,
    StructuredOutputsSpec,
)

#: SamplingSpec fields whose type admits a list
_LIST_FIELDS = frozenset(f.name for f in msgspec.structs.fields(SamplingSpec)
                         if "list" in repr(f.type))
#: distinct sampling parameters remembered (then all forgotten)
SAMPLING_CACHE = 64


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


def _structured_from_spec(spec: StructuredOutputsSpec | None) -> Any:
    if spec is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    values = {f: getattr(spec, f) for f in StructuredOutputsSpec.__struct_fields__}
    values["_backend"] = values.pop("backend")
    values["_backend_was_auto"] = values.pop("backend_was_auto")
    return _bare(StructuredOutputsParams, **values)


@functools.cache
def _spec_reader() -> tuple[tuple[str, ...], attrgetter[Any], tuple[str, ...]]:
    """SamplingParams' fields, one C call reading them from a ``SamplingSpec``, and
    those that may hold a list."""
    from vllm.sampling_params import SamplingParams

    names = SamplingParams.__struct_fields__
    lists = tuple(name for name in names if name.lstrip("_") in _LIST_FIELDS)
    return names, attrgetter(*(name.lstrip("_") for name in names)), lists


def _output_kind(value: int) -> Any:
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
    for f in int_floats:  # (floats sent for ints the engine's parameters held)
        if not float(values[f]).is_integer():
            raise MalformedMessage("a float field sent as an int holds no int", field=f)
        values[f] = int(values[f])
    values["output_kind"] = _output_kind(values["output_kind"])
    values["_all_stop_token_ids"] = set(values["_all_stop_token_ids"])
    values["structured_outputs"] = _structured_from_spec(spec.structured_outputs)
    rd = spec.repetition_detection
    if rd is not None:
        values["repetition_detection"] = _bare(  # (as the engine's: not validated again)
            RepetitionDetectionParams, max_pattern_size=rd.max_pattern_size,
            min_pattern_size=rd.min_pattern_size, min_count=rd.min_count)
    if dtype and values["prompt_logprob_token_ids"] is not None:
        try:
            values["prompt_logprob_token_ids"] = np.array(values["prompt_logprob_token_ids"],
                                                          dtype=np.dtype(dtype))
        except (OverflowError, ValueError) as exc:
            raise malformed("prompt logprob token ids that are not of their dtype",
                            exc) from exc
    return _bare(SamplingParams, **values)


class SamplingMaker:
    """:func:`spec_to_sampling` that copies an earlier result for a spec seen before (the
    same frozen object, or one encoding to the same bytes but for its
    ``PER_REQUEST_FIELDS``, set on the copy): a C-level copy with fresh lists
    and sets.  Specs holding nested objects, dicts or lists of lists are made afresh, so
    no two results share a mutable object."""

    _NESTED = ("structured_outputs", "logit_bias", "extra_args", "repetition_detection",
               "prompt_logprob_token_ids", "bad_words_token_ids")
    _encode = msgspec.msgpack.Encoder().encode
    _nested = staticmethod(attrgetter(*_NESTED))
    _NONE = (None,) * len(_NESTED)
    _own = staticmethod(attrgetter(*PER_REQUEST_FIELDS))
    _UNSET = dict.fromkeys(PER_REQUEST_FIELDS)

    def __init__(self) -> None:
        self._made: dict[tuple[bytes, tuple[str, ...]], tuple[Any, tuple[str, ...]]] = {}

    def make(self, spec: SamplingSpec, int_floats: tuple[str, ...] = (), dtype: str = "") -> Any:
        if self._nested(spec) != self._NONE or dtype:
            return spec_to_sampling(spec, int_floats, dtype)
        own = self._own(spec)
        per_request = any(v is not None for v in own)
        shared = msgspec.structs.replace(spec, **self._UNSET) if per_request else spec
        key = (self._encode(shared), tuple(int_floats))
        known = self._made.get(key)
        if known is None:
            made = spec_to_sampling(shared, int_floats, dtype)
            if len(self._made) >= SAMPLING_CACHE:
                self._made.clear()
            names = tuple(name for name in _spec_reader()[2]
                          if isinstance(getattr(made, name), list | set))
            known = self._made[key] = (_own_containers(made.__copy__(), names), names)
        else:  # (__copy__ runs no __init__ or __post_init__)
            made = _own_containers(known[0].__copy__(), known[1])
        if per_request:
            for name, value in zip(PER_REQUEST_FIELDS, own, strict=True):
                msgspec.structs.force_setattr(made, name, value)
        return made


def _own_containers(sp: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(sp, name)
        msgspec.structs.force_setattr(sp, name, type(value)(value))
    return sp


def spec_to_pooling(spec: PoolingSpec | None) -> Any:
    if spec is None:
        return None
    from vllm.pooling_params import LateInteractionParams, PoolingParams

    values = {f: getattr(spec, f) for f in PoolingSpec.__struct_fields__}
    li = values["late_interaction_params"]
    values["late_interaction_params"] = None if li is None else _bare(LateInteractionParams, **li)
    values["output_kind"] = _output_kind(values["output_kind"])
    return _bare(PoolingParams, **values)


def spec_to_lora(spec: LoRASpec | None, is_3d: bool | None) -> Any:
    if spec is None:
        return None
    from vllm.lora.request import LoRARequest

    return _bare(LoRARequest, lora_name=spec.lora_name, lora_int_id=spec.lora_int_id,
                 lora_path=spec.lora_path, base_model_name=spec.base_model_name,
                 load_inplace=spec.load_inplace, is_3d_lora_weight=bool(is_3d))
