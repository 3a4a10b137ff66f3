"""The fuzz campaign over every decoder of a peer's bytes (issue 38).

::

    python -m engine_side.bench.fuzz --cases 1000000 [--coverage] [--figures FILE]
    python -m engine_side.bench.fuzz --cases 20000 --jobs 1          # a quick look

Cases are real frames (:mod:`engine_side.bench.fuzz_corpus`) mutated structure-aware
(:func:`~engine_side.bench.fuzz_mutate.mutate`) plus Hypothesis draws over the wire
types, fed to each target:

========== =============================================================================
core       ``codec.decode``; a Delta applied to the live replica state of its step
           (``ReplicaState.apply`` with its digest), a Snapshot loaded (``load_snapshot``)
replies    ``replies.decode_reply``
store      ``store_handles.decode_refs`` and ``unpack_item``
recording  ``recording.RecordReader`` over a whole file, each record decoded
seal       ``seal.Opener.open``
calls      the executor channel's parsers (``protocol.calls``, ``ring.unpack_frames``)
vllm       the vLLM adapter walked along the golden streams and a multimodal one (items
           inline, and by reference through a store: its references resolved, counts
           and held items part of the state): each step's frames through
           ``SchedulerOutputDecoder.decode`` in the decoder's state before that step,
           grammar frames through ``decode_grammar``, reply frames through
           ``SchedulerOutputEncoder.decode_reply``
========== =============================================================================

Every case must end in a value or a :class:`~protocol.errors.ProtocolError` subclass
(anything else is an *untyped* exception, a finding), and a refused case must leave the
state it was applied to unchanged (its fingerprint; else a *violation*).  A case whose
first frame no longer starts with its seed's first byte, or that equals its seed, runs
but is not *counted*: the million counts cases that get past the header.  Shards run as
subprocesses, half with the C kernels and half with ``DELTACAST_PURE_PYTHON=1``; a shard
killed by a signal is a *crash*, one silent for ``--hang-s`` a *hang*.  ``--coverage``
measures branch coverage of the decoder modules (coverage.py) in every shard.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from engine_side.bench.children import exits_on_sigterm
from engine_side.bench.fuzz_report import ROOT, Tally, branch_coverage, summarize

TARGETS = ("core", "replies", "store", "recording", "seal", "calls", "vllm")
#: share of a shard's cases per target (vLLM only where it is installed)
WEIGHTS = {"core": 0.37, "replies": 0.08, "store": 0.07, "recording": 0.05, "seal": 0.05,
           "calls": 0.03, "vllm": 0.35}
#: the decoder modules whose branch coverage is reported
DECODERS = ("protocol/codec.py", "protocol/ext.py", "protocol/tensors.py", "protocol/packing.py",
            "protocol/replies.py", "protocol/store_handles.py", "protocol/recording.py",
            "protocol/seal.py", "protocol/calls.py", "protocol/state.py", "protocol/membership.py",
            "protocol/snapshot.py", "protocol/columns.py", "protocol/params.py",
            "protocol/items.py", "protocol/kernels.py", "worker_side/item_resolver.py",
            "worker_side/shm_reader.py", "worker_side/vllm/decoder.py",
            "worker_side/vllm/grammar.py", "worker_side/vllm/params.py",
            "worker_side/vllm/mm.py", "engine_side/vllm/replies.py")
CASE_TIMEOUT_S = 10.0
HYPOTHESIS_SHARE = 0.02  # of a shard's core and replies cases: Hypothesis draws


class VllmState(NamedTuple):
    """What a vLLM case may change: the decoder's seq, replica state (None: not made
    yet), batches and seal counter, item counts and held store keys (None: no store),
    the encoder's seq and batches."""

    seq: int
    state: str | None
    batches: int
    seal_counter: int | None
    items: tuple[Any, ...] | None
    encoder_seq: int
    encoder_batches: int


class Hang(Exception):
    """One case ran past CASE_TIMEOUT_S (SIGALRM)."""


class Runner:
    """The cases of one shard (in this process)."""

    def __init__(self, seed: int, vllm: bool) -> None:
        from engine_side.bench import fuzz_corpus as fc
        from protocol.errors import ProtocolError

        self.fc, self.typed = fc, ProtocolError
        self.rng = random.Random(seed)
        self.chains = fc.core_chains()
        self.core = fc.core_seeds(self.chains)
        self.replies = fc.reply_seeds()
        self.refs, self.items = fc.store_seeds()
        self.recording = fc.recording_seed(self.core, self.replies)
        self.seals = fc.seal_seeds()
        self.calls = fc.call_seeds()
        self.vllm = fc.vllm_chains() if vllm else []
        self.tallies = {t: Tally() for t in TARGETS}
        # the recording target's scratch file (removed with the fuzzer, or at exit)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="dc-fuzz-")
        self._tmp = Path(self._tmpdir.name) / "r.rec"

    def close(self) -> None:
        """Remove the scratch directory (else removed when the runner is collected)."""
        self._tmpdir.cleanup()

    # -- one case ------------------------------------------------------------------------
    def case(self, target: str, frames: list[bytes], seed: list[bytes], how: str,
             run: Callable[[list[bytes]], Any],
             state: Callable[[], Any] | None = None) -> Any:
        """Run ``run(frames)``; tally it; the value, or None when refused."""
        t = self.tallies[target]
        t.cases += 1
        t.hows[how] += 1
        if frames and frames[0] and seed and frames[0][:1] == seed[0][:1] and frames != seed:
            t.counted += 1
        before = state() if state is not None else None
        signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
        try:
            value = run(frames)
        except Hang:
            t.hangs += 1
            self._finding(t, "hang", frames, how)
            return None
        except self.typed as exc:
            t.rejected += 1
            t.errors[type(exc).__name__] += 1
            after = state() if state is not None else None
            if after != before:
                t.violations += 1
                what = ",".join(f for f in before._fields if getattr(before, f) != getattr(
                    after, f)) if isinstance(before, VllmState) else "state"
                t.changed[f"{how.split(':')[0]} {what}"] += 1
                self._finding(t, f"state changed ({what})", frames, how, exc)
            return None
        except Exception as exc:  # the finding this campaign looks for
            t.untyped += 1
            t.errors[type(exc).__name__] += 1
            self._finding(t, "untyped", frames, how, exc)
            return None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        t.decoded += 1
        return value

    def _finding(self, t: Tally, kind: str, frames: list[bytes], how: str,
                 exc: BaseException | None = None) -> None:
        if len(t.findings) < 20:
            t.findings.append({"kind": kind, "how": how, "frames": [f.hex() for f in frames],
                               "error": "" if exc is None else "".join(
                                   traceback.format_exception_only(exc)).strip()[:500]})

    # -- targets ---------------------------------------------------------------------------
    def core_case(self) -> None:
        from protocol import codec
        from protocol.messages import Delta, Snapshot
        from protocol.snapshot import load_snapshot

        rng, fc = self.rng, self.fc
        chain = rng.choice(self.chains)
        k = rng.randrange(len(chain.frames))
        seed = chain.frames[k] if rng.random() < 0.7 else rng.choice(self.core)
        frames, how = self._mutate(seed)
        state = chain.state(k)

        def run(f: list[bytes]) -> Any:
            msg = codec.decode(f)
            if type(msg) is Delta:
                state.apply(msg.body, expected_digest=msg.digest)
                self.tallies["core"].accepted += 1
                chain.restore(k)  # it applied: the state moved on
            elif type(msg) is Snapshot:
                load_snapshot(msg)
            return msg

        self.case("core", frames, seed, how, run, lambda: fc.fingerprint(state))

    def replies_case(self) -> None:
        from protocol.replies import decode_reply

        seed = self.rng.choice(self.replies)
        frames, how = self._mutate(seed)
        self.case("replies", frames, seed, how, decode_reply)

    def store_case(self) -> None:
        from protocol.store_handles import decode_refs, unpack_item

        if self.rng.random() < 0.5:
            seed = self.rng.choice(self.refs)
            frames, how = self._mutate(seed)
            self.case("store", frames, seed, how, lambda f: decode_refs(f[0] if f else b""))
            return
        seed, layout = self.rng.choice(self.items)
        frames, how = self._mutate(seed)
        cut = self.rng.choice((0, 0, 0, -1, 1, -8, 8))
        self.case("store", frames, seed, how,
                  lambda f: unpack_item(memoryview(f[0] if f else b""), layout + cut))

    def recording_case(self) -> None:
        from protocol import codec
        from protocol.recording import RecordReader
        from protocol.replies import decode_reply

        frames, how = self._mutate(self.recording)

        def run(f: list[bytes]) -> int:
            self._tmp.write_bytes(f[0] if f else b"")
            n = 0
            for kind, record in RecordReader(self._tmp):
                decode = codec.decode if kind == "execute_model" else decode_reply
                decode([bytes(x) for x in record])
                n += 1
            return n

        self.case("recording", frames, self.recording, how, run)

    def seal_case(self) -> None:
        from protocol.seal import Opener

        seed = self.rng.choice(self.seals)
        frames, how = self._mutate(seed)
        self.case("seal", frames, seed, how,
                  lambda f: Opener(self.fc.SECRET, b"call").open(f[0] if f else b""))

    def calls_case(self) -> None:
        kind, seed = self.rng.choice(self.calls)
        frames, how = self._mutate(seed)
        self.case("calls", frames, seed, how, lambda f: self.fc.read_call(kind, f))

    def vllm_walk(self, budget: int) -> None:
        """Walk the vLLM streams record by record, ``per`` mutated cases against each
        record in the adapter's state before it, then the real record."""
        fc, records = self.fc, sum(len(c.records) for c in self.vllm)
        per = max(1, budget // max(records, 1))
        done = 0
        while done < budget:
            for chain in self.vllm:
                dec, enc = fc.fresh_pair(chain.kv_groups, chain.store)
                for k, (kind, seed) in enumerate(chain.records):
                    for _ in range(min(per, budget - done)):
                        frames, how = self._mutate(seed)
                        moved = self._vllm_case(dec, enc, kind, frames, seed, how)
                        done += 1
                        if moved:  # accepted: the pair moved on; make it afresh
                            dec, enc = chain.replay(k)
                    fc.step(dec, enc, kind, copy.deepcopy(chain.objects[k][1]))
                    if done >= budget:
                        return

    def _vllm_case(self, dec: Any, enc: Any, kind: str, frames: list[bytes],
                   seed: list[bytes], how: str) -> bool:
        fc = self.fc

        def state() -> Any:
            s = dec.state
            opener = getattr(getattr(dec, "seals", None), "opener", None)
            items = dec.items
            return VllmState(dec.seq, None if s is None else fc.fingerprint(s),
                             len(dec.batches), getattr(opener, "counter", None),
                             None if items is None else (sorted(items.counts.items()),
                                                         sorted(items.reader.held_keys)),
                             enc.seq, len(enc.batches))

        tally = self.tallies["vllm"]
        violations = tally.violations
        out = self.case("vllm", frames, seed, f"{kind}:{how}",
                        lambda f: fc.feed(dec, enc, kind, f) or True, state)
        if out is not None and kind == "execute_model":  # (replies and grammars leave
            tally.accepted += 1  # the pair as it was)
            return True
        return tally.violations > violations  # refused, yet changed: make it afresh too

    def hypothesis_cases(self, n: int) -> None:
        """Hypothesis draws over the wire types: core messages applied, replies decoded."""
        from hypothesis import HealthCheck, Phase, given, settings

        from engine_side.bench.fuzz_mutate import message_strategy
        from protocol import codec
        from protocol.messages import MESSAGE_TYPES, Delta
        from protocol.replies import AnyReply, decode_reply, encode_reply

        replies = tuple(t for t in AnyReply.__args__)  # type: ignore[attr-defined]

        @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(message_strategy((*MESSAGE_TYPES, *replies)))
        def draw(msg: Any) -> None:
            chain = self.rng.choice(self.chains)
            k = self.rng.randrange(len(chain.frames))
            state = chain.state(k)
            if type(msg) in replies and self.rng.random() < 0.5:
                frames = [encode_reply(msg)]
                self.tallies["replies"].hypothesis += 1
                self.case("replies", frames, [b""], "hypothesis", decode_reply)
                return
            try:
                frames = [bytes(f) for f in codec.encode(msg)]
            except (OverflowError, ValueError, TypeError):
                return  # not encodable (an int past 64 bits)
            self.tallies["core"].hypothesis += 1

            def run(f: list[bytes]) -> Any:
                got = codec.decode(f)
                if type(got) is Delta:
                    state.apply(got.body, expected_digest=got.digest)
                    chain.restore(k)
                return got

            self.case("core", frames, [b""], "hypothesis", run,
                      lambda: self.fc.fingerprint(state))

        draw()

    def _mutate(self, seed: list[bytes]) -> tuple[list[bytes], str]:
        from engine_side.bench.fuzz_mutate import mutate

        other = self.rng.choice(self.core)[0]
        return mutate(self.rng, seed, other)

    # -- a shard ---------------------------------------------------------------------------
    def run(self, cases: int, progress: Callable[[int], None] = lambda n: None) -> None:
        weights = dict(WEIGHTS)
        if not self.vllm:
            weights.pop("vllm")
        total = sum(weights.values())
        budget = {t: int(cases * w / total) for t, w in weights.items()}
        hyp = int((budget["core"] + budget["replies"]) * HYPOTHESIS_SHARE)
        self.hypothesis_cases(hyp)
        if "vllm" in budget:
            self.vllm_walk(budget.pop("vllm"))
        progress(sum(t.cases for t in self.tallies.values()))
        budget["core"] -= hyp
        steps = {"core": self.core_case, "replies": self.replies_case,
                 "store": self.store_case, "recording": self.recording_case,
                 "seal": self.seal_case, "calls": self.calls_case}
        order = [t for t, n in budget.items() for _ in range(max(0, n))]
        self.rng.shuffle(order)
        for i, target in enumerate(order):
            steps[target]()
            if i % 5000 == 0:
                progress(sum(t.cases for t in self.tallies.values()))


# ---------------------------------------------------------------- shards (subprocesses)
def _alarm(*_: Any) -> None:
    raise Hang()


def _touch(path: Path, n: int) -> None:
    path.write_text(str(n))


def shard_main(args: argparse.Namespace) -> int:
    """One shard: run the cases, write the tallies (and coverage data) as JSON."""
    cov = None
    if args.coverage:
        import coverage

        cov = coverage.Coverage(branch=True, data_file=args.coverage,
                                include=[str(ROOT / p) for p in DECODERS])
        cov.start()
    signal.signal(signal.SIGALRM, _alarm)
    progress_file = Path(args.out + ".progress")
    runner = Runner(args.seed, vllm=not args.no_vllm)
    started = time.monotonic()
    try:
        runner.run(args.cases, lambda n: _touch(progress_file, n))
    finally:
        runner.close()
    seconds = time.monotonic() - started
    if cov is not None:
        cov.stop()
        cov.save()
    from protocol.kernels import NATIVE

    out = {"seed": args.seed, "kernels": "C" if NATIVE else "pure Python", "seconds": seconds,
           "tallies": {t: v.as_dict() for t, v in runner.tallies.items()}}
    Path(args.out).write_text(json.dumps(out))
    return 0


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def run_campaign(cases: int, jobs: int, shard_cases: int, coverage: bool, hang_s: float,
                 seed: int) -> dict[str, Any]:
    """Shards of ``shard_cases``, alternately C and pure Python, ``jobs`` at a time; the
    running shards go with the campaign (SIGTERM included)."""
    running: dict[int, tuple[subprocess.Popen[bytes], Path, bool]] = {}
    with exits_on_sigterm(), tempfile.TemporaryDirectory(prefix="dc-fuzz-") as tmp:
        try:
            return _campaign(Path(tmp), running, cases, jobs, shard_cases, coverage, hang_s,
                             seed)
        finally:
            for proc, _, _ in running.values():
                proc.kill()
                proc.wait()


def _campaign(work: Path, running: dict[int, tuple[subprocess.Popen[bytes], Path, bool]],
              cases: int, jobs: int, shard_cases: int, coverage: bool, hang_s: float,
              seed: int) -> dict[str, Any]:
    """The campaign's loop; ``running``, the shards under way (filled and emptied here)."""
    n = max(2, -(-cases // shard_cases))
    queue = [(i, i % 2 == 1) for i in range(n)]
    shards: list[dict[str, Any]] = []
    crashes: list[dict[str, Any]] = []
    vllm = _has_vllm()
    while queue or running:
        while queue and len(running) < jobs:
            i, pure = queue.pop(0)
            out = work / f"shard{i}.json"
            env = {**os.environ, **({"DELTACAST_PURE_PYTHON": "1"} if pure else {})}
            if not pure:
                env.pop("DELTACAST_PURE_PYTHON", None)
            cmd = [sys.executable, "-m", "engine_side.bench.fuzz", "--shard", "--seed",
                   str(seed + i), "--cases", str(shard_cases), "--out", str(out)]
            cmd += ["--coverage", str(work / f".coverage.{i}")] if coverage else []
            cmd += [] if vllm else ["--no-vllm"]
            running[i] = (subprocess.Popen(cmd, cwd=ROOT, env=env), out, pure)
        time.sleep(0.5)
        for i, (proc, out, pure) in list(running.items()):
            progress = Path(str(out) + ".progress")
            if proc.poll() is None:
                last = progress.stat().st_mtime if progress.exists() else time.time()
                if time.time() - last > hang_s:
                    proc.kill()
                    proc.wait()
                    crashes.append({"shard": i, "seed": seed + i, "pure": pure, "hang": True})
                    del running[i]
                continue
            del running[i]
            if proc.returncode != 0 or not out.exists():
                crashes.append({"shard": i, "seed": seed + i, "pure": pure,
                                "returncode": proc.returncode, "hang": False})
            else:
                shards.append(json.loads(out.read_text()))
            print(f"fuzz: shard {i} done ({len(shards)}/{n}, {len(crashes)} crashed)",
                  file=sys.stderr)
    result = summarize(shards, crashes)
    if coverage:
        result["coverage"] = branch_coverage(work)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_side.bench.fuzz",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1_000_000)
    parser.add_argument("--jobs", type=int, default=2, help="shards at a time")
    parser.add_argument("--shard-cases", type=int, default=125_000)
    parser.add_argument("--coverage", nargs="?", const="1", default="",
                        help="measure the decoders' branch coverage in every shard")
    parser.add_argument("--coverage-cases", type=int, default=0, metavar="N",
                        help="after the campaign, measure branch coverage over N more cases "
                             "(coverage.py slows a case about 8 times)")
    parser.add_argument("--hang-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figures", default="", metavar="FILE")
    parser.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--no-vllm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.shard:
        return shard_main(args)
    from engine_side.bench.figures import stamp

    started = stamp() if args.figures else None
    result = run_campaign(args.cases, args.jobs, min(args.shard_cases, args.cases),
                          bool(args.coverage), args.hang_s, args.seed)
    if args.coverage_cases and not args.coverage:
        extra = run_campaign(args.coverage_cases, args.jobs,
                             min(args.shard_cases, args.coverage_cases), True, args.hang_s,
                             args.seed + 10_000)
        result["coverage"] = {**extra["coverage"], "cases": extra["cases"],
                              "untyped": extra["untyped"], "violations": extra["violations"]}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}
                     | {"rows": [{k: v for k, v in r.items() if k != "findings"}
                                 for r in result["rows"]]}))
    if args.figures:
        from engine_side.bench.page_tables import write_figures

        write_figures(args.figures, "fuzz", result, started)
    bad = result["untyped"] + result["violations"] + result["hangs"] + result["crashed"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
