"""The engine's counters: a snapshot for users (EngineStats) and one record per step
(StepRecord) for plots of the pool over time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters of an LLM since it was created. Pages: used + cached + free == the pool."""

    # sequences: every sample of a request, those not forked yet included
    num_running: int  # sequences scheduled (holding pages, or to once forked)
    num_waiting: int  # sequences queued (new, preempted, or held for KV from another engine)
    num_used_pages: int  # held by a live sequence
    num_cached_pages: int  # held only by the prefix cache: evictable
    num_free_pages: int
    kv_utilization: float  # filled fraction of the slots in used pages
    prefix_hit_rate: float  # prompt tokens served by the prefix cache / tokens looked up
    num_preemptions: int
    num_steps: int  # steps whose tokens were read
    num_prompt_tokens: int  # tokens computed by prefill (recompute included, prefix hits not)
    num_generated_tokens: int  # tokens sampled and kept (not a token an abort dropped)
    elapsed: float  # seconds spent in steps
    workspace_bytes: int = 0  # the step scratch allocated once at start-up
    workspace_peak_bytes: int = 0  # the most of it one step has used
    num_cuda_graphs: int = 0  # decode graphs captured (0 on the CPU or with enforce_eager)
    cuda_graph_bytes: int = 0  # estimated memory of their pool, as planned
    num_graph_steps: int = 0  # steps run by graph replay
    num_tier_stores: int = 0  # evicted pages the tier took
    num_tier_loads: int = 0  # pages loaded back from the tier instead of computed
    num_tier_misses: int = 0  # tier lookups that found no page (or one that failed its checks)
    num_tier_dropped: int = 0  # evicted pages the tier could not keep (a failed write)
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # prompt tokens it served (prefix_hit_rate: of those looked up)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of step time."""
        return self.num_generated_tokens / self.elapsed if self.elapsed else 0.0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step did and the pool right after it (pages)."""

    step: int  # 0 for the engine's first step
    time: float  # seconds from the start of the first step to the end of this one
    duration: float  # seconds of this step
    num_running: int
    num_waiting: int
    num_batched_tokens: int  # tokens in the step's forward
    num_decode_tokens: int  # of which decodes; the rest are prefill chunks
    num_used_pages: int
    num_cached_pages: int
    num_free_pages: int
    num_preemptions: int  # cumulative
