"""Run one of the tests' vLLM subprocess scripts (``tests/<name>_run.py MODEL OUT.json``)
on a fresh tiny model and return what it wrote, its stderr under ``"stderr"``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_script(tmp_path_factory: pytest.TempPathFactory, name: str,
               timeout: float = 1100) -> dict[str, Any]:
    from engine_side.bench.vllm_scenarios import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp(f"vllm-{name}") / "tiny-llama")
    out = model.parent / f"{name}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / f"vllm_{name}_run.py"),
                           str(model), str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert out.exists(), proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["stderr"] = proc.stderr
    return result
