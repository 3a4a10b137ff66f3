"""vLLM adapter, worker side: frames back into SchedulerOutput / GrammarOutput; replies out."""

from worker_side.vllm.decoder import SchedulerOutputDecoder

__all__ = ["SchedulerOutputDecoder"]
