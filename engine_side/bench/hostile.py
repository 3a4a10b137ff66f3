"""Hostile peers against a real ``deltacast demo --reference``: the targets of issue 38.

::

    python -m engine_side.bench.hostile [--reps 3] [--requests 128] [--figures FILE]

Scenarios (each a real engine with two local workers, and a peer of
:mod:`engine_side.bench.hostile_peer` beside them):

* ``mix tcp+CURVE`` / ``mix ipc``: a peer with an allow-listed key of its own (tcp), or
  any process of the user (ipc), runs every attack for the whole run.  Target: every
  request completes with the reference's outputs, no honest rank flagged, exit 0.
* ``snapshot flood``: a peer speaking for a rank of its own (``--remote-workers 1``:
  the engine binds its key to rank 2) sends snapshot requests as fast as it can, its
  process capped to a quarter of a core (cgroup ``cpu.max``, or the v1 CFS quota).
  Target: step throughput within 20% of the same run without it, no dead-rank event.
  With ``--ack-spin-ms 0`` (an engine that sleeps while it waits) the same pair gives
  the engine's CPU per rejected message.
* ``handshake flood``: CURVE handshakes with unknown keys, 32 sockets at a time, from a
  process capped to a quarter of a core (a remote attacker's CPU is not the engine
  host's; the engine's cost per handshake is the same).  Target: throughput within 20%
  of the run without it.  Then the same from an uncapped process on the engine's own
  cores (reported: the flooding process itself takes a core of this host).

Prints one JSON object (``--figures FILE`` writes the figures envelope).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine_side.bench.figures import ROOT, stamp

QUARTER = 0.25  # of one core


def _cpu_cgroup(name: str, cores: float) -> tuple[Path, Path] | None:
    """A cgroup limited to ``cores`` of CPU: (its directory, its procs file); v2's
    ``cpu.max`` where the cpu controller is on the unified hierarchy, else v1's CFS quota.
    None when neither can be made (not root, no cgroup fs)."""
    period = 100_000
    for base, files in ((Path("/sys/fs/cgroup"), ("cpu.max",)),
                        (Path("/sys/fs/cgroup/unified"), ("cpu.max",)),
                        (Path("/sys/fs/cgroup/cpu"), ("cpu.cfs_period_us", "cpu.cfs_quota_us"))):
        if files == ("cpu.max",):
            controllers = base / "cgroup.controllers"
            if not controllers.exists() or "cpu" not in controllers.read_text().split():
                continue
        elif not (base / "cpu.cfs_quota_us").exists():
            continue
        path = base / name
        try:
            path.mkdir(exist_ok=True)
            if files == ("cpu.max",):
                (path / "cpu.max").write_text(f"{int(cores * period)} {period}\n")
            else:
                (path / "cpu.cfs_period_us").write_text(f"{period}\n")
                (path / "cpu.cfs_quota_us").write_text(f"{int(cores * period)}\n")
        except OSError:
            continue
        return path, path / "cgroup.procs"
    return None


def cgroup_available() -> bool:
    """Whether a CPU-capped cgroup can be made here (root, a cgroup fs with cpu)."""
    group = _cpu_cgroup(f"dc-probe-{os.getpid()}", 1.0)
    if group is None:
        return False
    with contextlib.suppress(OSError):
        group[0].rmdir()
    return True


@contextlib.contextmanager
def keys() -> Iterator[Path]:
    """A directory with engine, worker and hostile CURVE key pairs."""
    from engine_side.security import generate_keypair

    with tempfile.TemporaryDirectory(prefix="dc-hostile-") as tmp:
        for name in ("engine", "worker", "hostile"):
            generate_keypair(Path(tmp), name)
        yield Path(tmp)


def demo(endpoint: str, keydir: Path | None, requests: int, extra: list[str],
         peer: list[str] | None = None, cap: float | None = None,
         timeout: float = 600) -> dict[str, Any]:
    """One ``deltacast demo --reference`` run with an optional hostile peer beside it;
    returns the demo's exit code, summary and stderr tail, and the peer's counts."""
    cmd = [sys.executable, "-m", "engine_side.cli", "demo", "--no-progress", "--json",
           "--reference", "--requests", str(requests), "--max-tokens", "48",
           "--endpoint", endpoint, *extra]
    peer_cmd: list[str] = []
    if keydir is not None:
        cmd += ["--server-secret-key", str(keydir / "engine.key_secret"),
                "--worker-secret-key", str(keydir / "worker.key_secret"),
                "--allow-key", str(keydir / "hostile.key")]
        peer_cmd = ["--server-key", str(keydir / "engine.key"),
                    "--secret-key", str(keydir / "hostile.key_secret")]
    engine = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, stdin=subprocess.DEVNULL)
    hostile, group = None, None
    try:
        if peer is not None:
            hostile, group = _start_peer([sys.executable, "-m",
                                          "engine_side.bench.hostile_peer", "--connect",
                                          endpoint, *peer_cmd, *peer], cap)
        out, err = engine.communicate(timeout=timeout)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        peer_out = _stop_peer(hostile, group)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return {"code": engine.returncode, "summary": json.loads(lines[-1]) if lines else {},
            "stderr": err[-4000:], "peer": peer_out}


def _start_peer(cmd: list[str], cap: float | None
                ) -> tuple[subprocess.Popen[str], Path | None]:
    group = _cpu_cgroup(f"dc-hostile-{os.getpid()}", cap) if cap is not None else None
    if cap is not None and group is None:
        raise RuntimeError("cannot make a CPU-capped cgroup here (needs root and cgroup fs)")
    if group is not None:  # the shell joins the cgroup, then becomes the peer
        cmd = ["sh", "-c", f'echo $$ > {group[1]} && exec "$@"', "sh", *cmd]
    proc = subprocess.Popen([*cmd, "--seconds", "600"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, stdin=subprocess.DEVNULL)
    return proc, group[0] if group is not None else None


def _stop_peer(proc: subprocess.Popen[str] | None, group: Path | None) -> dict[str, Any]:
    if proc is None:
        return {}
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    if group is not None:
        with contextlib.suppress(OSError):
            group.rmdir()
    lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"exit": proc.returncode}


def _dead_events(summary: dict[str, Any]) -> int:
    return sum(e.get("event") == "WorkerDead" for e in summary.get("events", []))


def honest(run: dict[str, Any], requests: int) -> bool:
    """Every request done with the reference's outputs, no rank flagged, exit 0."""
    s = run["summary"]
    return (run["code"] == 0 and s.get("reference_ok") is True
            and s.get("requests_done") == requests and s.get("divergent_ranks") == [])


def _row(name: str, run: dict[str, Any], requests: int) -> dict[str, Any]:
    s = run["summary"]
    refused = s.get("refused", {})
    return {"scenario": name, "code": run["code"], "honest": honest(run, requests),
            "steps_per_s": s.get("steps_per_s"), "dead_events": _dead_events(s),
            "refused": sum(refused.values()), "refusals": refused,
            "engine_cpu_s": s.get("engine_cpu_s"), "seconds": s.get("seconds"),
            "peer": run["peer"], "stderr": "" if run["code"] == 0 else run["stderr"]}


def _pair(name: str, reps: int, run: Any) -> list[dict[str, Any]]:
    """``reps`` runs without and with the peer, alternated."""
    out = []
    for rep in range(reps):
        for flooded in (False, True):
            row = run(flooded)
            row.update(pair=name, flooded=flooded, rep=rep)
            out.append(row)
            print(f"hostile: {name} rep {rep} {'with' if flooded else 'without'} the peer: "
                  f"{row['steps_per_s']} steps/s, refused {row['refused']}", file=sys.stderr)
    return out


def run_all(reps: int, requests: int, only: str = "") -> list[dict[str, Any]]:
    from engine_side.security import free_tcp_endpoint

    rows: list[dict[str, Any]] = []
    with keys() as keydir, tempfile.TemporaryDirectory(prefix="dch-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o700)
        if only in ("", "mix"):
            rows.append(_row("mix tcp+CURVE", demo(free_tcp_endpoint(), keydir, requests, [],
                                                    ["--mode", "mix"]), requests))
            rows.append(_row("mix ipc", demo(f"ipc://{tmp}/mix", None, requests, [],
                                              ["--mode", "mix"]), requests))
        for spin in (["--ack-spin-ms", "0"], []) if only in ("", "flood") else ():
            label = "snapshot flood" + (", engine sleeps" if spin else "")
            rows += _pair(label, reps, lambda f, s=spin, n=label: _row(n, demo(  # type: ignore[misc]
                free_tcp_endpoint(), keydir, requests, [*s, "--remote-workers", "1"] if f
                else [*s], ["--mode", "flood", "--rank", "2"] if f else None,
                QUARTER if f else None), requests))
        for cap in (QUARTER, None) if only in ("", "handshakes") else ():
            label = "handshake flood, " + ("peer at a quarter core" if cap else "uncapped peer")
            rows += _pair(label, reps, lambda f, c=cap, n=label: _row(n, demo(  # type: ignore[misc]
                free_tcp_endpoint(), keydir, requests, [],
                ["--mode", "handshakes"] if f else None, c if f else None), requests))
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pair: median steps/s without and with the peer, their ratio, dead events, the
    engine's CPU per rejected message (sleeping-engine pair)."""
    pairs: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["pair"] for r in rows if "pair" in r):
        base = [r for r in rows if r.get("pair") == name and not r["flooded"]]
        hit = [r for r in rows if r.get("pair") == name and r["flooded"]]
        b = statistics.median(r["steps_per_s"] or 0 for r in base)
        h = statistics.median(r["steps_per_s"] or 0 for r in hit)
        refused = statistics.median(r["refused"] for r in hit)
        extra_cpu = statistics.median((r["engine_cpu_s"] or 0) for r in hit) - \
            statistics.median((r["engine_cpu_s"] or 0) for r in base)
        pairs[name] = {"base_steps_per_s": b, "flooded_steps_per_s": h,
                       "ratio": round(h / b, 3) if b else None,
                       "dead_events": sum(r["dead_events"] for r in hit),
                       "honest": all(r["honest"] for r in rows if r.get("pair") == name),
                       "refused": refused, "sent": statistics.median(
                           r["peer"].get("sent", r["peer"].get("handshakes", 0)) for r in hit),
                       "engine_cpu_us_per_refused": round(extra_cpu / refused * 1e6, 2)
                       if refused else None}
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_side.bench.hostile",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--only", choices=("", "mix", "flood", "handshakes"), default="")
    parser.add_argument("--figures", default="", metavar="FILE",
                        help="also write the figures envelope for BENCHMARKS.md here")
    args = parser.parse_args(argv)
    started = stamp() if args.figures else None
    t0 = time.monotonic()
    rows = run_all(args.reps, args.requests, args.only)
    result = {"rows": rows, "pairs": summarize(rows), "requests": args.requests,
              "reps": args.reps, "seconds": round(time.monotonic() - t0, 1)}
    print(json.dumps(result))
    if args.figures:
        from engine_side.bench.page_tables import write_figures

        write_figures(args.figures, "hostile", result, started)
    ok = all(r["honest"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
