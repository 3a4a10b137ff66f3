"""Worker side of the batch turnover (engine_side/vllm/turnover.py): requests leave the
batch and new ones join at its end.

A turnover body -- finishes, adds, a schedule drop and append of exactly the adds,
count departures, appended blocks, drafts, preemptions and an extension of new-request
fixes, empty-block flips and output departures -- is applied to the replica as any
body is; the SchedulerOutput is then made from the last batch less the dropped rows
and the body's own rows, instead of rebuilding every table and diffing it against
what the decoder remembers.  It equals the general path's (the tests compare the
two).  :func:`turnover_shaped` decides before anything changes;
:func:`turnover_output` may still answer None after the state changed (a row whose
new-or-cached status differs from the prediction), and the general path then makes
the SchedulerOutput from the applied state.
"""

from __future__ import annotations

from itertools import filterfalse
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace

from engine_side.vllm.forecast import past_prompt
from engine_side.vllm.schema import StepExt
from protocol.lane_lists import add_at
from protocol.messages import DeltaBody
from protocol.packing import unpack_sint_list, unpack_uint_list
from protocol.plan import STEADY_BODY
from worker_side.vllm.quick import NO_EXT

if TYPE_CHECKING:
    from worker_side.vllm.decoder import SchedulerOutputDecoder

_ROWS_OF_ITS_OWN: dict[str, Any] = {"finished": b"", "finished_unknown": (), "added": (),
                    "schedule_drop": b"", "schedule_append": b"", "scheduled_tokens": None,
                    "computed_tokens": None, "block_append": (), "spec_tokens": None,
                    "preempted": b"",
                    "has_structured_output": False, "pending_structured_output": False,
                    "num_spec_tokens_to_schedule": 0, "extension": {}}
_EXT_OF_ITS_OWN: dict[str, Any] = {"fixes": (), "none_flip": b"", "out_pos": b"", "out_delta": b""}


def turnover_shaped(dec: SchedulerOutputDecoder, body: DeltaBody, ext: StepExt) -> bool:
    """Whether ``body`` (with ``ext``) is a turnover body the fast output takes: no
    field but its own, adds without multimodal inputs or embeddings, all of them
    appended to the schedule and nothing else, one KV group."""
    quick, state = dec.quick, dec.state
    if not quick.ready or state is None or state.kv_groups != 1 or dec.items is not None \
            or not (body.schedule_drop or body.added) or len(body.block_append) > 1:
        return False
    if replace(body, **_ROWS_OF_ITS_OWN) != STEADY_BODY or \
            replace(ext, **_EXT_OF_ITS_OWN) != NO_EXT:
        return False
    if any(a.mm_features or a.prompt_embeds is not None for a in body.added):
        return False
    try:
        appended = unpack_uint_list(body.schedule_append) if body.schedule_append else []
    except ValueError:
        return False  # malformed: the state's apply raises it, typed
    return sorted(appended) == sorted(a.handle for a in body.added)


def turnover_output(dec: SchedulerOutputDecoder, body: DeltaBody, ext: StepExt) -> Any:
    """The SchedulerOutput of an applied turnover body; None when a row's status is not
    the predicted one (the general path decides, from the applied state)."""
    state, quick, mem = dec.state, dec.quick, dec.mem
    assert state is not None  # noqa: S101 - checked by turnover_shaped
    step = state.step
    mem.finish(step.finished_ids)
    drop = set(unpack_uint_list(body.schedule_drop)) if body.schedule_drop else set()
    kept = list(filterfalse(drop.__contains__, range(len(quick.batch))))
    stay = list(map(quick.batch.__getitem__, kept))
    sched = state.schedule.tolist()
    n = len(stay)
    joining = [state.specs[h].req_id for h in sched[n:]]  # type: ignore[union-attr]
    known = mem.known
    if not all(map(known.__contains__, stay)) or any(map(known.__contains__, joining)) or \
            (not mem.mrv2 and not mem.prev_batch.issuperset(stay)):
        return None  # not the predicted new and cached rows: the general path
    batch = stay + joining
    computed = state.scheduled_computed()
    counts = computed.tolist()
    rows = _appended(body, sched, n)
    # the stayers' prompt lengths less one, from the last batch's (a prompt is unchanged)
    cached = _cached(ext, stay, counts[:n], rows,
                     list(map(quick.forecast.plen_less_one.__getitem__, kept)))
    news = _new_requests(dec, ext, state, sched, computed, rows, n)
    so = dec.assemble(batch, state.nsched.tolist(), news, cached, _step_request(state), ext, {})
    _remember_lengths(dec, batch, sched, n, rows)
    dec.after_general(batch, counts, so.num_scheduled_tokens)
    return so


def _appended(body: DeltaBody, sched: list[int], n: int) -> dict[int, list[int]]:
    """Batch position -> the ids the body appends to that row's table."""
    if not body.block_append:
        return {}
    rows = body.block_append[0]
    hs = unpack_uint_list(rows.handles)
    counts = unpack_uint_list(rows.counts) if rows.counts else [1] * len(hs)
    values = unpack_uint_list(rows.values)
    at = dict(zip(sched, range(len(sched)), strict=True))
    out, start = {}, 0
    for h, c in zip(hs, counts, strict=True):
        out[at[h]] = values[start:start + c]
        start += c
    return out


def _cached(ext: StepExt, stay: list[str], computed: list[int], rows: dict[int, list[int]],
            plen_less_one: list[int]) -> Any:
    """The stayers' CachedRequestData (the general path's, none resumed): output counts
    past the prompt (``max(computed - plen + 1, 0)``) plus the body's departures."""
    from vllm.v1.core.sched.output import CachedRequestData

    outputs = past_prompt(computed, plen_less_one)
    if ext.out_pos:
        add_at(outputs, unpack_uint_list(ext.out_pos), unpack_sint_list(ext.out_delta))
    new_blocks: list[Any] = [None] * len(stay)
    for k in sorted(rows):
        if k < len(stay):
            new_blocks[k] = (rows[k],)
    for k in unpack_uint_list(ext.none_flip) if ext.none_flip else ():
        new_blocks[k] = None if new_blocks[k] is not None else ([],)
    return CachedRequestData(
        req_ids=stay, resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
        new_block_ids=new_blocks, num_computed_tokens=computed, num_output_tokens=outputs)


def _new_requests(dec: SchedulerOutputDecoder, ext: StepExt, state: Any, sched: list[int],
                  computed: Any, rows: dict[int, list[int]], n: int) -> list[Any]:
    """The joiners' NewRequestData (the decoder's own maker, on their rows alone)."""
    positions = list(range(n, len(sched)))
    specs = {i: state.specs[sched[i]] for i in positions}
    request = SimpleNamespace(specs=specs, num_computed_tokens=computed)
    return dec.new_requests(request, ext, positions, _JoinTables(rows))  # type: ignore[arg-type]


class _JoinTables:
    """The joiners' whole tables (one KV group): their appended rows."""

    def __init__(self, rows: dict[int, list[int]]) -> None:
        self.rows = rows
        self.values = [None]  # one group

    def row(self, g: int, i: int, skip: int = 0) -> list[int]:
        return list(self.rows.get(i, ()))[skip:]


def _step_request(state: Any) -> Any:
    """The step-only fields the SchedulerOutput takes from a rebuilt request."""
    step = state.step
    preempted = frozenset(state.specs[h].req_id for h in step.preempted.tolist())
    return SimpleNamespace(
        spec_token_ids=step.spec_tokens, encoder_inputs=step.encoder_inputs,
        finished_req_ids=step.finished_ids, free_encoder_mm_hashes=(),
        preempted_req_ids=preempted, has_structured_output_requests=step.has_structured_output,
        pending_structured_output_tokens=step.pending_structured_output,
        blocks_to_zero=None, num_spec_tokens_to_schedule=step.num_spec_tokens_to_schedule)


def _remember_lengths(dec: SchedulerOutputDecoder, batch: list[str], sched: list[int],
                      n: int, rows: dict[int, list[int]]) -> None:
    """The decoder's table lengths of the batch (the general path records every row's;
    only the grown and joining rows' changed), read from the applied replica."""
    mem, state = dec.mem, dec.state
    assert state is not None  # noqa: S101 - applied
    if not mem.table_len:
        mem.table_len = [{}]
    lens, now = mem.table_len[0], state.blocks[0].lengths
    for k in {*rows, *range(n, len(batch))}:
        lens[batch[k]] = now.item(sched[k])
    dec.set_last_lengths(batch, [now[state.schedule]])
