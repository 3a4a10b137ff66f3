"""What vLLM sends per step, for comparison: the v1 SchedulerOutput and the v0 full request.

``pickle_v1``: vLLM 0.32's multiprocess executor broadcasts
``("execute_model", (scheduler_output,), {}, output_rank)`` through its shared
memory ``MessageQueue``, which pickles with protocol 5 and out-of-band buffers.
The ``SchedulerOutput`` carries new requests in full and running ones as a
``CachedRequestData`` struct-of-lists keyed by string ids.  When ``import vllm``
works the real classes are used (label ``"vllm"``); otherwise the dataclass
copies below (label ``"standin"``), field for field from
``vllm/v1/core/sched/output.py`` of vLLM 0.32.  Sampling parameters travel as our
:class:`SamplingSpec` (a msgspec Struct, as vLLM's ``SamplingParams`` is); they
only matter for new requests.

``pickle``: our ``ExecuteModelRequest`` pickled directly (protocol 5, numpy
arrays out of band): the v0-style "send everything every step" path.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.request import ExecuteModelRequest

PICKLE_PROTOCOL = 5


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any]
    sampling_params: Any
    pooling_params: Any
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: Any
    prompt_embeds: Any = None
    prompt_is_token_ids: list[bool] | None = None
    prefill_token_ids: list[int] | None = None
    replay_start: int = 0


@dataclass
class CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    scheduled_encoder_inputs: dict[str, list[int]]
    finished_req_ids: set[str]
    free_encoder_mm_hashes: list[str]
    scheduled_encoder_input_stats: Any = None
    preempted_req_ids: set[str] | None = None
    has_structured_output_requests: bool = False
    pending_structured_output_tokens: bool = False
    num_invalid_spec_tokens: dict[str, int] | None = None
    kv_connector_metadata: Any = None
    has_sync_kv_loads: bool = False
    aux_output_connector_metadata: Any = None
    ec_connector_metadata: Any = None
    ec_manager_metadata: Any = None
    new_block_ids_to_zero: list[int] | None = None
    kv_cache_block_copies: list[Any] | None = None
    kv_connector_block_state: Any = None
    num_spec_tokens_to_schedule: int = 0
    num_common_prefix_blocks: list[int] = field(default_factory=list)


def v1_classes() -> tuple[str, Any, Any, Any]:
    """(label, SchedulerOutput, NewRequestData, CachedRequestData): vLLM's if importable."""
    try:
        out = importlib.import_module("vllm.v1.core.sched.output")
    except Exception:  # noqa: BLE001 -- a broken vLLM install is as good as none here
        return "standin", SchedulerOutput, NewRequestData, CachedRequestData
    return "vllm", out.SchedulerOutput, out.NewRequestData, out.CachedRequestData


class V1Scheduler:
    """Turns consecutive full requests into the SchedulerOutputs vLLM v1 would send.

    Tracks what vLLM's workers cache per request id: block count and (with
    engine-sent tokens) output length, to emit only new blocks and tokens.
    """

    def __init__(self) -> None:
        self.label, self.output_cls, self.new_cls, self.cached_cls = v1_classes()
        self.known: dict[str, tuple[int, int]] = {}  # req_id -> (blocks, output tokens)

    def convert(self, req: ExecuteModelRequest) -> Any:
        for req_id in req.finished_req_ids:
            self.known.pop(req_id, None)
        tables = [t.to_lists() for t in req.block_tables]
        computed = req.num_computed_tokens.tolist()
        new_reqs, cached = [], _Cached()
        for i, req_id in enumerate(req.req_ids):
            tokens = req.output_token_ids[i] if req.output_token_ids is not None else None
            n_out = len(tokens) if tokens is not None else _output_len(req, i)
            if req_id not in self.known:
                new_reqs.append(self._new(req, i, tables, computed[i]))
            else:
                resumed = req_id in req.resumed_req_ids  # new_block_ids replace the table
                blocks, seen = (0, 0) if resumed else self.known[req_id]
                grown = tuple(t[i][blocks:] for t in tables)
                new_tokens = tokens[seen:].tolist() if tokens is not None else []
                cached.add(req_id, grown if any(grown) else None, new_tokens, computed[i], n_out)
            self.known[req_id] = (len(tables[0][i]), n_out)
        return self._output(req, new_reqs, cached)

    def _new(self, req: ExecuteModelRequest, i: int, tables: list[list[list[int]]],
             computed: int) -> Any:
        spec = req.specs[i]
        prompt = spec.prompt_token_ids
        return self.new_cls(
            req_id=spec.req_id, prompt_token_ids=None if prompt is None else prompt.tolist(),
            mm_features=list(spec.mm_features), sampling_params=spec.sampling,
            pooling_params=spec.pooling, block_ids=tuple(t[i] for t in tables),
            num_computed_tokens=computed, lora_request=spec.lora,
            prompt_embeds=spec.prompt_embeds,
            prompt_is_token_ids=None if spec.prompt_is_token_ids is None
            else list(spec.prompt_is_token_ids))

    def _output(self, req: ExecuteModelRequest, new_reqs: list[Any], cached: _Cached) -> Any:
        ids = req.req_ids
        nsched = dict(zip(ids, req.num_scheduled_tokens.tolist(), strict=True))
        engine_tokens = req.output_token_ids is not None
        return self.output_cls(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=self.cached_cls(
                req_ids=cached.ids, resumed_req_ids=set(req.resumed_req_ids) & set(cached.ids),
                new_token_ids=cached.tokens if engine_tokens else [], all_token_ids={},
                new_block_ids=cached.blocks, num_computed_tokens=cached.computed,
                num_output_tokens=cached.outputs),
            num_scheduled_tokens=nsched,
            total_num_scheduled_tokens=req.total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=_nonempty(ids, req.spec_token_ids.to_lists()),
            scheduled_encoder_inputs=_nonempty(ids, req.encoder_inputs.to_lists()),
            finished_req_ids=set(req.finished_req_ids),
            free_encoder_mm_hashes=list(req.free_encoder_mm_hashes),
            preempted_req_ids=set(req.preempted_req_ids),
            has_structured_output_requests=req.has_structured_output_requests,
            pending_structured_output_tokens=req.pending_structured_output_tokens,
            new_block_ids_to_zero=None if req.blocks_to_zero is None
            else req.blocks_to_zero.tolist(),
            num_spec_tokens_to_schedule=req.num_spec_tokens_to_schedule,
        )


class _Cached:
    """The struct-of-lists of running requests being built."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.blocks: list[tuple[list[int], ...] | None] = []
        self.tokens: list[list[int]] = []
        self.computed: list[int] = []
        self.outputs: list[int] = []

    def add(self, req_id: str, blocks: tuple[list[int], ...] | None, tokens: list[int],
            computed: int, outputs: int) -> None:
        self.ids.append(req_id)
        self.blocks.append(blocks)
        self.tokens.append(tokens)
        self.computed.append(computed)
        self.outputs.append(outputs)


def _output_len(req: ExecuteModelRequest, i: int) -> int:
    """Output tokens of a request in worker-token mode, as vLLM's scheduler counts them."""
    prompt = req.specs[i].prompt_token_ids
    plen = 0 if prompt is None else int(prompt.size)
    return max(0, int(req.num_computed_tokens[i]) + 1 - plen)


def _nonempty(ids: list[str], rows: list[list[int]]) -> dict[str, list[int]]:
    return {req_id: row for req_id, row in zip(ids, rows, strict=True) if row}


def rpc_message(scheduler_output: Any) -> tuple[str, tuple[Any], dict[str, Any], int]:
    """The tuple vLLM's ``collective_rpc`` enqueues for ``execute_model``."""
    return ("execute_model", (scheduler_output,), {}, 0)


def pickle_frames(obj: Any) -> list[bytes | pickle.PickleBuffer]:
    """Protocol-5 pickle with out-of-band buffers, as vLLM's MessageQueue does."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(obj, protocol=PICKLE_PROTOCOL, buffer_callback=buffers.append)
    return [body, *buffers]


def unpickle_frames(frames: Sequence[bytes | pickle.PickleBuffer]) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


def frames_size(frames: Sequence[bytes | pickle.PickleBuffer]) -> int:
    return sum(f.raw().nbytes if isinstance(f, pickle.PickleBuffer) else len(f) for f in frames)
