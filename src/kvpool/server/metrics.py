"""Prometheus metrics of the server, every name prefixed `kvpool_`.

The pool and the scheduler are read when /metrics is scraped (a snapshot taken in the engine
process between two steps): pages used / cached / free, KV utilization, running and waiting
sequences, and the engine's cumulative counters (preemptions, prefix-cache lookups and hits
in tokens, pages the tier stored, loaded, missed and dropped). A disaggregated server has
two engines, each with its own pool, prefix cache and tier: each of these series then has
one sample per engine, labelled `side` ("prefill" or "decode"). The request-level series are
recorded by the handlers as requests finish: requests by finish reason, prompt and generated
tokens, and latency histograms in seconds.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool.engine import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """One engine's counters at one moment (taken between two steps); `side`: which engine
    of a disaggregated pair ("prefill" or "decode"), None for a server's one engine."""

    engine: EngineStats
    side: str | None = None


@dataclass(frozen=True, slots=True)
class ChoiceTimes:
    """When one choice got its first and its last token (time.perf_counter() seconds), and
    the tokens it counts."""

    first_token: float
    last_token: float
    num_tokens: int


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """When a finished request arrived, was first scheduled, got its first token and
    finished (time.perf_counter() seconds; None where it never got there), and the times of
    each choice that got a token."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    finish: float
    choices: tuple[ChoiceTimes, ...] = ()


class ServerMetrics:
    """The server's registry: engine gauges and counters read at scrape time, request
    counters and histograms observed by `record`."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self._snapshots: abc.Sequence[EngineSnapshot] = ()
        self.registry.register(self)
        r = self.registry
        self.requests = Counter(
            "kvpool_requests", "Finished requests by the finish reason of their first choice "
            "(abort: the client left; error: the engine failed)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvpool_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("kvpool_generation_tokens", "Tokens generated for "
                                         "finished requests (all choices)", registry=r)
        self.ttft = Histogram("kvpool_time_to_first_token_seconds", "Arrival to first "
                              "generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvpool_time_per_output_token_seconds", "Time per generated "
                              "token after a choice's first (one observation per choice)",
                              buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.e2e = Histogram("kvpool_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kvpool_request_queue_time_seconds", "Arrival to first "
                                    "admission into the running batch",
                                    buckets=_LATENCY_BUCKETS, registry=r)

    def record(self, times: RequestTimes, finish_reason: str, num_prompt_tokens: int,
               num_generated_tokens: int) -> None:
        """Count a finished request; `num_generated_tokens`: of all its choices. Each choice
        of two tokens or more is one TPOT observation, timed by its own tokens (choices end
        at different times: the request's finish would charge one the others' tokens)."""
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)
        self.e2e.observe(times.finish - times.arrival)
        if times.scheduled is not None:
            self.queue_time.observe(max(0.0, times.scheduled - times.arrival))
        if times.first_token is not None:
            self.ttft.observe(times.first_token - times.arrival)
        for choice in times.choices:
            if choice.num_tokens > 1:
                self.tpot.observe((choice.last_token - choice.first_token)
                                  / (choice.num_tokens - 1))

    def render(self, snapshots: abc.Sequence[EngineSnapshot]) -> bytes:
        """The Prometheus text exposition, with the engines read from `snapshots` (one, or
        one per side)."""
        self._snapshots = snapshots
        return generate_latest(self.registry)

    def collect(self):
        """The engines' series from the latest snapshots (called by the registry): a sample
        of each per engine, labelled by its side when it has one."""
        labels = ["side"] if any(s.side for s in self._snapshots) else []
        families = {}
        for snapshot in self._snapshots:
            for kind, name, doc, value in _engine_series(snapshot.engine):
                if name not in families:
                    families[name] = kind(name, doc, labels=labels)
                families[name].add_metric([snapshot.side] if labels else [], value)
        yield from families.values()


def _engine_series(e: EngineStats):
    """(family type, name, help, value) of each series read from one engine's counters."""
    for name, doc, value in (
            ("kvpool_pages_used", "Pages held by live sequences", e.num_used_pages),
            ("kvpool_pages_cached", "Pages held only by the prefix cache (evictable)",
             e.num_cached_pages),
            ("kvpool_pages_free", "Free pages", e.num_free_pages),
            ("kvpool_kv_utilization", "Filled fraction of the slots of used pages",
             e.kv_utilization),
            ("kvpool_sequences_running",
             "Sequences running (a request's samples counted before they fork)",
             e.num_running),
            ("kvpool_sequences_waiting",
             "Sequences waiting for a seat (new, preempted, or held for handed KV)",
             e.num_waiting)):
        yield GaugeMetricFamily, name, doc, value
    for name, doc, value in (
            ("kvpool_preemptions", "Sequences preempted (pages freed, recomputed later)",
             e.num_preemptions),
            ("kvpool_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             e.prefix_query_tokens),
            ("kvpool_prefix_cache_hits", "Prompt tokens the prefix cache served",
             e.prefix_hit_tokens),
            ("kvpool_engine_steps", "Engine steps whose tokens were read (a forward whose "
             "requests all ended while it ran is not counted)", e.num_steps),
            ("kvpool_tier_stored_pages", "Evicted prefix pages the tier took",
             e.num_tier_stores),
            ("kvpool_tier_loaded_pages", "Prefix pages loaded back from the tier "
             "instead of computed", e.num_tier_loads),
            ("kvpool_tier_missed_pages", "Tier lookups that found no usable page",
             e.num_tier_misses),
            ("kvpool_tier_dropped_pages", "Evicted pages the tier could not keep (its "
             "storage failed, e.g. Redis down)", e.num_tier_dropped)):
        yield CounterMetricFamily, name, doc, value
