"""Subprocess script for tests/test_vllm_executor_features.py.

``python tests/vllm_features_run.py MODEL OUT.json`` runs vLLM's default
executor and DeltaExecutor, one after the other and in-process (engine core in
this process, so the executor is reachable), with ONE configuration that turns
on three features at once: ngram speculative decoding, structured output and a
KV cache so small that requests are preempted.  The same prompts go to both;
each executor's calls are observed (preemptions and draft tokens in the
SchedulerOutputs, accepted drafts in the ModelRunnerOutputs, non-empty
``take_draft_token_ids``) so the test can check the features really ran.  At step
FAULT_STEP, between its execute_model and its sample_tokens, DeltaExecutor loses its
last rank (SIGKILL: the group restarts and vLLM's scheduler recomputes), and vLLM's
default executor recomputes at that point itself
(``reset_prefix_cache(reset_running_requests=True)``), so the two stay comparable bit
for bit.  Everything goes to OUT.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections import Counter
from typing import Any

# Repetitive prompts: the n-gram proposer finds matches and the tiny random model
# tends to loop, so drafts get accepted.
LOOP = "the quick brown fox jumps over a lazy dog "
FREE = [LOOP * 3, "seven wizards quietly hex " * 4, LOOP * 2 + "seven wizards",
        "lazy dog " * 8, "quietly hex the brown fox " * 3, LOOP * 4]
GUIDED = ["seven wizards " * 3, LOOP * 2]
CHOICES = ["the lazy dog", "seven wizards", "quick brown fox"]
REGEX = r"(fox|dog|hex)( (jumps|over|quietly)){2,4}"
BLOCKS = 12  # 12 blocks of 32 tokens for ~8 growing requests: preemption
FAULT_STEP = 10  # drafts, grammars and preempted requests are in flight by then
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
# PP_NOTE -- what vLLM 0.32's CPU build cannot do with PP=2, whatever the executor:
# * enforce_eager: the CPU runner skips the warm-up dummy run that allocates the
#   stage-1 buffer, so vLLM's own executor fails its first step with
#   ``assert self.intermediate_tensors is not None`` (gpu_model_runner.py,
#   sync_and_gather_intermediate_tensors).  torch.compile with the "eager" backend
#   (mode 1) runs that warm-up, so PP runs use it (a few seconds).
# * ngram speculative decoding: the first stage has no drafter, vLLM's own executor
#   fails with ``AttributeError: 'CPUModelRunner' object has no attribute 'drafter'``.


def _params() -> list[Any]:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    free = [SamplingParams(temperature=0, max_tokens=72, logprobs=2, ignore_eos=True)
            for _ in FREE]
    guided = [SamplingParams(temperature=0, max_tokens=24, logprobs=2,
                             structured_outputs=StructuredOutputsParams(choice=CHOICES)),
              SamplingParams(temperature=0, max_tokens=24, logprobs=2,
                             structured_outputs=StructuredOutputsParams(regex=REGEX))]
    return free + guided


def _engine(model: str, delta: bool, pp: int) -> Any:
    from vllm import LLM

    from engine_side.vllm import DeltaExecutor

    kw: dict[str, Any] = {"distributed_executor_backend": DeltaExecutor} if delta else {}
    if pp > 1:  # see PP_NOTE
        kw.update(pipeline_parallel_size=pp, compilation_config={"mode": 1, "backend": "eager"})
    else:
        kw.update(enforce_eager=True, speculative_config=NGRAM)
    return LLM(model=model, block_size=32, max_model_len=256, seed=0,
               num_gpu_blocks_override=BLOCKS, max_num_seqs=8, max_num_batched_tokens=256,
               structured_outputs_config={"backend": "xgrammar"}, **kw)


class _Observer:
    """Wraps an executor's calls (on the instance) to count what went through them,
    and records the order in which non-blocking calls resolved."""

    def __init__(self, ex: Any) -> None:
        self.seen: Counter[str] = Counter()
        self.steps = 0
        self.preempted_at: list[int] = []  # the steps naming preempted requests
        self.submitted = 0
        self.resolved: list[int] = []
        self.execute, self.sample = ex.execute_model, ex.sample_tokens
        self.take = ex.take_draft_token_ids
        ex.execute_model, ex.sample_tokens = self.execute_model, self.sample_tokens
        ex.take_draft_token_ids = self.take_draft_token_ids

    def _track(self, out: Any, non_block: bool) -> Any:
        if non_block:
            k, self.submitted = self.submitted, self.submitted + 1
            out.add_done_callback(lambda f: self.resolved.append(k))
        return out

    def execute_model(self, so: Any, non_block: bool = False) -> Any:
        self.steps += 1
        self.seen["preempted"] += len(so.preempted_req_ids or ())
        if so.preempted_req_ids:
            self.preempted_at.append(self.steps)
        self.seen["draft_tokens_scheduled"] += sum(
            len(v) for v in so.scheduled_spec_decode_tokens.values())
        return self._track(self.execute(so, non_block), non_block)

    def sample_tokens(self, grammar: Any, non_block: bool = False) -> Any:
        self.seen["grammar_steps"] += grammar is not None
        out = self._track(self.sample(grammar, non_block), non_block)
        if non_block:
            out.add_done_callback(lambda f: self._accepted(f.result()))
        else:
            self._accepted(out)
        return out

    def _accepted(self, out: Any) -> None:
        if out is not None:
            self.seen["accepted_drafts"] += sum(max(0, len(t) - 1)
                                                for t in out.sampled_token_ids)

    def take_draft_token_ids(self) -> Any:
        drafts = self.take()
        self.seen["drafts_taken"] += drafts is not None and any(drafts.draft_token_ids)
        return drafts


def _run(llm: Any, prompts: list[str], params: list[Any]) -> list[dict[str, Any]]:
    tok = llm.get_tokenizer()
    return [{"outs": [{"ids": list(c.token_ids), "text": c.text,
                       "pieces": "".join(p or "?" for p in tok.convert_ids_to_tokens(c.token_ids)),
                       "lp": None if c.logprobs is None else
                       [{str(k): v.logprob for k, v in d.items()} for d in c.logprobs]}
                      for c in req.outputs]}
            for req in llm.generate(prompts, params, use_tqdm=False)]


def _fault(llm: Any, delta: bool) -> None:
    """Between the FAULT_STEP-th execute_model and its sample_tokens: DeltaExecutor's
    last rank SIGKILLed (the sample call finds the group dead); vLLM's own recompute
    otherwise."""
    from vllm_restart_run import kill, recompute

    ex = llm.llm_engine.engine_core.engine_core.model_executor
    action = kill(llm, ex.world_size - 1) if delta else recompute(llm)
    sample, seen = ex.sample_tokens, [0]

    def sample_tokens(grammar: Any, non_block: bool = False) -> Any:
        seen[0] += 1
        if seen[0] == FAULT_STEP:
            action()
        return sample(grammar, non_block)

    ex.sample_tokens = sample_tokens


def _one(model: str, delta: bool, pp: int) -> dict[str, Any]:
    llm = _engine(model, delta, pp)
    core = llm.llm_engine.engine_core.engine_core
    ex = core.model_executor
    seen = _Observer(ex)
    _fault(llm, delta)
    outs = _run(llm, FREE + GUIDED, _params())
    result = {"outs": outs, "seen": dict(seen.seen), "executor": type(ex).__name__,
              "restarts": [r["cause"] for r in getattr(ex, "recoveries", [])],
              "preempted_at": seen.preempted_at, "world_size": ex.parallel_config.world_size,
              "batch_queue": core.batch_queue_size, "resolved": seen.resolved,
              "max_concurrent_batches": getattr(ex, "max_concurrent_batches", None),
              "divergent": [vars(e) for e in getattr(ex, "divergent", [])]}
    llm.llm_engine.engine_core.shutdown()
    del llm, ex
    gc.collect()
    return result


def main(model: str, path: str, pp: int) -> None:
    out: dict[str, Any] = {}
    for name, delta in (("default", False), ("delta", True)):
        out[name] = _one(model, delta, pp)
        with open(path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if sys.argv[3:] else 1)
