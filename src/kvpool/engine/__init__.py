"""The inference engine: LLM (generate and the step API), SamplingParams, the scheduler
(continuous batching, chunked prefill, preemption) and sampling; DisaggregatedLLM (prefill
and decode on two engines in two processes), tensor parallelism (`parallel`).

May import: cache, planning, models, forward_context, attention, kernels, memory and
kvpool's shared modules; not the server or the CLI."""

from kvpool.engine.config import EngineConfig
from kvpool.engine.disaggregated import DisaggregatedLLM
from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.engine.request import CompletionOutput, RequestOutput, TokenLogprobs
from kvpool.engine.stats import EngineStats, StepRecord

__all__ = [
    "LLM",
    "DisaggregatedLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
    "StepRecord",
    "TokenLogprobs",
]
