"""Record real vLLM (CPU) runs as object streams (``engine_side/bench/objstream.py``).

Every scenario runs in a fresh child process with the tiny model; the in-process
executor's ``execute_model`` / ``sample_tokens`` are wrapped so that each
SchedulerOutput / GrammarOutput is encoded AT CALL TIME (the engine edits them
after dispatch) and each reply as it returns (an AsyncModelRunnerOutput resolved
to its ModelRunnerOutput).  Two kinds of scenario:

* batch: ``vllm_scenarios.SCENARIOS`` as they are (one ``LLM.generate`` call);
* online (:data:`ONLINE`): requests ARRIVE over time while the engine is stepped
  one ``LLMEngine.step()`` at a time, so requests join and leave every few steps.
  The run starts in steady state -- ``target`` requests at step 0 with residual
  output lengths of a running server -- then a seeded Poisson process adds
  ``target / mean_length`` requests per step for ``window`` steps; then the batch
  drains.  Output lengths are uniform in ``lengths`` (``ignore_eos``), sampling is
  mixed (greedy / top-p / top-k), ``max_num_seqs`` sits above the target.

Record (skips files already present unless ``--force``; a progress line per
scenario on stderr, the churn summary on stdout at the end)::

    python -m engine_side.bench.vllm_online --scenario all --out-dir DIR [--model DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine_side.bench.objstream import StreamWriter, iter_stream
from engine_side.bench.vllm_scenarios import (
    COMMON,
    SCENARIOS,
    _mixed_sampling,
    async_scheduling,
    build_tiny_model,
    run_child,
    text,
)

MODULE = "engine_side.bench.vllm_online"


@dataclass(frozen=True)
class Arrival:
    step: int
    rid: str
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class Online:
    """An online workload: a running batch hovering around ``target``."""

    name: str
    summary: str
    target: int
    window: int  # steps during which new requests arrive
    seed: int
    lengths: tuple[int, int] = (16, 192)
    prefix: int = 0  # words of a system prompt every request shares (prefix caching on)
    async_scheduling: bool = False
    max_model_len: int = 512
    tags: tuple[str, ...] = field(default=())
    batched_tokens: int = 0  # max_num_batched_tokens (0: vLLM's; at least max_num_seqs)

    def engine_kwargs(self) -> dict[str, Any]:
        return {**COMMON, "max_model_len": self.max_model_len,
                "max_num_seqs": max(self.target + 8, self.target * 3 // 2),
                **({"max_num_batched_tokens": self.batched_tokens}
                   if self.batched_tokens else {}),
                "enable_prefix_caching": bool(self.prefix)}

    @property
    def rate(self) -> float:
        """Arrivals per step keeping ``target`` running (Little's law)."""
        return self.target / (sum(self.lengths) / 2)

    def arrivals(self) -> list[Arrival]:
        rng = random.Random(self.seed)
        lo, hi = self.lengths
        system = text(rng, self.prefix, self.prefix) + " " if self.prefix else ""

        def prompt() -> str:
            return system + (text(rng, 8, 24) if self.prefix else text(rng, 8, 40))

        out = []
        for i in range(self.target):  # a running server: length-biased, part done
            full = math.sqrt(lo * lo + rng.random() * (hi * hi - lo * lo))
            out.append(Arrival(0, f"warm{i}", prompt(), rng.randint(1, int(full))))
        t = rng.expovariate(self.rate)
        while t < self.window:
            out.append(Arrival(int(t), f"req{len(out)}", prompt(), rng.randint(lo, hi)))
            t += rng.expovariate(self.rate)
        return out


def _online(name: str, target: int, window: int, seed: int, **kw: Any) -> Online:
    o = Online(name, "", target, window, seed, **kw)
    extra = (f", {o.prefix}-word shared system prompt (prefix caching)" if o.prefix else "") \
        + (", async scheduling" if o.async_scheduling else "")
    summary = (f"online: ~{target} running, {o.rate:.2f} arrivals/step for {window} steps, "
               f"outputs {o.lengths[0]}-{o.lengths[1]} tokens{extra}")
    return Online(name, summary, target, window, seed, **kw)


_G = {"lengths": (8, 64), "tags": ("golden",)}
ONLINE: dict[str, Online] = {o.name: o for o in (
    _online("online8", 8, 220, seed=11),
    _online("online64", 64, 200, seed=12),
    _online("online256", 256, 200, seed=13),
    _online("online64_prefix", 64, 200, seed=14, prefix=256, max_model_len=1024),
    _online("online64_async", 64, 200, seed=15, async_scheduling=True),
    # a server at thousands of requests, for the two-host latency benchmark (vllm_link)
    _online("online4096", 4096, 300, seed=16, batched_tokens=6144, tags=("link",)),
    # short runs for the committed golden corpus (tests/golden/streams)
    _online("golden16", 16, 70, seed=21, **_G),
    _online("golden16_prefix", 16, 70, seed=22, prefix=96, **_G),
    _online("golden16_async", 16, 70, seed=23, async_scheduling=True, **_G),
)}
ALL = (*SCENARIOS, *(n for n, o in ONLINE.items() if not o.tags))


# ---------------------------------------------------------------- churn statistics
def step_row(so: Any) -> tuple[int, int, int, int, int]:
    """(batch, joined, finished, preempted, resumed) of one SchedulerOutput."""
    return (len(so.num_scheduled_tokens), len(so.scheduled_new_reqs), len(so.finished_req_ids),
            len(so.preempted_req_ids or ()), len(so.scheduled_cached_reqs.resumed_req_ids))


def summarize(rows: Iterable[tuple[int, int, int, int, int]]) -> dict[str, Any]:
    """Steps, running batch min/median/max and how many steps see requests join or leave."""
    rows = list(rows)
    batch = [r[0] for r in rows] or [0]
    return {"steps": len(rows), "batch_min": min(batch), "batch_median": statistics.median(batch),
            "batch_max": max(batch), "join_steps": sum(r[1] > 0 for r in rows),
            "leave_steps": sum(r[2] > 0 for r in rows),
            "preempt_steps": sum(r[3] > 0 for r in rows),
            "resume_steps": sum(r[4] > 0 for r in rows),
            "churn_steps": sum(any(r[1:]) for r in rows)}


# ---------------------------------------------------------------- recording
def engine_executor(llm: Any) -> Any:
    """The in-process executor of an ``LLM`` built with VLLM_ENABLE_V1_MULTIPROCESSING=0."""
    return llm.llm_engine.engine_core.engine_core.model_executor


def install(executor: Any, writer: StreamWriter, on_step: Callable[[Any], None]) -> None:
    """Wrap ``executor`` so every message and reply is added to ``writer`` (calls run
    blocking; a finished Future is returned when the engine asks for one)."""
    execute, sample = executor.execute_model, executor.sample_tokens

    def reply(kind: str, result: Any, non_block: bool) -> Any:
        if isinstance(result, Future):
            result = result.result()
        if hasattr(result, "get_output"):  # an AsyncModelRunnerOutput
            result = result.get_output()
        writer.add(kind, result)
        if not non_block:
            return result
        fut: Future[Any] = Future()
        fut.set_result(result)
        return fut

    def execute_model(scheduler_output: Any, non_block: bool = False) -> Any:
        writer.add("execute_model", scheduler_output)
        on_step(scheduler_output)
        return reply("reply", execute(scheduler_output, non_block=False), non_block)

    def sample_tokens(grammar_output: Any, non_block: bool = False) -> Any:
        writer.add("sample_tokens", grammar_output)
        return reply("sample_reply", sample(grammar_output, non_block=False), non_block)

    executor.execute_model = execute_model
    executor.sample_tokens = sample_tokens


def drive(engine: Any, arrivals: list[Arrival]) -> None:
    """Step ``engine`` until every request finished, adding each at its arrival step
    (the clock jumps ahead when the engine is idle)."""
    pending = deque(sorted(arrivals, key=lambda a: a.step))
    clock, i = 0, 0
    while pending or engine.has_unfinished_requests():
        if pending and not engine.has_unfinished_requests():
            clock = max(clock, pending[0].step)
        while pending and pending[0].step <= clock:
            a = pending.popleft()
            engine.add_request(a.rid, a.prompt, _mixed_sampling(i, a.max_tokens))
            i += 1
        engine.step()
        clock += 1


def regenerate_hint(name: str) -> str:
    return (f"python -m {MODULE} --scenario {name} --out-dir DIR --force (the committed "
            "golden corpus tests/golden/streams: python tests/golden_streams.py --only real)")


def record(model: Path, name: str, path: Path) -> dict[str, Any]:
    """Run scenario ``name`` in this process, writing its object stream to ``path``;
    returns the stats (also in the file's meta)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm import LLM

    spec: Any = ONLINE.get(name) or SCENARIOS[name]
    kwargs = spec.engine_kwargs()
    with async_scheduling(spec.async_scheduling):
        llm = LLM(model=str(model), **kwargs)
    writer = StreamWriter()
    rows: list[tuple[int, int, int, int, int]] = []
    install(engine_executor(llm), writer, lambda so: rows.append(step_row(so)))
    t0 = time.perf_counter()
    if isinstance(spec, Online):
        arrivals = spec.arrivals()
        drive(llm.llm_engine, arrivals)
        requests, online = len(arrivals), {**asdict(spec), "rate": spec.rate}
    else:
        prompts, params = spec.requests()
        llm.generate(prompts, params, use_tqdm=False)
        requests, online = len(prompts), None
    stats = {**summarize(rows), "requests": requests, "seconds": time.perf_counter() - t0,
             "records": len(writer.kinds)}
    meta = {"what": f"vLLM {vllm.__version__} CPU run of scenario {name!r}: the objects "
                    "its executor was passed and returned, one record per call",
            "scenario": name, "summary": spec.summary, "vllm": vllm.__version__,
            "model": "vllm_scenarios.build_tiny_model (random 2-layer Llama, 512 tokens)",
            "engine_kwargs": kwargs, "online": online,
            "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config
                                     .async_scheduling),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "regenerate": regenerate_hint(name), "stats": stats}
    stats["bytes"] = writer.write(path, meta)
    return stats


def record_many(model: Path, names: Iterable[str], out_dir: Path,
                force: bool = False) -> dict[str, dict[str, Any]]:
    """Each scenario in a fresh child process to ``out_dir/NAME.dcobj``; a progress
    line each on stderr; returns the stats by name (read back for files kept)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(names)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names, 1):
            path, t0 = out_dir / f"{name}.dcobj", time.perf_counter()
            if path.exists() and not force:
                stats, note = dict(iter_stream(path)[0]["stats"]), "kept"
                stats["bytes"] = path.stat().st_size
            else:
                out = Path(tmp) / f"{name}.json"
                stats = run_child(MODULE, ["--child", "--scenario", name, "--model", str(model),
                                           "--out-dir", str(out_dir), "--stats", str(out)],
                                  out, f"recording {name}",
                                  env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
                note = f"recorded in {time.perf_counter() - t0:.0f} s"
            result[name] = stats
            print(f"[{i}/{len(names)}] {name}: {stats['steps']} steps, {stats['requests']} "
                  f"requests, {stats['seconds']:.0f} s stepping, {stats['bytes'] / 1e6:.2f} MB "
                  f"({note})", file=sys.stderr, flush=True)
    return result


def render(stats: dict[str, dict[str, Any]]) -> str:
    """The churn table: does the batch really turn over?"""
    head = ("| scenario | steps | requests | batch min / median / max | join steps | "
            "leave steps | preempt / resume steps | churn steps | s | MB |")
    lines = [head, "|" + "---|" * 10]
    for name, s in stats.items():
        lines.append(
            f"| {name} | {s['steps']} | {s['requests']} | {s['batch_min']} / "
            f"{s['batch_median']:g} / {s['batch_max']} | {s['join_steps']} | "
            f"{s['leave_steps']} | {s['preempt_steps']} / {s['resume_steps']} | "
            f"{s['churn_steps']} ({s['churn_steps'] / max(1, s['steps']):.0%}) | "
            f"{s['seconds']:.0f} | {s['bytes'] / 1e6:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", required=True, help="NAME[,NAME...] or all: "
                        + ", ".join((*SCENARIOS, *ONLINE)))
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--model", type=Path, help="tiny model dir (default OUT_DIR/tiny-llama; "
                        "built if missing)")
    parser.add_argument("--force", action="store_true", help="record files already present")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stats", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = list(ALL) if args.scenario == "all" else args.scenario.split(",")
    unknown = [n for n in names if n not in SCENARIOS and n not in ONLINE]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}")
    if args.child:
        stats = record(args.model, names[0], args.out_dir / f"{names[0]}.dcobj")
        if args.stats:
            args.stats.write_text(json.dumps(stats))
        return 0
    model = build_tiny_model(args.model or args.out_dir / "tiny-llama")
    print(render(record_many(model, names, args.out_dir, args.force)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
