"""A random-but-valid engine workload: live requests and one ExecuteModelRequest per step.

Plain Python, deterministic given the ``seed`` of each operation (a Hypothesis
rule draws the seed, so a failing run prints a replayable script).  It models
what a vLLM-like scheduler does and what the protocol must carry:

* requests are added (``WAITING``), admitted into the batch (``RUNNING``),
  prefilled in chunks, decoded with speculative tokens and rejections,
  preempted (``PREEMPTED``: unscheduled, blocks freed, computed reset) and
  resumed (``RESUMING``: fresh block table, prefix-cache hit or zero computed),
  finished or aborted, and their ids reused;
* block tables for one or two KV groups; group 1 is a sliding window whose
  old blocks fall back to the null block 0 (a table edited in the middle);
* engine-token mode sends ``outputs + drafts`` per request, so a rejected
  draft shows up as a truncation followed by appends in the next step.

Protocol contract respected (shared context): a request becomes known to the
workers when first scheduled; it lives until listed in ``finished_req_ids``;
preempted/resumed ids are live; an id may be finished and re-added in one step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from protocol.messages import TOKEN_MODE_ENGINE
from protocol.params import (
    LoRASpec,
    MMFeatureRef,
    PoolingSpec,
    SamplingSpec,
    StructuredOutputsSpec,
)
from protocol.request import ExecuteModelRequest, IntArray, Ragged, RequestSpec

VOCAB = 6  # tiny, so prompts and sampled tokens coincide often
BLOCK_SIZES = (16, 32)  # tokens per block, per KV group
WINDOW = 64  # group 1 keeps only blocks overlapping the last WINDOW tokens

WAITING, RUNNING, PREEMPTED, RESUMING = "waiting", "running", "preempted", "resuming"

# Per-step probabilities.
P_SKIP = 0.08  # a running request is left out of a step without being preempted
P_ADMIT = 0.8  # a waiting request joins the batch
P_SHUFFLE = 0.1  # batch order changes
P_SPEC = 0.35  # a decoding request carries draft tokens
P_FULL_CHUNK = 0.5  # a prefill schedules all that remains

# Non-default sampling values, a few of which each request gets.
SAMPLING_CHOICES: dict[str, list[Any]] = {
    "temperature": [0.0, 0.7],
    "top_p": [0.9, 0.5],
    "top_k": [5, 50],
    "seed": [0, 1234],
    "max_tokens": [1, 128, None],
    "stop": [["\n"], ["###", "END"]],
    "stop_token_ids": [[2], [2, 3]],
    "logprobs": [0, 5],
    "logit_bias": [{1: 0.5}, {3: -100.0}],
    "structured_outputs": [StructuredOutputsSpec(json='{"type": "object"}'),
                           StructuredOutputsSpec(regex="[a-z]+")],
    "extra_args": [{"k": "v"}, {"n": [1, 2]}],
    "allowed_token_ids": [[0, 1, 2]],
    "ignore_eos": [True],
}


# -- static request data -------------------------------------------------------------------
def draw_prompt(rng: random.Random, sources: list[IntArray]) -> IntArray:
    """1..300 tokens; often a prefix of (or an extension of) a live prompt."""
    if sources and rng.random() < 0.4:
        base = rng.choice(sources)
        cut = rng.randint(0, base.size)
        head = base[:cut].tolist()
        tail_len = rng.randint(0 if cut else 1, 40)
    else:
        head, tail_len = [], rng.randint(1, 40) if rng.random() < 0.8 else rng.randint(1, 300)
    prompt = np.array(head + [rng.randrange(VOCAB) for _ in range(tail_len)], dtype=np.int64)
    prompt.flags.writeable = False
    return prompt


def draw_params(rng: random.Random) -> tuple[SamplingSpec | None, PoolingSpec | None]:
    """Sampling with 0..3 non-default fields, or (rarely) pooling instead."""
    if rng.random() < 0.05:
        return None, PoolingSpec(task="embed", dimensions=rng.choice([None, 8]))
    fields = {}
    for _ in range(rng.randint(0, 3)):
        name = rng.choice(sorted(SAMPLING_CHOICES))
        fields[name] = rng.choice(SAMPLING_CHOICES[name])
    return msgspec.structs.replace(SamplingSpec(), **fields), None


def draw_mm(rng: random.Random) -> tuple[MMFeatureRef, ...]:
    """One or two image items: torch data, numpy data, or none (cached on workers)."""
    items = []
    for _ in range(rng.randint(1, 2)):
        uid = f"{rng.randrange(1 << 24):06x}"
        data: Any = None
        kind = rng.randrange(3)
        if kind == 1:
            value = float(rng.randint(0, 9))
            data = {"pixel_values": torch.full((2, 3), value, dtype=torch.float16)}
        elif kind == 2:
            grid = np.arange(6, dtype=np.int32).reshape(2, 3)
            data = {"grid": grid, "sizes": [rng.randint(1, 4)]}
        mask = torch.tensor([True, False, True]) if rng.random() < 0.3 else None
        items.append(MMFeatureRef("image", f"img-{uid}", rng.randint(0, 8), rng.randint(1, 8),
                                  mm_hash=f"mm-{uid}", data=data, is_embed=mask))
    return tuple(items)


def draw_spec(rng: random.Random, req_id: str, sources: list[IntArray]) -> tuple[RequestSpec, int]:
    """A request's static data and its prompt length."""
    mm = draw_mm(rng) if rng.random() < 0.1 else ()
    sampling, pooling = draw_params(rng)
    lora = LoRASpec("adapter-1", 1, "/loras/1") if rng.random() < 0.1 else None
    if rng.random() < 0.08:  # prompt embeddings instead of token ids
        n = rng.randint(1, 12)
        embeds = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) * rng.randint(1, 9)
        return RequestSpec(req_id, None, sampling, pooling, lora, mm, embeds), n
    prompt = draw_prompt(rng, sources)
    return RequestSpec(req_id, prompt, sampling, pooling, lora, mm), int(prompt.size)


# -- dynamic request state -------------------------------------------------------------------
@dataclass
class ModelRequest:
    """The engine's view of one live request."""

    spec: RequestSpec
    prompt_len: int
    kv_groups: int
    status: str = WAITING
    computed: int = 0
    outputs: list[int] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    known: bool = False  # scheduled at least once under the current mirror

    def __post_init__(self) -> None:
        self.blocks = [[] for _ in range(self.kv_groups)]

    @property
    def req_id(self) -> str:
        return self.spec.req_id

    @property
    def total(self) -> int:
        """Tokens the engine knows (prompt + sampled); all but the last get computed."""
        return self.prompt_len + len(self.outputs)


@dataclass
class Row:
    """One scheduled request's part of a step."""

    sched: int
    drafts: list[int]
    encoder: list[int]


class EngineModel:
    """Live requests plus the pending changes the next ``step`` reports."""

    def __init__(self, token_mode: int, kv_groups: int) -> None:
        self.token_mode = token_mode
        self.kv_groups = kv_groups
        self.live: dict[str, ModelRequest] = {}
        self.serial = 0
        self.steps = 0
        self._finishing: set[str] = set()
        self._preempting: set[str] = set()
        self._freed_mm: list[str] = []
        self._next_block = 1  # 0 is the null block
        self._free_blocks: list[int] = []
        self._fresh_blocks: list[int] = []

    # -- eligibility (for rule preconditions) --------------------------------------------------
    def live_ids(self) -> list[str]:
        return list(self.live)

    def preemptible(self) -> list[str]:
        return [r.req_id for r in self.live.values() if r.status == RUNNING and r.known]

    def resumable(self) -> list[str]:
        return [r.req_id for r in self.live.values()
                if r.status == PREEMPTED and r.req_id not in self._preempting]

    # -- operations -----------------------------------------------------------------------------
    def add_request(self, seed: int, req_id: str | None = None) -> str:
        rng = random.Random(seed)
        if req_id is None:
            req_id, self.serial = f"req-{self.serial}", self.serial + 1
        sources = [r.spec.prompt_token_ids for r in self.live.values()
                   if r.spec.prompt_token_ids is not None]
        spec, plen = draw_spec(rng, req_id, sources)
        req = ModelRequest(spec, plen, self.kv_groups)
        if plen > BLOCK_SIZES[0] and rng.random() < 0.2:  # prefix-cache hit
            req.computed = BLOCK_SIZES[0] * rng.randint(1, (plen - 1) // BLOCK_SIZES[0])
        self.live[req_id] = req
        return req_id

    def finish(self, seed: int) -> str:
        """Finish (running) or abort (waiting/preempted) a random live request."""
        req = random.Random(seed).choice(list(self.live.values()))
        self._finish(req)
        return req.req_id

    def reuse_id(self, seed: int) -> str:
        """Finish a live request and add a new one under the same id."""
        req_id = self.finish(seed)
        return self.add_request(seed + 1, req_id)

    def preempt(self, seed: int) -> str:
        req = self.live[random.Random(seed).choice(self.preemptible())]
        req.status, req.computed = PREEMPTED, 0
        self._release(req)
        self._preempting.add(req.req_id)
        return req.req_id

    def resume(self, seed: int) -> str:
        rng = random.Random(seed)
        req = self.live[rng.choice(self.resumable())]
        req.status = RESUMING
        hit = (req.total - 1) // BLOCK_SIZES[0]
        req.computed = BLOCK_SIZES[0] * rng.randint(0, hit) if hit and rng.random() < 0.5 else 0
        return req.req_id

    def update_params(self, seed: int) -> str:
        """Same id and prompt, new sampling parameters (the workers see an update)."""
        rng = random.Random(seed)
        req = rng.choice(list(self.live.values()))
        sampling, pooling = draw_params(rng)
        req.spec = msgspec.structs.replace(req.spec, sampling=sampling, pooling=pooling)
        return req.req_id

    def churn(self, seed: int) -> list[str]:
        """Random workload changes before a step (so every step rule has some)."""
        rng = random.Random(seed)
        done = [f"add {self.add_request(rng.getrandbits(32))}"
                for _ in range(rng.choice([0, 0, 1, 2]))]
        ops = [(0.15, self.finish, self.live_ids), (0.05, self.reuse_id, self.live_ids),
               (0.1, self.preempt, self.preemptible), (0.2, self.resume, self.resumable),
               (0.03, self.update_params, self.live_ids)]
        for p, op, eligible in ops:
            if rng.random() < p and eligible():
                done.append(f"{op.__name__} {op(rng.getrandbits(32))}")
        return done

    def restart(self, keep: bool) -> None:
        """A new mirror knows nothing: forget everything, or keep requests as unknown."""
        self._finishing.clear()
        self._preempting.clear()
        if not keep:
            for req in list(self.live.values()):
                self._release(req)
            self.live.clear()
        for req in self.live.values():
            req.known = False

    def _finish(self, req: ModelRequest) -> None:
        del self.live[req.req_id]
        self._release(req)
        self._finishing.add(req.req_id)
        self._preempting.discard(req.req_id)
        self._freed_mm += [f.mm_hash for f in req.spec.mm_features if f.mm_hash]

    # -- blocks ---------------------------------------------------------------------------------
    def _alloc(self) -> int:
        if self._free_blocks:
            block = self._free_blocks.pop(0)
        else:
            block, self._next_block = self._next_block, self._next_block + 1
        self._fresh_blocks.append(block)
        return block

    def _release(self, req: ModelRequest) -> None:
        for table in req.blocks:
            self._free_blocks += [b for b in table if b]
            table.clear()

    def _grow_blocks(self, req: ModelRequest, tokens: int) -> None:
        """Cover ``tokens`` tokens in every group; slide group 1's window."""
        for g, table in enumerate(req.blocks):
            size = BLOCK_SIZES[g]
            while len(table) * size < tokens:
                table.append(self._alloc())
            if g == 1:
                for i, block in enumerate(table):
                    if block and (i + 1) * size <= req.computed - WINDOW:
                        self._free_blocks.append(block)
                        table[i] = 0

    # -- one step -------------------------------------------------------------------------------
    def step(self, seed: int) -> ExecuteModelRequest:
        """The next step's full request; advances the model past it."""
        rng = random.Random(seed)
        finished, preempted = frozenset(self._finishing), frozenset(self._preempting)
        self._finishing.clear()
        self._preempting.clear()
        batch = self._pick_batch(rng)
        resumed = frozenset(r.req_id for r in batch if r.status == RESUMING)
        rows = [self._schedule_one(rng, r) for r in batch]
        request = self._assemble(rng, batch, rows)
        request.finished_req_ids = finished
        request.preempted_req_ids = preempted
        request.resumed_req_ids = resumed
        for req, row in zip(batch, rows, strict=True):
            self._advance(rng, req, row)
        self.steps += 1
        return request

    def _pick_batch(self, rng: random.Random) -> list[ModelRequest]:
        """Running requests first (some skipped), then resumed, then admitted ones."""
        reqs = list(self.live.values())
        batch = [r for r in reqs if r.status == RUNNING and rng.random() >= P_SKIP]
        batch += [r for r in reqs if r.status == RESUMING]
        batch += [r for r in reqs if r.status == WAITING and rng.random() < P_ADMIT]
        if rng.random() < P_SHUFFLE:
            rng.shuffle(batch)
        return batch

    def _schedule_one(self, rng: random.Random, req: ModelRequest) -> Row:
        remaining = req.total - req.computed  # >= 1 always
        drafts: list[int] = []
        if remaining > 1:  # (chunked) prefill, or recomputation after a preemption
            sched = remaining if rng.random() < P_FULL_CHUNK else rng.randint(1, remaining)
        else:
            if rng.random() < P_SPEC:
                drafts = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
            sched = 1 + len(drafts)
        encoder: list[int] = []
        n_mm = len(req.spec.mm_features)
        if n_mm and req.computed < req.prompt_len and rng.random() < 0.5:
            encoder = sorted(rng.sample(range(n_mm), rng.randint(1, n_mm)))
        self._grow_blocks(req, req.computed + sched)
        return Row(sched, drafts, encoder)

    def _advance(self, rng: random.Random, req: ModelRequest, row: Row) -> None:
        """After the step: computed moves on; reaching the end samples 1 + accepted tokens."""
        req.status, req.known = RUNNING, True
        end = req.computed + row.sched
        if end < req.total:
            req.computed = end
            return
        accepted = rng.randint(0, len(row.drafts))
        req.computed = end - (len(row.drafts) - accepted)
        req.outputs += row.drafts[:accepted] + [rng.randrange(VOCAB)]

    def _assemble(self, rng: random.Random, batch: list[ModelRequest],
                  rows: list[Row]) -> ExecuteModelRequest:
        outputs: list[IntArray] | None = None
        if self.token_mode == TOKEN_MODE_ENGINE:
            outputs = [np.array(r.outputs + row.drafts, dtype=np.int64)
                       for r, row in zip(batch, rows, strict=True)]
        structured = any(r.spec.sampling is not None and r.spec.sampling.structured_outputs
                         for r in batch)
        zero = np.array(self._fresh_blocks, dtype=np.int64) if rng.random() < 0.3 else None
        freed, self._freed_mm, self._fresh_blocks = tuple(self._freed_mm), [], []
        return ExecuteModelRequest(
            req_ids=[r.req_id for r in batch],
            specs=[r.spec for r in batch],
            num_scheduled_tokens=np.array([row.sched for row in rows], dtype=np.int64),
            num_computed_tokens=np.array([r.computed for r in batch], dtype=np.int64),
            block_tables=tuple(Ragged.from_lists([list(r.blocks[g]) for r in batch])
                               for g in range(self.kv_groups)),
            spec_token_ids=Ragged.from_lists([row.drafts for row in rows]),
            encoder_inputs=Ragged.from_lists([row.encoder for row in rows]),
            output_token_ids=outputs,
            free_encoder_mm_hashes=freed,
            blocks_to_zero=zero,
            has_structured_output_requests=structured,
            pending_structured_output_tokens=rng.random() < 0.1,
            num_spec_tokens_to_schedule=rng.randint(1, 3) if rng.random() < 0.2 else 0,
            extension={"trace": rng.randbytes(4)} if rng.random() < 0.1 else {},
        )
