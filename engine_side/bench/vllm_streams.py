"""Real vLLM (CPU) streams against vLLM's own serializer: record, replay, judge.

Everything at once (the BENCHMARKS command)::

    python -m engine_side.bench.vllm_streams [--cache out/objstreams] [--fresh] \\
        [--passes 3] [--check] [--json FILE] [--figures docs/benchmarks/vllm_streams.json]

records every scenario -- the coverage and batch scenarios of
``engine_side/bench/vllm_scenarios.py`` and the online ones of
``engine_side/bench/vllm_online.py`` -- as object streams (``*.dcobj``, vLLM's own
per-step objects) into the cache directory, each in a fresh vLLM process with the
tiny model (built there if missing), one progress line per scenario on stderr;
streams already in the cache are reused unless ``--fresh``.  Then every recorded
workload, and the synthetic streams (steady decode at 256 and 4096 requests,
continuous batching at 16 and 256), is replayed through deltacast's encoder and
decoder, vLLM's MessageQueue serializer, bare pickle, the Python floor and a minimal
stateful channel (:func:`engine_side.bench.vllm_replay.replay`, ``--passes`` replays
per stream) and the tables and the targets (``engine_side/bench/vllm_table.py``) are printed.

One scenario live, in this process (the adapter's integration tests run this):
``--scenario NAME [--model DIR] [--out STATS.json] [--record FILE.dcrec] [--check]``
runs ``LLM.generate`` with every message encoded, decoded by a fresh worker-side
decoder and (``--check``) compared with the original as it passes, and prints the
run's stats (JSON; exit status 1 on a difference).

``--replay FILE...`` measures existing object streams instead of recording;
``--render JSON`` prints the tables of a saved document.  ``--check`` also runs each
stream through a fresh encoder / decoder pair, untimed, and compares every decoded
object with the original (``tests/vllm_equal.py``); any difference makes the exit
status 1 (and no figures are written).

The document (``--json``)::

    meta       date, commit, command, load, passes, check, kernels (the C kernels in
               use), vllm (its version), baselines
    workloads  {name: replay summary + request_fields, stream (its recording's
               summary and stats), check (with --check)}
    synthetic  {"256", "4096", "churn-16", "churn-256": replay summary + request_fields,
               check (with --check)}
    total      {request, reply: bytes, vllm_bytes, us, vllm_us, bare_us, floor_us, and
               (request, where the minimal channel carried every stream) minimal_us,
               minimal_bytes, digested_us, summed over the recorded workloads}
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from engine_side.bench.figures import command, machine, stamp
from engine_side.bench.page_tables import write_figures
from engine_side.bench.vllm_replay import (
    pickled,
    replay,
    round_trip,
    synthetic_churn,
    synthetic_decode,
)
from engine_side.bench.vllm_scenarios import ROOT, build_tiny_model

__all__ = ["build_tiny_model", "record", "record_scenario", "replay_all", "check_stream"]

DEFAULT_CACHE = Path("out/objstreams")
SYNTHETIC = (256, 4096)  # steady decode at N requests
CHURN = (16, 256)  # continuous batching at N requests
SYNTHETIC_STEPS = 20
TOTALS = ("bytes", "vllm_bytes", "us", "vllm_us", "bare_us", "floor_us", "minimal_us",
          "minimal_bytes", "digested_us")
VLLM_SERIALIZER = "vLLM's MessageQueue serializer"
BARE = "bare pickle.dumps + loads"
FLOOR = "the step's SchedulerOutput built in Python from its own lists, fresh containers"
MINIMAL = ("a minimal stateful channel (minimal_stateful: plain lists, handles, departures "
           "from prediction, a msgspec body; no digest, no checks)")
DIGESTED = "the minimal stateful channel keeping a state digest of deltacast's terms"
Messages = list[tuple[str, Any]]


# ---------------------------------------------------------------- recording
def scenario_names() -> list[str]:
    """Every recorded workload: coverage, batch and online scenarios (no golden ones)."""
    from engine_side.bench.vllm_online import ALL

    return list(ALL)


def known_scenarios() -> set[str]:
    """Every scenario the recorder knows (the golden corpus's short online runs too)."""
    from engine_side.bench.vllm_online import ONLINE
    from engine_side.bench.vllm_scenarios import SCENARIOS

    return {*SCENARIOS, *ONLINE}


def record(cache: Path, names: Sequence[str], fresh: bool = False,
           model: Path | None = None) -> dict[str, Path]:
    """Each scenario's object stream in ``cache`` (recorded there unless present, or
    always with ``fresh``; one progress line per scenario on stderr)."""
    from engine_side.bench import vllm_scenarios
    from engine_side.bench.vllm_online import record_many

    paths = {n: cache / f"{n}.dcobj" for n in names}
    model = model or cache / "tiny-llama"
    if fresh or not all(p.exists() for p in paths.values()):
        model = vllm_scenarios.build_tiny_model(model)
    record_many(model, names, cache, force=fresh)
    return paths


def stream_files(names: Iterable[str]) -> tuple[str, ...]:
    """Object stream files for ``names``: files (*.dcobj) as they are, scenario names
    recorded into DEFAULT_CACHE unless there already; ValueError for anything else."""
    files, scenarios = [], known_scenarios()
    for name in names:
        if name.endswith(".dcobj"):
            if not Path(name).is_file():
                raise ValueError(f"no such object stream: {name}")
            files.append(name)
        elif name in scenarios:
            files.append(str(record(DEFAULT_CACHE, [name])[name]))
        else:
            raise ValueError(f"{name!r} is neither an object stream (*.dcobj) nor one of "
                             f"the recorded scenarios: {', '.join(sorted(scenarios))}")
    return tuple(files)


def load(path: Path) -> tuple[dict[str, Any], Messages]:
    """(meta, records) of an object stream."""
    from engine_side.bench.objstream import read_stream

    return read_stream(path)


# ---------------------------------------------------------------- exactness
def _differences() -> Callable[[Any, Any], list[str]]:
    """``tests/vllm_equal.py``'s strict ``differences`` (the tests' helper)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from vllm_equal import differences

    return differences  # type: ignore[no-any-return]


def check_stream(messages: Messages, limit: int = 20) -> dict[str, Any]:
    """Every message through a fresh encoder → decoder pair (replies the other way),
    each decoded object compared with a copy of the original taken before it was
    encoded: ``{"records", "differences", "first": [up to limit]}``."""
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    differences = _differences()
    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    found: list[str] = []
    for i, (kind, obj) in enumerate(messages):
        expected = copy.deepcopy(obj)
        got = round_trip(enc, dec, kind, obj)
        found += [f"record {i} ({kind}): {d}" for d in differences(expected, got)]
    return {"records": len(messages), "differences": len(found), "first": found[:limit]}


# ---------------------------------------------------------------- replaying
def replay_stream(messages: Messages, passes: int, check: bool) -> dict[str, Any]:
    """One stream's replay summary, its request bytes per wire field and (``check``)
    its exactness."""
    fields: Counter[str] = Counter()
    out = replay(messages, passes, fields)
    out["request_fields"] = dict(fields.most_common())
    if check:
        out["check"] = check_stream(messages)
    return out


def _stream_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta[k] for k in ("summary", "vllm", "async_scheduling", "stats") if k in meta}


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def replay_all(paths: dict[str, Path], passes: int = 1, check: bool = False,
               synthetic: Iterable[int] | None = None, churn: Iterable[int] | None = None,
               steps: int | None = None) -> dict[str, Any]:
    """The document without its meta: every stream at ``paths`` (by name), the
    synthetic streams (steady decode at each ``synthetic`` size, continuous batching at
    each ``churn`` size, ``steps`` steps each; None: :data:`SYNTHETIC`, :data:`CHURN`,
    :data:`SYNTHETIC_STEPS`), the totals over the recorded ones."""
    synthetic = SYNTHETIC if synthetic is None else synthetic
    churn = CHURN if churn is None else churn
    n_steps = SYNTHETIC_STEPS if steps is None else steps
    doc: dict[str, Any] = {"workloads": {}, "synthetic": {}}
    for i, (name, path) in enumerate(paths.items(), 1):
        meta, messages = load(path)
        row = replay_stream(messages, passes, check)
        row["stream"] = _stream_meta(meta)
        doc["workloads"][name] = row
        req = row["request"]
        _progress(f"[{i}/{len(paths)}] replayed {name}: {row['steps']} steps, "
                  f"{req['vllm_bytes'] / max(1, req['bytes']):.1f}x fewer request bytes"
                  + (f", {row['check']['differences']} differences" if check else ""))
    made: list[tuple[str, Callable[[], Messages]]] = [
        *((str(n), lambda n=n: synthetic_decode(n, n_steps)) for n in synthetic),
        *((f"churn-{n}", lambda n=n: synthetic_churn(n, n_steps)) for n in churn)]
    for name, make in made:
        doc["synthetic"][name] = replay_stream(make(), passes, check)
        _progress(f"replayed synthetic-{name}")
    doc["total"] = totals(doc["workloads"])
    return doc


def totals(workloads: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each path's bytes and µs summed over ``workloads``."""
    return {path: {k: sum(w[path][k] for w in workloads.values()) for k in TOTALS
                   if all(k in w[path] for w in workloads.values())}
            for path in ("request", "reply")}


def differences_in(doc: dict[str, Any]) -> int:
    """Round-trip differences the document's checks found (0 without checks)."""
    streams = [*doc["workloads"].values(), *doc.get("synthetic", {}).values()]
    return sum(s.get("check", {}).get("differences", 0) for s in streams)


def _native() -> bool:
    """Whether the protocol's C kernels (``protocol.kernels.NATIVE``) are in use."""
    from protocol.kernels import NATIVE

    return NATIVE


def meta(passes: int, check: bool) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else ""),
            "command": command(), "load": os.getloadavg()[0], "passes": passes,
            "check": check,
            "kernels": _native(), "vllm": machine()["vllm"],
            "baselines": {"vllm": VLLM_SERIALIZER, "bare": BARE, "floor": FLOOR,
                          "minimal": MINIMAL, "digested": DIGESTED}}


# ---------------------------------------------------------------- one scenario, live
class _Checker:
    """Compares each original with its decoded copy as it passes; sizes vLLM's own
    message beside it; counts the stream shapes the run showed."""

    def __init__(self, check: bool) -> None:
        self.diff = _differences() if check else None
        self.failures: list[str] = []
        self.vllm_rows: list[tuple[str, int]] = []
        self.seen: Counter[str] = Counter()

    def __call__(self, kind: str, original: Any, decoded: Any) -> None:
        if self.diff is not None:
            self.failures += [f"{kind}: {d}" for d in self.diff(original, decoded)[:5]]
        self.vllm_rows.append((kind, pickled(kind, original)[0]))
        if kind == "execute_model":
            so = original
            c = so.scheduled_cached_reqs
            self.seen.update({
                "preempted": bool(so.preempted_req_ids), "resumed": bool(c.resumed_req_ids),
                "spec_tokens": bool(so.scheduled_spec_decode_tokens),
                "chunked": any(n > 32 for n in so.num_scheduled_tokens.values())
                and bool(c.req_ids) and any(o == 0 for o in c.num_output_tokens),
                "prefix_hit": any(nr.num_computed_tokens > 0 for nr in so.scheduled_new_reqs),
                "all_token_ids": bool(c.all_token_ids)})
        elif kind == "sample_tokens" and original is not None:
            self.seen["grammar"] += 1


def _live(rows: Sequence[tuple[Any, ...]], vllm_rows: list[tuple[str, int]]) -> dict[str, Any]:
    """Mean bytes per step measured inside the vLLM process (ours vs vLLM's message)."""
    steps = max(1, sum(1 for r in rows if r[0] == "execute_model"))
    out: dict[str, Any] = {"steps": steps}
    for path, kinds in (("request", ("execute_model", "sample_tokens")),
                        ("reply", ("reply", "sample_reply"))):
        out[path] = {"bytes_per_step": sum(r[1] for r in rows if r[0] in kinds) / steps,
                     "vllm_bytes_per_step": sum(r[1] for r in vllm_rows if r[0] in kinds)
                     / steps}
    return out


def record_scenario(model: Path, name: str, out: Path | None, check: bool,
                    recording: Path | None = None) -> dict[str, Any]:
    """Run scenario ``name`` (``vllm_scenarios.SCENARIOS``) in this process, every
    message through the adapter as it passes (and into ``recording``, a ``deltacast
    record`` file); returns the stats (also written to ``out``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm import LLM

    from engine_side.bench.vllm_scenarios import SCENARIOS, async_scheduling
    from engine_side.report.record import Recorder, RecordWriter, engine_executor
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    scenario = SCENARIOS[name]
    with async_scheduling(scenario.async_scheduling):
        llm = LLM(model=str(model), **scenario.engine_kwargs())
    checker = _Checker(check)
    writer = None if recording is None else RecordWriter(
        recording, meta={"scenario": name}, vllm_version=vllm.__version__)
    recorder = Recorder(writer, SchedulerOutputEncoder(), SchedulerOutputDecoder(), checker)
    recorder.install(engine_executor(llm))
    prompts, params = scenario.requests()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if writer is not None:
        writer.close()
    config = llm.llm_engine.vllm_config.scheduler_config
    stats = {"scenario": name, "failures": checker.failures[:50], "seen": dict(checker.seen),
             "vllm": vllm.__version__, "async_scheduling": bool(config.async_scheduling),
             "prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in outputs),
             "output_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
             "outputs": [[list(c.token_ids) for c in o.outputs] for o in outputs],
             "live": _live(recorder.stats, checker.vllm_rows)}
    if out is not None:
        out.write_text(json.dumps(stats))
    return stats


# ---------------------------------------------------------------- command
def run(args: argparse.Namespace) -> int:
    from engine_side.bench.vllm_table import render

    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    if args.scenario:
        model = build_tiny_model(Path(args.model) if args.model else Path(args.cache)
                                 / "tiny-llama")
        stats = record_scenario(model, args.scenario, Path(args.out) if args.out else None,
                                args.check, Path(args.record) if args.record else None)
        print(json.dumps({k: v for k, v in stats.items() if k != "outputs"}, indent=1))
        return 1 if stats["failures"] else 0
    started = stamp() if args.figures else None  # for the figures envelope
    if args.replay:
        paths = {Path(p).stem: Path(p) for p in args.replay}
    else:
        names = args.only.split(",") if args.only else scenario_names()
        unknown = sorted(set(names) - known_scenarios())
        if unknown:
            print(f"error: unknown scenario(s) {', '.join(unknown)}; known: "
                  f"{', '.join(sorted(known_scenarios()))}", file=sys.stderr)
            return 2
        paths = record(Path(args.cache), names, args.fresh,
                       Path(args.model) if args.model else None)
    doc = {"meta": meta(args.passes, args.check),
           **replay_all(paths, args.passes, args.check)}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(render(doc))
    failures = differences_in(doc)
    if failures:
        _progress(f"{failures} round-trip differences: see the checks in the document")
        return 1
    if args.figures:  # the envelope BENCHMARKS.md is generated from
        write_figures(args.figures, "vllm_streams", doc, started)
    return 0


def _scenarios() -> tuple[str, ...]:
    from engine_side.bench.vllm_scenarios import SCENARIOS

    return tuple(SCENARIOS)


def _positive(text: str) -> int:
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache", default=str(DEFAULT_CACHE),
                        help=f"where recorded streams are kept (default {DEFAULT_CACHE})")
    parser.add_argument("--fresh", action="store_true",
                        help="record every scenario again, even when its stream is cached")
    parser.add_argument("--model", default="",
                        help="tiny model dir (built if missing; default CACHE/tiny-llama)")
    parser.add_argument("--only", default="", metavar="NAME,NAME",
                        help="record and replay only these scenarios")
    parser.add_argument("--scenario", default="", choices=("", *_scenarios()),
                        metavar="NAME", help="run this one scenario live, in this process")
    parser.add_argument("--out", default="", help="with --scenario: write its stats JSON here")
    parser.add_argument("--record", default="",
                        help="with --scenario: also write a deltacast recording here")
    parser.add_argument("--replay", nargs="+", default=[], metavar="FILE",
                        help="replay these object streams (*.dcobj) instead of recording")
    parser.add_argument("--passes", type=_positive, default=3,
                        help="replays per stream; each step's µs is its median over them "
                             "(default 3)")
    parser.add_argument("--check", action="store_true",
                        help="also compare every decoded object with the original (any "
                             "difference: exit status 1)")
    parser.add_argument("--json", default="", help="write the replay document (JSON) here")
    parser.add_argument("--render", default="", help="print the tables of a saved JSON document")
    parser.add_argument("--figures", default="", metavar="FILE",
                        help="also write the figures envelope for BENCHMARKS.md here "
                             "(docs/benchmarks/vllm_streams.json)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
