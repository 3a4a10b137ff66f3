"""Hypothesis strategies: valid vLLM 0.32 SchedulerOutput streams (V1 and V2 runner shapes).

A toy scheduler keeps requests (prompt, outputs, computed tokens, block tables)
and emits what vLLM's scheduler would: new requests with their whole block
table, cached ones with only new blocks (replaced when resumed), chunked
prefill, speculative drafts (with -1 placeholders), preemption, finishes
(including ids never scheduled, and an id finished and re-added in one step).
V1 shape: resumed requests are cached with ``resumed_req_ids`` and
``all_token_ids`` for requests not scheduled last step.  V2 shape (Model Runner
V2): resumed requests arrive as new ones with ``prefill_token_ids`` holding the
history, ``all_token_ids`` stays empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

BLOCK = 32


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: dict[str, Any]
    outputs: list[int] = field(default_factory=list)
    computed: int = 0
    table: list[list[int]] = field(default_factory=list)
    state: str = "waiting"  # waiting | running | preempted


@dataclass
class OpaqueMeta:
    """Stands in for connector metadata (an arbitrary picklable object)."""

    note: str
    blocks: list[int]


def _sampling(draw: Any) -> Any:
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    kind = draw(st.sampled_from(["greedy_int", "greedy", "random", "rich"]))
    if kind == "greedy_int":
        return SamplingParams(temperature=0, max_tokens=draw(st.integers(1, 64)))
    if kind == "greedy":
        return SamplingParams(temperature=0.0, stop=draw(st.lists(st.text(min_size=1,
                                                                          max_size=3), max_size=2)))
    if kind == "random":
        return SamplingParams(temperature=0.8, top_p=0.9, seed=draw(st.none() | st.integers(0, 9)),
                              n=draw(st.integers(1, 3)), logprobs=draw(st.none() | st.just(2)))
    sp = SamplingParams(temperature=0.5, stop_token_ids=[7, 3, 7], logit_bias={5: 1.5},
                        structured_outputs=StructuredOutputsParams(regex="[a-z]+"),
                        extra_args={"k": [1, "x"]}, bad_words=["zz"])
    sp._all_stop_token_ids.add(2)
    sp._eos_token_id = 2
    sp._bad_words_token_ids = [[9, 9]]
    return sp


def _new_data(draw: Any, req: _Req, groups: int, v2: bool) -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.pooling_params import PoolingParams
    from vllm.v1.core.sched.output import NewRequestData

    p = req.params
    mm = [MultiModalFeatureSpec(None, "image", f"h-{req.rid}", PlaceholderRange(1, 2), "mh")] \
        if p["mm"] else []
    return NewRequestData(
        req_id=req.rid, prompt_token_ids=list(req.prompt), mm_features=mm,
        sampling_params=p["sampling"], pooling_params=PoolingParams() if p["pool"] else None,
        block_ids=tuple(list(t) for t in req.table), num_computed_tokens=req.computed,
        lora_request=LoRARequest("ad", 1, "/x") if p["lora"] else None,
        prompt_is_token_ids=[True] * len(req.prompt) if p["pit"] else None,
        prefill_token_ids=req.prompt + req.outputs if v2 else None,
        replay_start=p["replay"])


class _Toy:
    def __init__(self, draw: Any, v2: bool, groups: int, pp: bool, rare: bool = True) -> None:
        self.draw, self.v2, self.groups, self.pp = draw, v2, groups, pp
        self.rare = rare  # False: no multimodal inputs, zeroed blocks or extras
        self.reqs: dict[str, _Req] = {}
        self.next_id = 0
        self.next_block = 1
        self.prev_batch: set[str] = set()
        self.last_order: list[str] = []  # the last step's batch, in order

    def _add(self, rid: str | None = None) -> None:
        d = self.draw
        rid = rid or f"req-{self.next_id}-{d(st.text('abc', max_size=3))}"
        self.next_id += 1
        params = {"sampling": _sampling(d), "pool": d(st.integers(0, 9)) == 0,
                  "lora": d(st.integers(0, 9)) == 0,
                  "mm": self.rare and d(st.integers(0, 9)) == 0,
                  "pit": d(st.integers(0, 19)) == 0,
                  "replay": d(st.sampled_from([0, 0, 0, 3]))}
        prompt = d(st.lists(st.integers(0, 511), min_size=1, max_size=90))
        self.reqs[rid] = _Req(rid, prompt, params, table=[[] for _ in range(self.groups)])

    def _grow(self, req: _Req, tokens: int) -> tuple[list[int], ...]:
        need = -(-(req.computed + tokens) // BLOCK)
        new = []
        for t in req.table:
            ids = list(range(self.next_block, self.next_block + max(0, need - len(t))))
            self.next_block += len(ids)
            t.extend(ids)
            new.append(ids)
        return tuple(new)

    def step(self) -> Any:
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

        d = self.draw
        last = [rid for rid in self.last_order if rid in self.reqs]
        if len(last) > 1 and d(st.integers(0, 3)) == 0:  # vLLM's commonest turnover
            return self._finish_only(last, SchedulerOutput, CachedRequestData)
        live = sorted(r.rid for r in self.reqs.values() if r.state != "waiting")
        finished = set(d(st.lists(st.sampled_from(live), max_size=2)) if live else [])
        for rid in finished:
            del self.reqs[rid]
        if d(st.integers(0, 4)) == 0:
            finished.add(f"never-{self.next_id}")
        if finished and d(st.integers(0, 3)) == 0:
            self._add(sorted(finished)[0])  # finished and re-added in one step
        for _ in range(d(st.integers(0, 3))):
            self._add()
        running = [r for r in self.reqs.values() if r.state == "running"]
        preempted: set[str] = set()
        if running and d(st.integers(0, 5)) == 0:
            victim = running.pop()
            victim.state, victim.computed = "preempted", 0
            victim.table = [[] for _ in range(self.groups)]
            preempted.add(victim.rid)
        waiting = [r for r in self.reqs.values() if r.state in ("waiting", "preempted")
                   and r.rid not in preempted]
        waiting = d(st.permutations(waiting)) if waiting else []
        scheduled_run = [r for r in running if d(st.integers(0, 6)) > 0]
        admitted = [r for r in waiting if d(st.booleans())]
        return self._output(scheduled_run, admitted, finished, preempted, SchedulerOutput,
                            CachedRequestData)

    def _finish_only(self, last: list[str], so_cls: Any, cached_cls: Any) -> Any:
        """Some of the last batch finish and the rest run again in its order: nothing
        joins, none is preempted or left unscheduled (the finish path's step)."""
        d = self.draw
        finished = set(d(st.permutations(last))[:d(st.integers(1, len(last) - 1))])
        for rid in finished:
            del self.reqs[rid]
        run = [self.reqs[rid] for rid in last if rid not in finished]
        return self._output(run, [], finished, set(), so_cls, cached_cls)

    def _tokens(self, req: _Req) -> tuple[int, list[int]]:
        d = self.draw
        remaining = len(req.prompt) + len(req.outputs) - req.computed
        if remaining > 1 or not req.outputs:
            return min(remaining, d(st.sampled_from([16, 32, 64, 200]))), []
        drafts = d(st.lists(st.integers(-1, 511), max_size=3)) if d(st.booleans()) else []
        return 1 + len(drafts), drafts

    def _output(self, run: list[_Req], admitted: list[_Req], finished: set[str],
                preempted: set[str], so_cls: Any, cached_cls: Any) -> Any:
        d = self.draw
        batch = run + admitted
        nsched, spec, enc = {}, {}, {}
        new_reqs, cached, new_blocks, resumed = [], [], [], set()
        before = {r.rid: (r.computed, len(r.outputs)) for r in batch}
        for r in batch:
            n, drafts = self._tokens(r)
            nsched[r.rid] = n
            if drafts:
                spec[r.rid] = drafts
            if r.params["mm"] and d(st.integers(0, 3)) == 0:
                enc[r.rid] = [0]
            grown = self._grow(r, n)
            fresh = r.state == "waiting" or (r.state == "preempted" and self.v2)
            if fresh:
                new_reqs.append(r)
            else:
                if r.state == "preempted":
                    resumed.add(r.rid)
                    grown = tuple(list(t) for t in r.table)
                cached.append(r)
                new_blocks.append(None if not any(grown) else grown)
        new_data = [_new_data(d, r, self.groups, self.v2) for r in new_reqs]
        if self.v2:  # MRV2 lists fresh requests first, then resumed ones
            new_data.sort(key=lambda nr: nr.req_id in {r.rid for r in new_reqs
                                                       if r.state == "preempted"})
        order = [r for r in cached if r.rid not in resumed] + [r for r in cached
                                                                 if r.rid in resumed]
        blocks = dict(zip([r.rid for r in cached], new_blocks, strict=True))
        cached_data = cached_cls(
            req_ids=[r.rid for r in order], resumed_req_ids=resumed,
            new_token_ids=[r.outputs[-1:] for r in order] if self.pp else [],
            all_token_ids={} if self.v2 else {r.rid: r.prompt + r.outputs for r in order
                                              if r.rid not in self.prev_batch},
            new_block_ids=[blocks[r.rid] for r in order],
            num_computed_tokens=[before[r.rid][0] for r in order],
            num_output_tokens=[before[r.rid][1] for r in order])
        so = so_cls(
            scheduled_new_reqs=new_data, scheduled_cached_reqs=cached_data,
            num_scheduled_tokens=nsched, total_num_scheduled_tokens=sum(nsched.values()),
            scheduled_spec_decode_tokens=spec, scheduled_encoder_inputs=enc,
            finished_req_ids=finished, free_encoder_mm_hashes=d(st.lists(
                st.just("mh"), max_size=1 if self.rare else 0)),
            preempted_req_ids=preempted,
            new_block_ids_to_zero=d(st.none() | st.lists(st.integers(1, 99), min_size=1,
                                                         max_size=3)) if self.rare else None,
            num_spec_tokens_to_schedule=d(st.sampled_from([0, 0, 3])),
            has_structured_output_requests=d(st.booleans()))
        if self.rare:
            self._extras(so)
        self._advance(batch, nsched, spec)
        self.prev_batch = set(nsched)
        self.last_order = list(nsched)
        return so

    def _extras(self, so: Any) -> None:
        from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
        from vllm.v1.core.sched.output import ScheduledEncoderInputStats

        d = self.draw
        if d(st.integers(0, 7)) == 0:
            so.scheduled_encoder_input_stats = ScheduledEncoderInputStats(1, 4)
            so.num_invalid_spec_tokens = {k: 1 for k in so.scheduled_spec_decode_tokens}
            so.kv_cache_block_copies = [KVCacheBlockCopy(3, 4)]
            so.has_sync_kv_loads = True
            so.kv_connector_metadata = OpaqueMeta("kv", [1, 2])

    def _advance(self, batch: list[_Req], nsched: dict[str, int],
                 spec: dict[str, list[int]]) -> None:
        d = self.draw
        for r in batch:
            r.state = "running"
            r.computed += nsched[r.rid]
            if r.computed >= len(r.prompt) + len(r.outputs):
                accepted = d(st.integers(0, len(spec.get(r.rid, []))))
                r.outputs += [d(st.integers(0, 511)) for _ in range(1 + accepted)]
                r.computed = len(r.prompt) + len(r.outputs) - 1


@st.composite
def scheduler_streams(draw: Any, v2: bool | None = None, max_steps: int = 12,
                      rare: bool = True) -> dict[str, Any]:
    """{"v2", "kv_groups", "steps": [SchedulerOutput, ...]} of a valid stream.
    ``rare``: False leaves out multimodal inputs, zeroed blocks and the rare extras
    (streams of joins, leaves, preemptions and drafts)."""
    v2 = draw(st.booleans()) if v2 is None else v2
    groups = draw(st.sampled_from([1, 1, 2]))
    toy = _Toy(draw, v2, groups, pp=not v2 and draw(st.integers(0, 3)) == 0, rare=rare)
    steps = [toy.step() for _ in range(draw(st.integers(1, max_steps)))]
    return {"v2": v2, "kv_groups": groups, "steps": steps}
