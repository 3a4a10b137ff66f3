"""Rebuild the full ``ExecuteModelRequest`` of the last applied step from a replica state.

Cost is O(scheduled requests); nothing proportional to history is copied.
Mutable containers (id and spec lists, computed counts) are fresh on every call.
Arrays that only ever get *replaced* in the state -- block tables, scheduled
counts, step-only rows, token histories -- are shared read-only (writing raises),
so a consumer can neither corrupt the replica nor see a handed-out array change.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np
from msgspec.structs import replace

from protocol.block_cache import flush_block_patches
from protocol.messages import TOKEN_MODE_ENGINE
from protocol.request import ExecuteModelRequest, IntArray, Ragged, RequestSpec

_EMPTY = np.zeros(0, dtype=np.int64)
_REQ_ID = attrgetter("req_id")

if TYPE_CHECKING:
    from protocol.state import ReplicaState


def _ids_and_specs(state: ReplicaState) -> tuple[list[str], list[RequestSpec]]:
    cached: Any = state._rebuild_cache.get("schedule")
    if cached is None:
        specs = list(map(state.specs.__getitem__, state.schedule.tolist()))
        cached = (list(map(_REQ_ID, specs)), specs)
        state._rebuild_cache["schedule"] = cached
    ids, specs = cached
    return list(ids), list(specs)


def _block_table(state: ReplicaState, g: int) -> Ragged:
    """The cached tables themselves: read-only, and never changed once handed out (the
    cache is replaced, not edited), so sharing them costs no copy and aliases nothing
    a consumer can mutate."""
    return Ragged(*cached_block_table(state, g))


def cached_block_table(state: ReplicaState, g: int) -> tuple[IntArray, IntArray]:
    """(lengths, flat values) of the current schedule's tables in group ``g``.

    Shared, cached, read-only arrays; a change installs new arrays.
    """
    key = f"blocks{g}"
    flush_block_patches(state, g)
    cached: Any = state._rebuild_cache.get(key)
    if cached is None or cached[0] is not state.schedule:
        lengths, values = state.blocks[g].gather(state.schedule)
        lengths.flags.writeable = values.flags.writeable = False
        cached = (state.schedule, lengths, values)
        state._rebuild_cache[key] = cached
    _, lengths, values = cached
    return lengths, values


def _tokens(state: ReplicaState) -> list[IntArray] | None:
    if state.token_mode != TOKEN_MODE_ENGINE:
        return None
    return [state.tokens[h].view() for h in state.schedule.tolist()]  # type: ignore[union-attr]


def _names(state: ReplicaState, handles: IntArray) -> frozenset[str]:
    if not handles.size:
        return frozenset()
    return frozenset(state.handle_of(h).req_id for h in handles.tolist())


def rebuild_request(state: ReplicaState) -> ExecuteModelRequest:
    """The last applied step's request; see the module docstring for the aliasing rule.

    The immutable part is cached per step (a template, dropped by every commit), so a
    repeated or steady step only makes the fresh containers.
    """
    cached: Any = state._rebuild_cache.get("template")
    computed = state.scheduled_computed()
    if cached is None or cached[0] is not state.step or cached[1] is not state.schedule:
        if state.token_mode == TOKEN_MODE_ENGINE:  # token views: no template
            return _rebuild_full(state, computed)
        cached = (state.step, state.schedule, _rebuild_full(state, computed))
        state._rebuild_cache["template"] = cached
    template: ExecuteModelRequest = cached[2]
    step = state.step
    return replace(template, req_ids=list(template.req_ids), specs=list(template.specs),
                   num_computed_tokens=computed,
                   blocks_to_zero=None if step.blocks_to_zero is None
                   else step.blocks_to_zero.copy(),
                   extension=dict(step.extension) if step.extension else {})


def _rebuild_full(state: ReplicaState, computed: IntArray) -> ExecuteModelRequest:
    step = state.step
    ids, specs = _ids_and_specs(state)
    return ExecuteModelRequest(
        req_ids=ids,
        specs=specs,
        num_scheduled_tokens=state.nsched,  # read-only, replaced (never edited) on change
        num_computed_tokens=computed,
        block_tables=tuple(_block_table(state, g) for g in range(state.kv_groups)),
        spec_token_ids=step.spec_tokens,  # read-only arrays, decoded fresh for this step
        encoder_inputs=step.encoder_inputs,
        output_token_ids=_tokens(state),
        finished_req_ids=step.finished_ids,
        preempted_req_ids=_names(state, step.preempted),
        resumed_req_ids=_names(state, step.resumed),
        free_encoder_mm_hashes=step.free_encoder_mm_hashes,
        blocks_to_zero=None if step.blocks_to_zero is None else step.blocks_to_zero.copy(),
        has_structured_output_requests=step.has_structured_output,
        pending_structured_output_tokens=step.pending_structured_output,
        num_spec_tokens_to_schedule=step.num_spec_tokens_to_schedule,
        extension=dict(step.extension),
    )
