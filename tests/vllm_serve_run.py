"""Subprocess script for tests/test_vllm_serve.py: the greedy reference and AsyncLLM.

``python tests/vllm_serve_run.py MODEL OUT.json`` generates PROMPTS greedily with
vLLM's default executor (offline ``LLM``) and then with an
``AsyncLLM`` whose engine core (its own process, vLLM's default layout) runs
DeltaExecutor.  Every prompt is a request of its own, one at a time, in both (and
in the test's ``vllm serve`` requests), so batching cannot make them differ.
ENGINE holds the engine arguments all three share.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from typing import Any

PROMPTS = ["the quick brown fox jumps over a lazy dog " * 3, "seven wizards quietly hex",
           "lazy dog " * 9 + "while the fox"]
MAX_TOKENS = 20
ENGINE: dict[str, Any] = {"enforce_eager": True, "block_size": 32, "max_model_len": 512,
                          "seed": 0, "max_num_seqs": 8, "max_num_batched_tokens": 512}
DELTA = "engine_side.vllm.DeltaExecutor"


def _record(out: Any) -> dict[str, Any]:
    c = out.outputs[0]
    return {"ids": list(c.token_ids), "text": c.text,
            "lp": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)]}


def _params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)


def default(model: str) -> list[dict[str, Any]]:
    from vllm import LLM

    llm = LLM(model=model, **ENGINE)
    outs = [_record(llm.generate([p], _params(), use_tqdm=False)[0]) for p in PROMPTS]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return outs


async def delta_async(model: str) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine_side.vllm import DeltaExecutor

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, distributed_executor_backend=DeltaExecutor, **ENGINE))
    try:
        outs = []
        for k, prompt in enumerate(PROMPTS):
            steps = [o async for o in engine.generate(prompt, _params(), request_id=f"r{k}")]
            outs.append(_record(steps[-1]))
        backend = engine.vllm_config.parallel_config.distributed_executor_backend
        return {"outs": outs, "backend": getattr(backend, "__name__", str(backend))}
    finally:
        engine.shutdown()


def main(model: str, path: str) -> None:
    out: dict[str, Any] = {"default": default(model)}
    out["async"] = asyncio.run(delta_async(model))
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
