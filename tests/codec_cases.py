"""Hypothesis strategies for every wire message of protocol major 3, and the tensor
count the codec tests use (tests/test_codec.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch
from hypothesis import strategies as st
from nested import tensors

from protocol.messages import (
    CheckIn,
    Delta,
    DeltaBody,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    MMItem,
    NewRequest,
    RareBody,
    Rows,
    Snapshot,
    SnapshotBody,
    SnapshotRequest,
    Spec,
    encode_spec,
)
from protocol.packing import pack_uints
from protocol.params import (
    LoRASpec,
    PoolingSpec,
    RepetitionDetectionSpec,
    SamplingSpec,
    StructuredOutputsSpec,
)

# ---------------------------------------------------------------- strategies

ints = st.integers(-(2**63), 2**64 - 1)  # every int msgpack carries
u64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 2**31)
text = st.text(max_size=6)
floats = st.floats(allow_nan=False, width=64)
packed = st.lists(st.integers(0, 2**40), max_size=12).map(pack_uints)
maybe_packed = st.just(b"") | packed
int_lists = st.lists(st.integers(-(2**31), 2**31), max_size=4)
json_like = st.recursive(
    st.none() | st.booleans() | ints | floats | text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
    max_leaves=6,
)


nested_tensors = st.recursive(
    tensors() | st.integers(0, 9) | text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
    max_leaves=5,
)

_SAMPLING_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(2, 8), "presence_penalty": floats, "frequency_penalty": floats,
    "repetition_penalty": floats, "temperature": floats, "watermarking": st.booleans(),
    "top_p": floats, "top_k": st.integers(-1, 1000), "min_p": floats, "seed": ints,
    "stop": st.lists(text, max_size=3), "stop_token_ids": int_lists,
    "ignore_eos": st.booleans(), "max_tokens": st.none() | small, "min_tokens": small,
    "logprobs": st.none() | small, "prompt_logprobs": small,
    "prompt_logprob_token_ids": st.lists(int_lists, max_size=2),
    "prompt_logprob_start": small, "logprob_token_ids": int_lists,
    "flat_logprobs": st.booleans(), "detokenize": st.booleans(),
    "skip_special_tokens": st.booleans(), "spaces_between_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "output_kind": st.integers(0, 2),
    "stream_interval": small, "skip_clone": st.booleans(),
    "output_text_buffer_length": small, "eos_token_id": small,
    "all_stop_token_ids": int_lists, "watermarking_skipped": st.booleans(),
    "structured_outputs": st.builds(StructuredOutputsSpec, json=st.none() | text,
                                    regex=st.none() | text, choice=st.none() | st.lists(text),
                                    disable_any_whitespace=st.booleans()),
    "logit_bias": st.dictionaries(st.integers(0, 2**17), floats, max_size=3),
    "allowed_token_ids": int_lists, "extra_args": st.dictionaries(text, json_like, max_size=3),
    "bad_words": st.lists(text, max_size=3), "bad_words_token_ids": st.lists(int_lists, max_size=2),
    "skip_reading_prefix_cache": st.booleans(), "thinking_token_budget": small,
    "repetition_detection": st.builds(RepetitionDetectionSpec, small, small, small),
    "routed_experts_prompt_start": small, "trace_decode_token_ids": int_lists,
}  # fmt: skip
sampling_specs = st.fixed_dictionaries({}, optional=_SAMPLING_VALUES).map(
    lambda fields: SamplingSpec(**fields)
)
pooling_specs = st.fixed_dictionaries({}, optional={
    "use_activation": st.booleans(), "dimensions": small, "task": text,
    "returned_token_ids": int_lists, "requires_token_ids": st.booleans(),
    "extra_kwargs": st.dictionaries(text, json_like, max_size=2), "output_kind": small,
}).map(lambda fields: PoolingSpec(**fields))  # type: ignore[arg-type]  # fmt: skip
lora_specs = st.builds(LoRASpec, lora_name=text, lora_int_id=small, lora_path=text,
                       base_model_name=st.none() | text, load_inplace=st.booleans())
mm_items = st.builds(MMItem, modality=text, identifier=text, offset=small, length=small,
                     mm_hash=st.none() | text)
specs = st.builds(
    Spec, req_id=text, prompt=maybe_packed, prompt_none=st.booleans(),
    sampling=st.none() | sampling_specs, pooling=st.none() | pooling_specs,
    lora=st.none() | lora_specs, mm=st.lists(mm_items, max_size=2).map(tuple),
    prompt_is_token_ids=st.none() | st.lists(st.booleans(), max_size=4).map(tuple),
    embeds=st.none() | st.tuples(text, st.lists(small, max_size=3).map(tuple)),
)
new_requests = st.builds(
    NewRequest, handle=st.integers(0, 2**24), spec=specs.map(encode_spec), computed=small,
    output=maybe_packed, mm_data=st.lists(st.none() | nested_tensors, max_size=2).map(tuple),
    mm_embed=st.lists(st.none() | tensors(), max_size=2).map(tuple),
    embeds=st.none() | tensors(),
)
rows = st.builds(Rows, keys=maybe_packed, counts=maybe_packed, values=maybe_packed)
RARE_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "finished_unknown": st.lists(text, max_size=2).map(tuple), "schedule_full": packed,
    "block_replace": st.lists(rows, max_size=2).map(tuple), "truncate": rows,
    "encoder_inputs": rows, "preempted": packed, "resumed": packed,
    "free_encoder_mm_hashes": st.lists(text, max_size=2).map(tuple), "blocks_to_zero": packed,
    "num_spec_tokens_to_schedule": small,
}  # fmt: skip
rare_bodies = st.fixed_dictionaries({}, optional=RARE_VALUES).map(lambda f: RareBody(**f))
DELTA_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "finished": packed, "added": st.lists(new_requests, max_size=2).map(tuple),
    "schedule_drop": packed, "schedule_append": packed, "scheduled_tokens": rows,
    "computed_tokens": rows, "block_append": st.lists(rows, max_size=2).map(tuple),
    "tokens": rows, "spec_tokens": rows, "has_structured_output": st.booleans(),
    "pending_structured_output": st.booleans(), "rare": rare_bodies,
    "extension": st.dictionaries(text, st.binary(max_size=8), max_size=2).map(
        msgspec.msgpack.encode),
}  # fmt: skip
delta_bodies = st.fixed_dictionaries({}, optional=DELTA_VALUES).map(lambda f: DeltaBody(**f))
snapshot_bodies = st.builds(
    SnapshotBody, token_mode=st.integers(0, 1), kv_groups=st.integers(1, 4),
    requests=st.lists(new_requests, max_size=2).map(tuple),
    blocks=st.lists(rows, max_size=2).map(tuple), schedule=maybe_packed,
    scheduled_tokens=maybe_packed,
)
MESSAGES: dict[type[Message], st.SearchStrategy[Any]] = {
    Hello: st.builds(Hello, ints, ints, major=ints, minor=ints, features=ints, role=text,
                     rank=ints, config=text, version=text),
    Goodbye: st.builds(Goodbye, ints, ints, reason=text),
    Heartbeat: st.builds(Heartbeat, ints, ints, digest=u64),
    Delta: st.builds(Delta, ints, ints, digest=u64, body=delta_bodies),
    Snapshot: st.builds(Snapshot, ints, ints, digest=u64, body=snapshot_bodies),
    CheckIn: st.builds(CheckIn, ints, ints, rank=ints, state=text, token_hash=u64,
                       token_hash_seq=ints, pid=ints),
    SnapshotRequest: st.builds(SnapshotRequest, ints, ints, rank=ints),
}
any_message = st.one_of(list(MESSAGES.values()))


def count_tensors(obj: Any) -> int:
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return 1
    if isinstance(obj, msgspec.Struct):
        return sum(count_tensors(getattr(obj, f)) for f in obj.__struct_fields__)
    if isinstance(obj, (list, tuple)):
        return sum(map(count_tensors, obj))
    if isinstance(obj, dict):
        return sum(map(count_tensors, obj.values()))
    return 0
