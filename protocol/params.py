"""Typed per-request parameters: sampling, pooling, LoRA, multimodal references.

Every field of vLLM 0.32's ``SamplingParams`` is modelled, with defaults equal to
the values vLLM holds *after* ``__post_init__`` normalisation (``stop=None``
becomes ``[]`` and so on), so a typical request differs from the defaults in only
a few fields.  These Structs encode as msgpack maps with ``omit_defaults`` and
one- or two-letter keys: a request costs only its non-default fields (the
sparse encoding; ``array_like`` would ignore ``omit_defaults``).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

# Field renames are part of the wire format: never change or reuse a short key.
_SAMPLING_KEYS = {
    "n": "n", "presence_penalty": "pp", "frequency_penalty": "fp",
    "repetition_penalty": "rp", "temperature": "t", "watermarking": "wm",
    "top_p": "tp", "top_k": "tk", "min_p": "mp", "seed": "s", "stop": "st",
    "stop_token_ids": "si", "ignore_eos": "ie", "max_tokens": "mx",
    "min_tokens": "mn", "logprobs": "lp", "prompt_logprobs": "pl",
    "prompt_logprob_token_ids": "pi", "prompt_logprob_start": "ps",
    "logprob_token_ids": "li", "flat_logprobs": "fl", "detokenize": "dt",
    "skip_special_tokens": "ss", "spaces_between_special_tokens": "sb",
    "include_stop_str_in_output": "is", "output_kind": "ok",
    "stream_interval": "sv", "skip_clone": "sc", "output_text_buffer_length": "ob",
    "eos_token_id": "eo", "all_stop_token_ids": "as",
    "watermarking_skipped": "ws", "structured_outputs": "so", "logit_bias": "lb",
    "allowed_token_ids": "at", "extra_args": "ea", "bad_words": "bw",
    "bad_words_token_ids": "bt", "skip_reading_prefix_cache": "sr",
    "thinking_token_budget": "tb", "repetition_detection": "rd",
    "routed_experts_prompt_start": "re", "trace_decode_token_ids": "td",
}


class StructuredOutputsSpec(msgspec.Struct, frozen=True, omit_defaults=True, rename="camel"):
    """vLLM ``StructuredOutputsParams`` (``json`` is a JSON string or a dict)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    backend: str | None = None
    backend_was_auto: bool = False


class RepetitionDetectionSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """vLLM ``RepetitionDetectionParams``."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


#: SamplingSpec fields that vary request by request on a server and from which nothing
#: else is derived (in vLLM's SamplingParams either): both ends convert a parameter set
#: once and set these on each request's copy
PER_REQUEST_FIELDS = ("max_tokens", "seed")


class SamplingSpec(msgspec.Struct, frozen=True, omit_defaults=True, rename=_SAMPLING_KEYS):
    """All fields of vLLM ``SamplingParams``; private ``_x`` fields drop the underscore.

    Defaults are vLLM's post-normalisation values; ``output_kind`` is the
    ``RequestOutputKind`` enum value.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: list[list[int]] | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = 0
    stream_interval: int | None = None
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    eos_token_id: int | None = None
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list)
    watermarking_skipped: bool = False
    structured_outputs: StructuredOutputsSpec | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: RepetitionDetectionSpec | None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        # msgspec's omit_defaults compares float defaults by identity, so a float
        # equal to its default but made elsewhere (vLLM's own 1.0) would be sent.
        # Swap in the default object itself; -0.0 keeps its sign.
        for name, default in _FLOAT_DEFAULTS:
            value = getattr(self, name)
            if value is not default and value == default \
                    and math.copysign(1.0, value) == math.copysign(1.0, default):
                msgspec.structs.force_setattr(self, name, default)


_FLOAT_DEFAULTS = tuple(
    (f.name, f.default) for f in msgspec.structs.fields(SamplingSpec) if type(f.default) is float)


class PoolingSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """vLLM ``PoolingParams`` (``output_kind`` is the enum value, FINAL_ONLY=2)."""

    use_activation: bool | None = None
    dimensions: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    task: str | None = None
    requires_token_ids: bool = False
    skip_reading_prefix_cache: bool | None = None
    late_interaction_params: dict[str, Any] | None = None
    extra_kwargs: dict[str, Any] | None = None
    output_kind: int = 2


class LoRASpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """vLLM ``LoRARequest``: name, integer id and path, plus optional extras."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict[str, Any] | None = None
    load_inplace: bool = False


class MMFeatureRef(msgspec.Struct, frozen=True, omit_defaults=True):
    """One multimodal item of a request (vLLM ``MultiModalFeatureSpec``).

    ``data`` is the processed item (nested dicts/lists of tensors) or None when
    the workers already hold it under ``identifier``; tensors inside travel as
    zero-copy frames.  ``is_embed`` is the placeholder mask, if any.
    """

    modality: str
    identifier: str
    offset: int
    length: int
    mm_hash: str | None = None
    data: Any = None
    is_embed: Any = None
