"""CUDA graphs for decode-only steps: one graph per batch-size bucket (1, 2, 4, 8, then
multiples of 8 up to max_num_seqs), captured at start-up; a step is padded up to its bucket
and replayed, so its hundreds of kernel launches cost one.

A graph replays fixed addresses and shapes: its inputs are the first allocation of the
workspace (the same address every step) laid out for the bucket with full-length page tables
(every layer group's) and a hybrid's state slots, and the forward context's host copies are
the bucket's static bounds (max_seq_len = max_model_len, max_query_len = 1, no host seq_lens)
so the kernels' launch configuration never depends on the data. Every model family runs its
decode step this way (tests/test_fake_trace.py proves its forward reads nothing back). Padded
rows are one-token sequences that write their K/V to each pool's reserved padding page, read
only that page, and update only the state pool's reserved padding slot: no sequence holds
them, so any number of runners and captures share one cache."""

from __future__ import annotations

import bisect
import time

import torch
from tqdm.auto import tqdm

from kvpool.engine.runner import ModelRunner, StepLayout
from kvpool.engine.scheduler import ScheduledBatch
from kvpool.forward_context import ForwardContext, HostLengths
from kvpool.kernels import triton_support


def replays_graphs(device: torch.device, cache_dtype: torch.dtype) -> bool:
    """Whether decode steps on `device` over pages of `cache_dtype` can replay CUDA graphs:
    on CUDA, where attention runs on the Triton kernels. The torch path (triton not installed,
    or fp8 pages before sm_89) reads the batch's lengths back on the host, which a capture
    forbids: those steps run eagerly."""
    return device.type == "cuda" and triton_support.runs_on(device, cache_dtype)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets, ascending: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (itself the last,
    so every decode batch the scheduler can form has one)."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs]
    sizes += range(8, max_num_seqs, 8)
    return [*sizes, max_num_seqs]


def is_decode_only(batch: ScheduledBatch) -> bool:
    """True when every sequence computes exactly one token and samples from it."""
    return all(end - start == 1 for start, end in zip(batch.starts, batch.ends, strict=True)) \
        and all(batch.sampled)


class CUDAGraphRunner:
    """Pads decode-only batches up to a bucket and runs them by graph replay.

    `bucket`, `stage` and `inputs` (bucket choice, padding, the static layout) run on any
    device; `capture` and `run` need CUDA. Padded rows use each pool's padding page (one per
    layer group) and a hybrid's padding state slot, which the allocators never hand out and
    the cache's stats never count."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_model_len: int):
        self.runner = runner
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // runner.cache.page_size)  # pages of a longest sequence
        self.padding = runner.padding
        self.pad_page, self.pad_slot = self.padding.pages[0], self.padding.slots[0]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output, overwritten by replay
        self.num_replays = 0
        self.capture_seconds = 0.0  # how long `capture` took (seconds), compiles included

    def bucket(self, batch: ScheduledBatch) -> int | None:
        """The graph size a batch runs at, or None if it must run eagerly (not decode-only,
        or larger than every bucket)."""
        size = len(batch.seqs)
        if not is_decode_only(batch) or size > self.batch_sizes[-1]:
            return None
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, size)]

    def layout(self, bucket: int) -> StepLayout:
        """The static layout of a bucket: one token, one logit row per sequence."""
        return StepLayout(bucket, bucket, self.width, bucket, len(self.runner.kv.pools),
                          self.runner.has_states)

    def stage(self, batch: ScheduledBatch, bucket: int,
              last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Put a decode batch's metadata, padded to `bucket` rows, in the graphs' input
        buffer (the workspace's first allocation), placeholder input ids filled from
        `last_tokens` (ModelRunner.stage); returns that buffer."""
        return self.runner.stage(batch, self.layout(bucket), self.padding, last_tokens)

    def inputs(self, flat: torch.Tensor, bucket: int) -> ForwardContext:
        """The ForwardContext a bucket's graph computes from its input buffer: its host
        copies are the bucket's static bounds, whatever the lengths it replays with."""
        host = HostLengths(list(range(bucket + 1)), None, self.max_model_len, 1)
        return self.runner.context(flat, self.layout(bucket), host)

    @torch.inference_mode()
    def capture(self, *, progress: bool = True) -> None:
        """Capture one graph per bucket, largest first (the smaller ones reuse its memory
        pool), printing a progress line; `capture_seconds` is the time it took.

        Every capture runs on one side stream with `capture_begin`/`capture_end`, not
        `torch.cuda.graph`, whose entry synchronises the device and empties the caching
        allocator and the pinned host cache each time: memory the next bucket's warm-up then
        allocates from the driver again."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with self.runner.kv.calibration_paused(), torch.cuda.stream(stream):  # padding: no prefill
            for bucket in tqdm(self.batch_sizes[::-1], desc="capturing CUDA graphs",
                               unit="graph", disable=not progress):
                self._capture(bucket, pool, stream)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.empty_cache()  # once: the warm-ups' blocks, cached for the side stream
        self.capture_seconds = time.perf_counter() - start

    def _capture(self, bucket: int, pool, stream: torch.cuda.Stream) -> None:
        """Warm up and capture the graph of one bucket on `stream` in the graphs' memory
        `pool`."""
        flat = self.stage(ScheduledBatch(), bucket)  # all padding: touches no real page
        # Warm up on the capture stream: lazy initialisation (Triton compiles, cuBLAS's
        # workspace for this stream) stays out of the graph. The wait lets the next bucket
        # refill the pinned staging buffer that this one's copy reads.
        self.runner.model(self.inputs(flat, bucket))
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            graph.capture_begin(pool=pool)
            try:
                # the int32 views are computed inside the graph, so replay refreshes them
                self.logits[bucket] = self.runner.model(self.inputs(flat, bucket))
            finally:
                graph.capture_end()  # a failed forward leaves the capture to end (and fail)
        except RuntimeError as e:
            raise RuntimeError(f"capturing the CUDA graph of batch size {bucket} failed "
                               f"({e}); pass enforce_eager=True to run without graphs") from e
        self.graphs[bucket] = graph

    def run(self, batch: ScheduledBatch, bucket: int,
            last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[len(batch.seqs), vocab]` of a decode batch by replaying its bucket's graph;
        a view valid until the next step. `last_tokens`: the previous step's sampled tokens,
        for the placeholder input ids."""
        checkpoints = self.runner.checkpoints(batch)
        self.stage(batch, bucket, last_tokens)
        self.graphs[bucket].replay()
        self.runner.save_checkpoints(batch, checkpoints)
        self.num_replays += 1
        return self.logits[bucket][: len(batch.seqs)]
