"""ModelRunner: packs one scheduled batch (prefill chunks and decodes together) into the
step's forward context and runs the model's single forward over the paged KV cache.

The context's device tensors (input ids, positions, each layer group's slot mapping and page
tables, seq_lens, cu_seqlens_q, logits indices, a hybrid's state slots) are built on the host
into one flat int64 staging buffer, allocated at setup for the largest step (pinned when the
device is CUDA), and reach the device in one non-blocking copy into the workspace; a CUDA
graph's static inputs are that buffer. An input id that is a placeholder (negative: a token
the previous step samples, not known on the host yet) is filled on the device from that
step's sampled tokens. The host copies of the lengths come from the batch
itself. Nothing in the forward reads back from the device. The runner enters no inference mode
of its own: the engine enters it once per step. Under tensor parallelism the runner's `peers`
get each step's packed buffer and run `forward` on their part of the model
(kvpool.engine.parallel)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from contextlib import AbstractContextManager
from itertools import accumulate, chain
from typing import NamedTuple, Protocol

import torch

from kvpool.attention import AttentionMetadata
from kvpool.cache import SequenceCache
from kvpool.engine.scheduler import ScheduledBatch
from kvpool.forward_context import ForwardContext, HostLengths
from kvpool.memory.state_pool import CheckpointRequest, StateBatch
from kvpool.memory.workspace import Workspace
from kvpool.numeric import int_tensor


class StepSections(NamedTuple):
    """Views of a step's flat buffer, one per section (`page_tables[g]` `[seqs, width]`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mappings: tuple[torch.Tensor, ...]  # one per layer group
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    logits_indices: torch.Tensor
    page_tables: tuple[torch.Tensor, ...]  # one per layer group
    state_slots: torch.Tensor | None


class StepLayout(NamedTuple):
    """Sizes of the sections of a step's flat int64 buffer, in this order: input ids,
    positions (tokens each), a slot mapping per layer group (tokens), seq_lens (seqs),
    cu_seqlens_q (seqs + 1), logits indices (num_logits), page tables per layer group
    (seqs x width), and with `states` the state slots (seqs)."""

    num_seqs: int
    num_tokens: int
    width: int  # page-table columns
    num_logits: int
    num_groups: int = 1
    states: bool = False

    @property
    def size(self) -> int:
        """Elements of the flat buffer."""
        t, b, g = self.num_tokens, self.num_seqs, self.num_groups
        return (2 + g) * t + (2 + self.states) * b + 1 + self.num_logits + g * b * self.width

    def split(self, flat: torch.Tensor) -> StepSections:
        """Views of `flat` (at least `size` elements), one per section."""
        t, b, g = self.num_tokens, self.num_seqs, self.num_groups
        sizes = [t] * (2 + g) + [b, b + 1, self.num_logits] + [b * self.width] * g
        sizes += [b] * self.states
        parts = flat[: self.size].split(sizes)
        tables = tuple(part.view(b, self.width) for part in parts[5 + g:5 + 2 * g])
        return StepSections(parts[0], parts[1], parts[2:2 + g], *parts[2 + g:5 + g], tables,
                            parts[-1] if self.states else None)


class Padding(NamedTuple):
    """Where padded rows (decode steps padded up to a CUDA-graph size, the start-up warm-up)
    write and read: a slot and a page per layer group, and a state slot for a hybrid's Mamba
    layers; each row is `num_tokens` tokens (every one written to the slot)."""

    slots: tuple[int, ...]
    pages: tuple[int, ...]
    state_slot: int = 0
    num_tokens: int = 1


NO_PADDING = Padding((), ())  # for steps that are not padded


def pack_step(batch: ScheduledBatch, cache: SequenceCache,
              host: torch.Tensor, layout: StepLayout, padding: Padding = NO_PADDING) -> None:
    """Write the batch's metadata into `host` (int64, CPU) laid out by `layout`.

    Rows beyond the batch (`layout.num_seqs > len(batch.seqs)`) are sequences of
    `padding.num_tokens` tokens 0 from position 0 that write their K/V to the padding slots,
    read only the padding pages and update only the padding state slot; their logits rows
    come last."""
    seq_ids = [seq.seq_id for seq in batch.seqs]
    num_real, num_pad = len(seq_ids), layout.num_seqs - len(seq_ids)
    padded_tokens = num_pad * padding.num_tokens
    sections = layout.split(host)
    starts, ends = batch.starts + [0] * num_pad, batch.ends + [padding.num_tokens] * num_pad
    input_ids: list[int] = []
    for seq, start, end in zip(batch.seqs, batch.starts, batch.ends, strict=True):
        input_ids += seq.token_ids[start:end]
    sections.input_ids.copy_(int_tensor(input_ids + [0] * padded_tokens))
    sections.positions.copy_(int_tensor(list(chain.from_iterable(map(range, starts, ends)))))
    cu = list(accumulate(map(operator.sub, ends, starts), initial=0))
    sections.seq_lens.copy_(int_tensor(ends))
    sections.cu_seqlens_q.copy_(int_tensor(cu))
    sections.logits_indices.copy_(int_tensor(
        [end - 1 for end, sampled in zip(cu[1:], batch.sampled + [True] * num_pad,
                                         strict=True) if sampled]))
    for group, (slots, tables) in enumerate(zip(sections.slot_mappings, sections.page_tables,
                                                strict=True)):
        slots[: len(slots) - padded_tokens] = cache.slot_mapping(
            seq_ids, batch.starts, batch.ends, group=group)
        real = cache.page_tables(seq_ids, group=group)
        tables[:num_real].zero_()  # columns past a sequence's pages: any valid page id
        tables[:num_real, : real.shape[1]] = real
        if num_pad:
            slots[len(slots) - padded_tokens:] = padding.slots[group]
            tables[num_real:] = padding.pages[group]
    if layout.states:
        sections.state_slots.copy_(int_tensor(
            [cache.state_slot(seq_id) for seq_id in seq_ids] + [padding.state_slot] * num_pad))


def fill_placeholders(input_ids: torch.Tensor, sampled: torch.Tensor) -> None:
    """Replace, in place on the device, each placeholder of `input_ids` (-1 - row, see
    kvpool.engine.scheduler.placeholder) by `sampled[row]`; reads nothing back."""
    rows = (-1 - input_ids).clamp_(min=0)
    input_ids.copy_(torch.where(input_ids < 0, sampled[rows], input_ids))


class StepPeers(Protocol):
    """The other ranks of a tensor-parallel model (kvpool.engine.parallel)."""

    def step(self, layout: StepLayout, host: HostLengths, staged: torch.Tensor,
             checkpoints: list[CheckpointRequest]) -> AbstractContextManager[None]:
        """Send them a step packed in `staged`, with the state checkpoints it saves; the
        block runs this rank's forward."""


class ModelRunner:
    """Runs `model(context)` for a batch, with the context's device tensors in `workspace`
    (reset at the start of every step). `max_step` is the layout of the largest step it will
    run (padded graph steps included; its layer groups and state slots are the cache's): the
    host staging buffer is allocated for it once, here. `peers` (a tensor-parallel model's
    other ranks) run every step `run` runs, on their parts."""

    def __init__(self, model: torch.nn.Module, cache: SequenceCache, workspace: Workspace, *,
                 max_step: StepLayout, peers: StepPeers):
        self.model = model
        self.cache = cache
        self.workspace = workspace
        self.peers = peers
        self.device = cache.device
        self.kv = cache.kv_pools
        self.has_states = cache.states is not None  # a hybrid model's state slots
        # Allocated now, outside inference mode, since every step writes them in place; the
        # same path on every device, pinned where pinning exists. Two, used in turn: with
        # overlap scheduling, step N+1 is packed while step N's copy may still wait in the
        # device's queue. Step N-1's copy is done once its sampled tokens reached the host,
        # but a step that samples nothing is never waited for: on CUDA each buffer's copy
        # records an event, which `stage` waits on before packing the buffer again.
        self.max_step = max_step._replace(num_groups=len(self.kv.pools),
                                          states=self.has_states)
        self.staging = tuple(torch.empty(self.max_step.size, dtype=torch.int64,
                                         pin_memory=self.device.type == "cuda")
                             for _ in range(2))
        self._copied = tuple(torch.cuda.Event() if self.device.type == "cuda" else None
                             for _ in self.staging)
        self._num_staged = 0
        # Padded rows use each pool's reserved page (one per layer group) and a hybrid's
        # reserved state slot, which the allocators never hand out and stats never count.
        self.padding = Padding(tuple(pool.padding_slot for pool in self.kv.pools),
                               tuple(pool.padding_page for pool in self.kv.pools),
                               cache.states.padding_slot if self.has_states else 0)

    def layout(self, batch: ScheduledBatch) -> StepLayout:
        """The flat buffer's sections for `batch` as it is (no padding)."""
        width = max(len(self.cache.pages(seq.seq_id)) for seq in batch.seqs)
        return StepLayout(len(batch.seqs), batch.num_tokens, width, sum(batch.sampled),
                          len(self.kv.pools), self.has_states)

    def stage(self, batch: ScheduledBatch, layout: StepLayout, padding: Padding = NO_PADDING,
              last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Reset the workspace and put the step's flat metadata (`pack_step`, staged on the
        host) in it as its first allocation, so the same layout always lands at the same
        address; returns it. Placeholder input ids take their token from `last_tokens`, the
        previous step's sampled tokens on the device."""
        staging, copied = self.staging[self._num_staged % 2], self._copied[self._num_staged % 2]
        if layout.size > staging.numel():
            raise ValueError(f"a step of {layout.num_seqs} sequences, {layout.num_tokens} tokens "
                             f"and {layout.width} page-table columns needs {layout.size} "
                             f"metadata elements; the staging buffer holds "
                             f"{staging.numel()} (max_step)")
        self._num_staged += 1
        host = staging[: layout.size]
        if copied is not None:
            copied.synchronize()  # the buffer's last copy to the device has left it
        pack_step(batch, self.cache, host, layout, padding)
        flat = self.load(host, layout)
        if copied is not None:
            copied.record(torch.cuda.current_stream(self.device))
        if last_tokens is not None and len(last_tokens):
            fill_placeholders(layout.split(flat).input_ids, last_tokens)
        return flat

    @property
    def staged(self) -> torch.Tensor:
        """The host buffer the last `stage` packed."""
        return self.staging[(self._num_staged - 1) % 2]

    def load(self, staged: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """Reset the workspace and copy the packed host buffer `staged` into its first
        allocation; returns it."""
        self.workspace.reset()
        flat = self.workspace.alloc((layout.size,), torch.int64)
        flat.copy_(staged[: layout.size], non_blocking=True)
        return flat

    def context(self, flat: torch.Tensor, layout: StepLayout, host: HostLengths,
                checkpoints: list[CheckpointRequest] | None = None) -> ForwardContext:
        """The ForwardContext viewing (and, for the int32 fields, converting) the device's
        `flat`, with the host copies `host`; attention gets the host bounds and the
        workspace, so it reads nothing back."""
        sections = layout.split(flat)
        seq_lens = sections.seq_lens.to(torch.int32)
        cu_seqlens_q = sections.cu_seqlens_q.to(torch.int32)
        attention = tuple(
            AttentionMetadata(slots, tables.to(torch.int32), seq_lens, cu_seqlens_q,
                              host.max_seq_len, host.max_query_len, self.workspace)
            for slots, tables in zip(sections.slot_mappings, sections.page_tables, strict=True))
        states = None
        if layout.states:
            states = StateBatch(self.cache.states, sections.state_slots, checkpoints or [])
        return ForwardContext(sections.input_ids, sections.positions, sections.logits_indices,
                              attention, self.kv, host, states)

    @torch.inference_mode()
    def warm_up(self, query_lens: Sequence[int]) -> None:
        """Run a step of one padded row of each of `query_lens` tokens, fp8 calibration
        paused: Triton compiles the kernels of prefill steps (a tile for short queries and
        one for long ones) now, at start-up, instead of while the first requests wait. The
        rows write only the padding pages and state slot; no sequence, page or stat
        changes."""
        with self.kv.calibration_paused():
            for n in query_lens:
                layout = StepLayout(1, n, -(-n // self.cache.page_size), 1, len(self.kv.pools),
                                    self.has_states)
                flat = self.stage(ScheduledBatch(), layout, self.padding._replace(num_tokens=n))
                self.model(self.context(flat, layout, HostLengths([0, n], [n], n, n)))

    def checkpoints(self, batch: ScheduledBatch) -> list[CheckpointRequest]:
        """The state checkpoints the step saves (a hybrid cache with prefix caching)."""
        if not self.has_states:
            return []
        seq_ids = [seq.seq_id for seq in batch.seqs]
        return self.cache.state_batch(seq_ids, batch.starts, batch.ends).checkpoints

    def save_checkpoints(self, batch: ScheduledBatch,
                         checkpoints: list[CheckpointRequest]) -> None:
        """Save the checkpoints of one-token rows after the forward: each is the state the
        step left in its row's slot (the model saves those inside longer chunks)."""
        for request in checkpoints:
            if batch.ends[request.index] - batch.starts[request.index] == 1:
                seq_id = batch.seqs[request.index].seq_id
                self.cache.states.copy(self.cache.state_slot(seq_id), request.slot)

    def run(self, batch: ScheduledBatch, last_tokens: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Write the KV of the batch's tokens and return float32 logits `[n, vocab]` of the
        last token of each sequence whose chunk is `sampled`, in batch order. `last_tokens`:
        the previous step's sampled tokens, for the placeholder input ids."""
        layout = self.layout(batch)
        checkpoints = self.checkpoints(batch)
        flat = self.stage(batch, layout, last_tokens=last_tokens)
        query_starts = [0]
        for start, end in zip(batch.starts, batch.ends, strict=True):
            query_starts.append(query_starts[-1] + end - start)
        host = HostLengths(query_starts, list(batch.ends), max(batch.ends),
                           max(b - a for a, b in zip(batch.starts, batch.ends, strict=True)))
        with self.peers.step(layout, host, self.staged, checkpoints):
            logits = self.model(self.context(flat, layout, host, checkpoints))
        self.save_checkpoints(batch, checkpoints)
        return logits

    def forward(self, layout: StepLayout, host: HostLengths, staged: torch.Tensor,
                checkpoints: list[CheckpointRequest]) -> torch.Tensor:
        """Run a step another rank packed (`staged`, laid out by `layout`, with its host
        lengths `host` and the state checkpoints it saves): a tensor-parallel worker's part
        of that rank's `run`. The checkpoints of one-token rows, which that rank copies
        after the step, reach this rank's pool as copies before the next."""
        return self.model(self.context(self.load(staged, layout), layout, host, checkpoints))
