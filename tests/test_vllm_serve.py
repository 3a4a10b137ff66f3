"""``AsyncLLM`` and ``vllm serve`` on DeltaExecutor give vLLM's default executor's
greedy tokens (and logprobs), on a real CPU vLLM and a tiny random Llama.

``vllm serve ... --distributed-executor-backend engine_side.vllm.DeltaExecutor``
(vLLM's own CLI, through tests/vllm_cli.py: the CPU wheel's ``vllm`` script cannot
start, see there) starts first (a subprocess in its own session, on a free port; always killed);
while it starts, tests/vllm_serve_run.py computes the default executor's greedy
reference and the AsyncLLM outputs.  Then an OpenAI client asks the server for
the same prompts, one request at a time, with ``return_token_ids``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")

from shm_leftovers import run_dirs  # noqa: E402
from vllm_serve_run import DELTA, ENGINE, MAX_TOKENS, PROMPTS  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # engines start slowly on busy cores
ROOT = Path(__file__).resolve().parent.parent
START_S = 600.0  # vllm serve on two busy cores


def _env() -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_side.bench.vllm_scenarios import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-serve") / "tiny-llama")


def _serve_args(model: Path, port: int) -> list[str]:
    args = [sys.executable, str(ROOT / "tests" / "vllm_cli.py"), "serve", str(model),
            "--host", "127.0.0.1", "--port", str(port),
            "--distributed-executor-backend", DELTA, "--shutdown-timeout", "30"]
    for key, value in ENGINE.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's session (its engine core and ranks too), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            return


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from engine_side.security import free_tcp_endpoint

    port = int(free_tcp_endpoint().rsplit(":", 1)[1])
    log = tmp_path_factory.mktemp("vllm-serve-log") / "serve.log"
    dirs = run_dirs()
    with open(log, "wb") as sink:
        metrics = tmp_path_factory.mktemp("vllm-serve-metrics")  # vLLM's multiprocess mode
        proc = subprocess.Popen(_serve_args(model, port), cwd=ROOT,  # (its log unbuffered)
                                env={**_env(), "PYTHONUNBUFFERED": "1",
                                     "PROMETHEUS_MULTIPROC_DIR": str(metrics)}, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield {"proc": proc, "url": f"http://127.0.0.1:{port}", "log": log, "dirs": dirs}
    finally:
        _stop(proc)


def _wait_healthy(server: dict[str, Any]) -> None:
    end = time.monotonic() + START_S
    while time.monotonic() < end:
        assert server["proc"].poll() is None, server["log"].read_text()[-4000:]
        with contextlib.suppress(OSError), \
                urllib.request.urlopen(server["url"] + "/health", timeout=5) as r:
            if r.status == 200:
                return
        time.sleep(1.0)
    pytest.fail(f"vllm serve not healthy after {START_S:.0f} s:\n"
                + server["log"].read_text()[-4000:])


@pytest.fixture(scope="module")
def reference(model: Path, server: dict[str, Any]) -> dict[str, Any]:
    """Default executor and AsyncLLM outputs (computed while the server starts)."""
    out = model.parent / "serve-reference.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_serve_run.py"),
                           str(model), str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module")
def served(server: dict[str, Any], reference: dict[str, Any], model: Path) -> dict[str, Any]:
    """The server's greedy outputs, one request per prompt, and its rank processes."""
    import psutil

    _wait_healthy(server)
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", timeout=300)
    outs = []
    for prompt in PROMPTS:
        choice = client.completions.create(
            model=str(model), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            logprobs=1, extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
        outs.append({"ids": (choice.model_extra or {}).get("token_ids"), "text": choice.text,
                     "lp": choice.logprobs.token_logprobs if choice.logprobs else None})
    titles = [" ".join(p.cmdline()) for p in
              psutil.Process(server["proc"].pid).children(recursive=True)]
    return {"outs": outs, "ranks": [t for t in titles if "DeltaWorker_" in t]}


def test_async_llm_matches_default_executor(reference: dict[str, Any]) -> None:
    assert reference["async"]["backend"] == "DeltaExecutor"
    default, delta = reference["default"], reference["async"]["outs"]
    assert len(default) == len(PROMPTS) and all(len(o["ids"]) == MAX_TOKENS for o in default)
    for k, (a, b) in enumerate(zip(default, delta, strict=True)):
        assert a == b, f"prompt {k}: AsyncLLM on DeltaExecutor differs from the default"


def test_vllm_serve_runs_delta_executor_ranks(served: dict[str, Any]) -> None:
    assert len(served["ranks"]) == 1, "vllm serve did not start a DeltaExecutor rank"


def test_vllm_serve_matches_default_executor(served: dict[str, Any],
                                             reference: dict[str, Any]) -> None:
    for k, (a, b) in enumerate(zip(reference["default"], served["outs"], strict=True)):
        assert b["ids"] == a["ids"], f"prompt {k}: token ids differ"
        assert b["lp"] == pytest.approx(a["lp"], abs=1e-6), f"prompt {k}: logprobs differ"



STREAM_TOKENS = 120


def _stream(client: Any, model: Path, server: dict[str, Any],
            kill_after: int | None = None) -> list[int]:
    """Token ids of one streamed completion; with ``kill_after``, the server's rank is
    SIGKILLed once that many tokens came (the group restarts under the open stream)."""
    import psutil

    ids: list[int] = []
    stream = client.completions.create(
        model=str(model), prompt=PROMPTS[0], max_tokens=STREAM_TOKENS, temperature=0,
        stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    for chunk in stream:
        before = len(ids)
        ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
        if kill_after is not None and before < kill_after <= len(ids):
            for p in psutil.Process(server["proc"].pid).children(recursive=True):
                if "DeltaWorker_" in " ".join(p.cmdline()):
                    p.send_signal(signal.SIGKILL)
    return ids


def test_an_open_stream_carries_on_when_the_rank_is_killed(served: dict[str, Any],
                                                          server: dict[str, Any],
                                                          model: Path) -> None:
    """SIGKILL the rank under an open stream: no error, every token once (all of them,
    what was streamed before the kill unchanged), and the server serves on.  After the
    kill the tokens come from a recompute (prefill kernels over what was decoded), which
    can break a greedy near-tie of this random model the other way: tests/
    test_vllm_restart.py shows those outputs equal vLLM's own recompute."""
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", timeout=300)
    want = _stream(client, model, server)
    got = _stream(client, model, server, kill_after=30)
    assert len(want) == len(got) == STREAM_TOKENS
    assert got[:30] == want[:30]
    assert len(_stream(client, model, server)) == STREAM_TOKENS  # a new group serves on
    assert "restarted the group after rank 0 died (signal 9 (SIGKILL))" in \
        server["log"].read_text()
    with urllib.request.urlopen(server["url"] + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert 'deltacast_rank_restarts_total{rank="0"} 1.0' in metrics
    assert "deltacast_restart_seconds_count 1.0" in metrics


def test_a_server_stopped_by_sigterm_leaves_no_run_directory(served: dict[str, Any],
                                                             server: dict[str, Any]) -> None:
    """SIGTERM to the server's session, vLLM draining (``--shutdown-timeout``): the
    executor's shutdown runs to its end and removes the run's private directory, though
    vLLM's engine core restores SIGTERM's default action before it and the API server
    sends one as it drains."""
    made = run_dirs() - server["dirs"]
    assert made, "the server's run directory was not found"
    _stop(server["proc"])
    assert server["proc"].returncode is not None
    assert not [d for d in made if d.exists()], (made, server["log"].read_text()[-3000:])
