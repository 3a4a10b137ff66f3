"""vLLM adapter, engine side (importable only when vLLM is installed; built for vLLM 0.32.x).

``SchedulerOutputEncoder`` turns each SchedulerOutput into Delta frames (and
decodes the workers' ModelRunnerOutput replies); its worker-side peer is
``worker_side.vllm.SchedulerOutputDecoder``.
"""

from typing import Any

from engine_side.vllm.encoder import SchedulerOutputEncoder
from engine_side.vllm.schema import SUPPORTED_VLLM, SchemaMismatch, check_schema
from protocol.seal import BadSeal

__all__ = ["SUPPORTED_VLLM", "BadSeal", "SchedulerOutputEncoder", "SchemaMismatch",
           "check_schema", "DeltaExecutor"]


def __getattr__(name: str) -> Any:
    if name == "DeltaExecutor":  # lazily: it imports vLLM's executor machinery
        from engine_side.vllm.executor import DeltaExecutor

        return DeltaExecutor
    raise AttributeError(name)
