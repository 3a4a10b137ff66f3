"""The vLLM schema this adapter was built for (vLLM 0.32.x).

Schema pinning: :func:`check_schema` compares the field lists of every vLLM
class the adapter maps with the lists below and raises :class:`SchemaMismatch`
naming the class and field when they differ.  A new vLLM field would otherwise
be dropped silently on the way to the workers.

The wire vocabulary both ends share is :mod:`protocol.ext` and :mod:`protocol.bitmask`.
"""

from __future__ import annotations

import dataclasses

from protocol.errors import LocalProtocolError

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
