"""Subprocess script for tests/test_vllm_nodes.py: one engine of a two-node DeltaExecutor.

``python tests/vllm_nodes_run.py MODEL OUT.json BACKEND [ADDR PORT KEYS] [long]``: LLM
at TP=2 with BACKEND (``default``: vLLM's own executor, one host; ``delta``:
DeltaExecutor with rank 1 on node 1 at ADDR, ``deltacast node`` started by the test;
``ray``: DeltaExecutor placing its ranks on the Ray cluster whose head is ADDR:PORT).
It generates greedily with logprobs (the ``short`` batch); with ``norestart`` (before
the mode) a dead rank fails the engine instead of restarting its group; with ``long``,
prints ``WARM`` to stderr, then generates a long batch (``hold``: the same once OUT.go
exists; ``twice``: then writes OUT.json, prints ``SECOND`` and generates it again);
with ``skew`` (before the mode), makes rank 1 sample other tokens (a sealed callable
sent to every rank) and generates again, so the engine names rank 1 as diverged; with
``hang`` (before ``twice``), then makes rank 1 hang in its next step and generates the
long batch a third time (the test sets vLLM's step timeout); with
``tp4`` (before the mode), TP=4 in float32 (ranks 2 and 3 on node 1).
OUT.json gets the outputs, or the error that ended generation and when
(``time.time()``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12, 13] * 9]


def engine_args(model: str, backend: str, addr: str = "", port: int = 0,
                keys: str = "", restarts: bool = True, tp: int = 2) -> dict[str, Any]:
    """The LLM keyword arguments; ``deltacast node`` is given the same (tests build its
    command line from them)."""
    args: dict[str, Any] = {"model": model, "tensor_parallel_size": tp, "enforce_eager": True,
                            "max_model_len": 256, "seed": 0}
    if tp == 4:  # in float32: its all-reduce's order (gloo across hosts, vLLM's shared
        args["dtype"] = "float32"  # memory on one) moves logprobs by ~1e-6, not tokens
    if backend == "delta":
        args["distributed_executor_backend"] = "engine_side.vllm.DeltaExecutor"
        args["additional_config"] = {"deltacast_nnodes": 2, "deltacast_master_addr": addr,
                                     "deltacast_master_port": port, "deltacast_keys": keys}
    if backend == "ray":  # Ray places rank 1 (its cluster's head at ADDR:PORT)
        args["distributed_executor_backend"] = "engine_side.vllm.DeltaExecutor"
        args["additional_config"] = {"deltacast_placement": "ray",
                                     "deltacast_ray_address": f"{addr}:{port}"}
    if not restarts:
        args["additional_config"]["deltacast_restarts"] = 0
    return args


def _skew_rank1_sampler(worker: Any) -> bool:
    """Test-only fault: global rank 1 samples token + 1 from now on."""
    if worker.global_rank != 1:
        return False
    sampler = worker.worker.model_runner.sampler
    forward = sampler.forward

    def skewed(logits: Any, *args: Any, **kwargs: Any) -> Any:
        result = forward(logits, *args, **kwargs)
        result.sampled_token_ids = (result.sampled_token_ids + 1) % logits.shape[-1]
        return result

    sampler.forward = skewed
    return True


def _stall_rank1(wrapper: Any) -> bool:
    """Test-only fault: global rank 1 blocks in its next model step for good, its process
    and links alive (a deadlocked kernel)."""
    import threading

    if wrapper.global_rank != 1:
        return False
    wrapper.execute_model = lambda *args, **kwargs: threading.Event().wait()
    return True


def _outputs(outs: list[Any]) -> list[Any]:
    return [[list(o.outputs[0].token_ids),
             [sorted((k, v.logprob) for k, v in lp.items()) for lp in o.outputs[0].logprobs]]
            for o in outs]


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, out, backend, *rest = sys.argv[1:]
    addr, port, keys = (rest[0], int(rest[1]), rest[2]) if len(rest) >= 3 else ("", 0, "")
    result: dict[str, Any] = {}
    try:
        llm = LLM(**engine_args(model, backend, addr, port, keys, "norestart" not in rest,
                                4 if "tp4" in rest else 2))
        short = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
        result["short"] = _outputs(llm.generate(prompts, short))
        if "skew" in rest:
            result["skewed"] = llm.collective_rpc(_skew_rank1_sampler)
            llm.generate(prompts, short)
        if rest[-1:] not in (["long"], ["hold"], ["twice"]):
            return
        print("WARM", file=sys.stderr, flush=True)
        go = Path(out).with_suffix(".go")
        while rest[-1:] == ["hold"] and not go.exists():  # until the test says go
            time.sleep(0.1)
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        result["long"] = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, long)]
        if rest[-1:] == ["twice"]:
            with open(out, "w") as f:  # (the test may kill this process in the second)
                json.dump(result, f)
            print("SECOND", file=sys.stderr, flush=True)
            result["long2"] = [len(o.outputs[0].token_ids)
                               for o in llm.generate(prompts, long)]
            if "hang" in rest:
                result["stalled"] = llm.collective_rpc(_stall_rank1)
                result["long3"] = [len(o.outputs[0].token_ids)
                                   for o in llm.generate(prompts, long)]
    except Exception as exc:  # what the test judges: the message and when
        result["error"], result["error_at"] = f"{type(exc).__name__}: {exc}", time.time()
    finally:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
