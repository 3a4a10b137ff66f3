"""One engine of the two-host benchmark (``engine_side.bench.vllm_nodes``), run in host A.

``python -m engine_side.bench.vllm_nodes_engine CONFIG.json OUT.json``: LLM at TP=2 with
the arguments in CONFIG (``llm``: LLM's keyword arguments; ``prompts``, ``max_tokens``,
``fault``; ``serving``: requests arriving over time instead, as
:func:`engine_side.bench.vllm_serving.serve` adds them).  It generates once to warm up,
then a timed batch (or the arrivals), reading the TCP sockets
of this namespace that lead to the other host before and after it (``ss``): the bytes
on the engine process's sockets (the step channel: calls and replies) apart from the
ranks' (collectives).  With ``fault``, it prints ``WARM`` on stderr after the warm-up
and records when the timed batch failed instead.  OUT.json gets what it saw.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from typing import Any

_SOCKET = re.compile(r"(\S+):(\d+)\s+(\S+):(\d+)\s+users:\(\(\"[^\"]*\",pid=(\d+)")


def cross_host_bytes(peer: str, channel_pids: set[int]) -> Counter[str]:
    """Bytes sent and received on established TCP sockets to ``peer``, as
    ``channel`` (owned by ``channel_pids``) and ``collectives`` (any other process)."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    totals: Counter[str] = Counter()
    owner = None
    for line in out.splitlines():
        m = _SOCKET.search(line)
        if m:
            owner = ("channel" if int(m.group(5)) in channel_pids else "collectives") \
                if m.group(3).strip("[]").removeprefix("::ffff:") == peer else None
            continue
        if owner is not None:
            for key in ("bytes_acked", "bytes_received"):
                got = re.search(key + r":(\d+)", line)
                totals[owner] += int(got.group(1)) if got else 0
            owner = None
    return totals


def _engine_pids() -> set[int]:
    """This process and the engine core's (the executor lives there, not in the ranks)."""
    import psutil

    me = psutil.Process()
    return {me.pid} | {p.pid for p in me.children(recursive=True)
                       if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()}


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        config = json.load(f)
    out_path = sys.argv[2]
    peer = config["peer"]
    result: dict[str, Any] = {}
    try:
        llm = LLM(**config["llm"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in config["prompts"]]
        params = SamplingParams(max_tokens=config["max_tokens"], temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))
        pids = _engine_pids()
        if config.get("fault"):
            print("WARM", file=sys.stderr, flush=True)
        before = cross_host_bytes(peer, pids)
        serving = config.get("serving")
        if serving:  # requests arriving over time (engine_side.bench.vllm_serving)
            from engine_side.bench.vllm_serving import arrivals, serve

            result.update(serve(llm, arrivals(serving["requests"], serving["rate"],
                                              serving["max_tokens"])))
        else:
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            result["seconds"] = time.perf_counter() - start
            result["tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
            result["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        after = cross_host_bytes(peer, pids)
        result["bytes"] = {k: after[k] - before[k] for k in ("channel", "collectives")}
    except Exception as exc:
        result["error"], result["error_at"] = f"{type(exc).__name__}: {exc}", time.time()
    finally:
        with open(out_path, "w") as f:
            json.dump(result, f)
    if "error" in result:
        sys.stdout.flush()
        os._exit(1)  # a failed engine may hang in its teardown; the harness reaps the rest


if __name__ == "__main__":
    main()
