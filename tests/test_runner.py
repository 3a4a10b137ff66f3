"""The reference worker's tiny model and runner: determinism, paging, sampling, recompute.

Streams come from :class:`Driver`, a toy engine: it schedules every unfinished
request each step under a token budget (chunked prefill), hands out KV blocks
from a free list, feeds sampled tokens back (engine-token mode) and finishes a
request after ``max_tokens`` outputs.

Where the tests assert equality: the model computes one position at a time, so
position ``p``'s arithmetic is the same whatever the chunking, batch
composition or block placement (see :mod:`worker_side.model`); every equality
asserted here is between computations that are identical operation by
operation, not merely equal in exact math.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle import Oracle

from engine_side.mirror import EngineMirror
from engine_side.request_diff import RequestDiffer
from protocol.messages import TOKEN_MODE_ENGINE, TOKEN_MODE_WORKER
from protocol.params import SamplingSpec
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec
from protocol.snapshot import load_snapshot
from worker_side.model import TinyModel
from worker_side.runner import ModelRunner, StepOutput, sample

BLOCK = 16
NUM_BLOCKS = 64
MODEL = TinyModel(vocab_size=512, hidden=64, layers=2, seed=0)
SEEDED = SamplingSpec(temperature=0.9, top_k=40, seed=7)

Tokens = dict[str, list[int]]


def prompts(n: int = 3, seed: int = 1) -> dict[str, list[int]]:
    """``n`` prompts of 5..40 tokens from a fixed numpy generator."""
    rng = np.random.default_rng(seed)
    sizes = [5, 40, 23, 17][:n]
    return {f"r{i}": rng.integers(0, 512, size).tolist() for i, size in enumerate(sizes)}


class Driver:
    """A toy engine producing ExecuteModelRequests and consuming StepOutputs."""

    def __init__(self, prompts: dict[str, list[int]], *, budget: int = 24, max_tokens: int = 6,
                 sampling: SamplingSpec | None = None, engine_tokens: bool = True,
                 free_blocks: list[int] | None = None) -> None:
        self.specs = {rid: RequestSpec(rid, _frozen(p), sampling) for rid, p in prompts.items()}
        self.budget, self.max_tokens, self.engine_tokens = budget, max_tokens, engine_tokens
        self.free = list(range(NUM_BLOCKS)) if free_blocks is None else list(free_blocks)
        self.computed = {rid: 0 for rid in prompts}
        self.tables: dict[str, list[int]] = {rid: [] for rid in prompts}
        self.outputs: Tokens = {rid: [] for rid in prompts}
        self.finished: set[str] = set()
        self._pending_finish: set[str] = set()
        self._last: dict[str, int] = {}

    def next_request(self) -> ExecuteModelRequest | None:
        """The next step, or None when every request has finished."""
        ids, counts, budget = [], [], self.budget
        for rid, spec in self.specs.items():
            assert spec.prompt_token_ids is not None
            known = spec.prompt_token_ids.size + len(self.outputs[rid])
            count = min(known - self.computed[rid], budget)
            if rid in self.finished or count <= 0:
                continue
            self._grow_table(rid, self.computed[rid] + count)
            ids.append(rid)
            counts.append(count)
            budget -= count
        if not ids:
            return None
        self._last = dict(zip(ids, counts, strict=True))
        finished, self._pending_finish = frozenset(self._pending_finish), set()
        return ExecuteModelRequest(
            req_ids=ids, specs=[self.specs[r] for r in ids],
            num_scheduled_tokens=np.array(counts, dtype=np.int64),
            num_computed_tokens=np.array([self.computed[r] for r in ids], dtype=np.int64),
            block_tables=(Ragged.from_lists([self.tables[r] for r in ids]),),
            spec_token_ids=Ragged.empty(len(ids)), encoder_inputs=Ragged.empty(len(ids)),
            output_token_ids=([np.array(self.outputs[r], dtype=np.int64) for r in ids]
                              if self.engine_tokens else None),
            finished_req_ids=finished)

    def record(self, out: StepOutput) -> None:
        for rid, count in self._last.items():
            self.computed[rid] += count
        for rid, token in zip(out.req_ids, out.token_ids, strict=True):
            self.outputs[rid].append(token)
            if len(self.outputs[rid]) == self.max_tokens:
                self.finished.add(rid)
                self._pending_finish.add(rid)
                self.free.extend(self.tables[rid])

    def _grow_table(self, rid: str, tokens: int) -> None:
        while len(self.tables[rid]) * BLOCK < tokens:
            self.tables[rid].append(self.free.pop(0))


def _frozen(tokens: list[int]) -> np.ndarray:
    arr = np.array(tokens, dtype=np.int64)
    arr.flags.writeable = False
    return arr


def run(driver: Driver, runner: ModelRunner | None = None,
        mirror: RequestDiffer | Oracle | None = None, steps: int | None = None) -> Tokens:
    """Drive ``runner`` for ``steps`` steps (or to completion), each step diffed into
    ``mirror`` when given; return the outputs so far."""
    runner = runner or ModelRunner(MODEL, num_blocks=NUM_BLOCKS, block_size=BLOCK)
    done = 0
    while steps is None or done < steps:
        req = driver.next_request()
        if req is None:
            break
        if mirror is not None:
            mirror.diff(req)
        driver.record(runner.execute(req))
        done += 1
    return driver.outputs


def fresh_runner() -> ModelRunner:
    return ModelRunner(MODEL, num_blocks=NUM_BLOCKS, block_size=BLOCK)


# -- determinism -------------------------------------------------------------------------
def test_same_stream_same_tokens_and_hash() -> None:
    a, b = fresh_runner(), fresh_runner()
    out_a = run(Driver(prompts(), sampling=SEEDED), a)
    out_b = run(Driver(prompts(), sampling=SEEDED), b)
    assert out_a == out_b
    assert all(len(t) == 6 for t in out_a.values())
    assert a.token_hash() == b.token_hash() != 0
    assert a.num_sampled == 18


def test_weights_depend_only_on_seed() -> None:
    same, other = TinyModel(seed=0), TinyModel(seed=1)
    state, state_other = MODEL.state_dict(), other.state_dict()
    assert all(torch.equal(v, same.state_dict()[k]) for k, v in state.items())
    assert not torch.equal(state["head.weight"], state_other["head.weight"])


def test_chunking_and_batch_composition_do_not_change_tokens() -> None:
    """Per-position arithmetic is chunk-independent, so these are bitwise equalities."""
    reference = run(Driver(prompts(), budget=1000))
    for budget in (7, 16, 33):
        assert run(Driver(prompts(), budget=budget)) == reference, budget
    for rid, prompt in prompts().items():
        alone = run(Driver({rid: prompt}, budget=5))
        assert alone[rid] == reference[rid]


def test_same_request_in_different_blocks_gives_same_tokens() -> None:
    reference = run(Driver(prompts(), sampling=SEEDED))
    scattered = list(range(NUM_BLOCKS))[::-1][::2] + list(range(NUM_BLOCKS))[::-1][1::2]
    assert run(Driver(prompts(), sampling=SEEDED, free_blocks=scattered)) == reference


def test_reads_go_through_the_block_table() -> None:
    """Zeroing a request's first block (blocks_to_zero) changes what it generates."""
    runner, driver = fresh_runner(), Driver(prompts(2), max_tokens=8)
    run(driver, runner, steps=2)  # both prompts fully prefilled
    req = driver.next_request()
    assert req is not None
    req.blocks_to_zero = np.array([driver.tables["r1"][0]], dtype=np.int64)
    driver.record(runner.execute(req))
    corrupted = run(driver, runner)
    reference = run(Driver(prompts(2), max_tokens=8))
    assert corrupted["r0"] == reference["r0"]
    assert corrupted["r1"] != reference["r1"]


# -- sampling ------------------------------------------------------------------------------
def test_greedy_is_argmax_and_seeded_differs() -> None:
    greedy = run(Driver(prompts(), sampling=None, max_tokens=10))
    zero_temp = run(Driver(prompts(), sampling=SamplingSpec(temperature=0.0, seed=3),
                           max_tokens=10))
    seeded = run(Driver(prompts(), sampling=SEEDED, max_tokens=10))
    other_seed = run(Driver(prompts(), sampling=SamplingSpec(temperature=0.9, top_k=40, seed=8),
                            max_tokens=10))
    assert greedy == zero_temp
    assert seeded != greedy
    assert seeded != other_seed


def test_sample_rules() -> None:
    logits = MODEL.logits(torch.linspace(-1.0, 1.0, 64))
    best = int(torch.argmax(logits))
    assert sample(logits, None, "x", 3) == best
    top1 = SamplingSpec(temperature=1.0, top_k=1, seed=5)
    assert all(sample(logits, top1, "x", p) == best for p in range(20))
    top5 = set(torch.topk(logits, 5).indices.tolist())
    hot = SamplingSpec(temperature=50.0, top_k=5, seed=5)
    drawn = [sample(logits, hot, "x", p) for p in range(40)]
    assert set(drawn) <= top5 and len(set(drawn)) > 1
    assert drawn == [sample(logits, hot, "x", p) for p in range(40)]
    assert drawn != [sample(logits, hot, "y", p) for p in range(40)]


# -- worker-owned tokens --------------------------------------------------------------------
def test_worker_owned_mode_matches_engine_mode() -> None:
    runner = fresh_runner()
    engine = run(Driver(prompts(), sampling=SEEDED))
    worker = run(Driver(prompts(), sampling=SEEDED, engine_tokens=False), runner)
    assert worker == engine
    assert runner.outputs and all(runner.outputs[r] == worker[r] for r in runner.outputs)


def test_worker_owned_outputs_dropped_on_finish() -> None:
    runner, driver = fresh_runner(), Driver(prompts(2), max_tokens=2, engine_tokens=False)
    run(driver, runner, steps=2)  # r0 samples its 2nd token in step 2 ...
    assert runner.outputs["r0"] == driver.outputs["r0"] != []
    run(driver, runner, steps=1)  # ... and its id goes out as finished with step 3
    assert "r0" not in runner.outputs
    assert runner.outputs["r1"] == driver.outputs["r1"]


def test_bad_requests_raise() -> None:
    driver = Driver(prompts(1))
    req = driver.next_request()
    assert req is not None
    short = ModelRunner(MODEL, num_blocks=1, block_size=2)
    with pytest.raises(ValueError, match="block table"):
        short.execute(req)
    req.block_tables = (Ragged.from_lists([[NUM_BLOCKS + 5]]),)
    with pytest.raises(ValueError, match="out of range"):
        fresh_runner().execute(req)


# -- recompute after rejoin ------------------------------------------------------------------
@pytest.mark.parametrize("steps", [1, 2, 4])  # mid-prefill, prefill just done, decoding
def test_recompute_then_continue_matches(steps: int) -> None:
    driver = Driver(prompts(), budget=24, max_tokens=8, sampling=SEEDED)
    oracle = Oracle(token_mode=TOKEN_MODE_ENGINE)  # checks every step rebuilds exactly
    mirror = oracle.mirror
    old = fresh_runner()
    run(driver, old, oracle, steps=steps)
    rejoined, stale = fresh_runner(), fresh_runner()
    state = load_snapshot(mirror.snapshot())
    assert rejoined.recompute(state) > 0
    assert rejoined.recompute(mirror.state) > 0  # idempotent: rewrites identical KV
    diverged = False
    while (req := driver.next_request()) is not None:
        out = old.execute(req)
        assert rejoined.execute(req) == out
        diverged |= stale.execute(req) != out
        driver.record(out)
    assert diverged  # a runner with an empty cache would not have matched


def test_recompute_worker_owned_covers_prompt_only() -> None:
    driver = Driver(prompts(2), budget=64, sampling=SEEDED, engine_tokens=False)
    mirror = EngineMirror(token_mode=TOKEN_MODE_WORKER)
    run(driver, fresh_runner(), RequestDiffer(mirror), steps=3)
    rejoined = fresh_runner()
    assert rejoined.recompute(mirror.state) == 5 + 40
    req = driver.next_request()
    assert req is not None
    with pytest.raises(ValueError, match="past its known sequence"):
        rejoined.execute(req)


# -- cross-process determinism ----------------------------------------------------------------
_CHILD = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
sys.path.insert(0, sys.argv[2])
import test_runner as t
runner = t.fresh_runner()
outputs = t.run(t.Driver(t.prompts(), sampling=t.SEEDED, budget=11), runner)
print(json.dumps({"outputs": outputs, "hash": runner.token_hash()}))
"""


def test_subprocess_samples_the_same_tokens() -> None:
    runner = fresh_runner()
    outputs = run(Driver(prompts(), sampling=SEEDED, budget=11), runner)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(torch.get_num_threads()), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=120, env=env, check=False)
    assert result.returncode == 0, result.stderr
    child = json.loads(result.stdout.strip().splitlines()[-1])
    assert child == {"outputs": outputs, "hash": runner.token_hash()}
