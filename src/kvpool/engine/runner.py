"""ModelRunner: packs one scheduled batch (prefill chunks and decodes together) into the
model's inputs and runs a single forward over the paged KV cache.

The step's metadata (input ids, positions, slot mapping, seq_lens, cu_seqlens_q, logits
indices, page tables) is built on the host into one flat int64 staging buffer, allocated at
setup for the largest step (pinned when the device is CUDA), and reaches the device in one
non-blocking copy into the workspace. Nothing in the forward reads back from the device.
The runner enters no inference mode of its own: the engine enters it once per step.

A GroupedCache (one pool per layer group) puts its first group's slot mapping and page tables
in the flat buffer as any cache; the other groups' follow as tensors of their own, each in an
AttentionMetadata that shares the step's seq_lens and cu_seqlens_q, and the model gets them
all in one GroupedMetadata."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kvpool.attention import AttentionMetadata
from kvpool.cache import KVCache
from kvpool.engine.scheduler import ScheduledBatch
from kvpool.grouped_cache import GroupedCache
from kvpool.grouped_pool import GroupedMetadata
from kvpool.hybrid_cache import HybridCache
from kvpool.state_pool import StateBatch
from kvpool.workspace import Workspace


@dataclass(slots=True)
class StepInputs:
    """The device tensors of one forward (the host-side bounds ride in `meta`)."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    meta: AttentionMetadata | GroupedMetadata
    logits_indices: torch.Tensor  # [num_logits] int64: packed rows whose logits are returned
    states: StateBatch | None = None  # a hybrid model's state slots, in batch order


class StepLayout(NamedTuple):
    """Sizes of the sections of a step's flat int64 buffer, in this order: input ids,
    positions, slot mapping (tokens each), seq_lens (seqs), cu_seqlens_q (seqs + 1),
    logits indices (num_logits), page tables (seqs x width)."""

    num_seqs: int
    num_tokens: int
    width: int  # page-table columns
    num_logits: int

    @property
    def size(self) -> int:
        """Elements of the flat buffer."""
        return 3 * self.num_tokens + 2 * self.num_seqs + 1 + self.num_logits + (
            self.num_seqs * self.width)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` (at least `size` elements), one per section."""
        t, b = self.num_tokens, self.num_seqs
        sizes = [t, t, t, b, b + 1, self.num_logits, b * self.width]
        return list(flat[: self.size].split(sizes))


def pack_step(batch: ScheduledBatch, cache: KVCache, host: torch.Tensor, layout: StepLayout,
              *, pad_slot: int = 0, pad_page: int = 0) -> None:
    """Write the batch's metadata into `host` (int64, CPU) laid out by `layout`.

    Rows beyond the batch (`layout.num_seqs > len(batch.seqs)`, decode steps padded up to
    a CUDA-graph size) are one-token sequences of token 0 at position 0 that write their
    K/V to `pad_slot` and read only page `pad_page`; their logits rows come last."""
    seq_ids = [seq.seq_id for seq in batch.seqs]
    num_real, num_pad = len(seq_ids), layout.num_seqs - len(seq_ids)
    ids, positions, slots, seq_lens, cu_seqlens, logits_indices, tables = layout.split(host)
    starts = torch.tensor(batch.starts + [0] * num_pad, dtype=torch.int32)
    ends = torch.tensor(batch.ends + [1] * num_pad, dtype=torch.int32)
    query_lens = ends - starts
    input_ids: list[int] = []
    for seq, start, end in zip(batch.seqs, batch.starts, batch.ends, strict=True):
        input_ids += seq.token_ids[start:end]
    ids.copy_(torch.tensor(input_ids + [0] * num_pad))
    cu = torch.zeros(layout.num_seqs + 1, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=cu[1:])
    cu_seqlens.copy_(cu)
    # position of packed token t of sequence b: starts[b] + (t - cu_seqlens_q[b])
    offsets = (starts - cu[:-1]).repeat_interleave(query_lens, output_size=len(ids))
    torch.add(torch.arange(len(ids), dtype=torch.int32), offsets, out=positions)
    slots[: len(slots) - num_pad] = cache.slot_mapping(seq_ids, batch.starts, batch.ends)
    slots[len(slots) - num_pad:] = pad_slot
    seq_lens.copy_(ends)
    sampled = torch.tensor(batch.sampled + [True] * num_pad)
    logits_indices.copy_(cu[1:][sampled] - 1)
    tables = tables.view(layout.num_seqs, layout.width)
    real = cache.page_tables(seq_ids)
    tables[:num_real].zero_()  # columns past a sequence's pages: any valid page id
    tables[:num_real, : real.shape[1]] = real
    tables[num_real:] = pad_page


class ModelRunner:
    """Runs `model(input_ids, positions, meta, pool, logits_indices)` for a batch, with its
    metadata in `workspace` (reset at the start of every step). `max_step` is the layout of
    the largest step it will run (padded graph steps included): the host staging buffer is
    allocated for it once, here."""

    def __init__(self, model: torch.nn.Module, cache: KVCache | HybridCache | GroupedCache,
                 workspace: Workspace, *, max_step: StepLayout):
        self.model = model
        self.cache = cache
        self.workspace = workspace
        self.device = cache.device
        # Allocated now, outside inference mode, since every step writes it in place; the
        # same path on every device, pinned where pinning exists. Reused across steps: the
        # previous step's copy has completed by the time it is rewritten, because every step
        # ends by copying its sampled tokens to the host.
        self.staging = torch.empty(max_step.size, dtype=torch.int64,
                                   pin_memory=self.device.type == "cuda")

    def layout(self, batch: ScheduledBatch) -> StepLayout:
        """The flat buffer's sections for `batch` as it is (no padding)."""
        width = max(len(self.cache.pages(seq.seq_id)) for seq in batch.seqs)
        return StepLayout(len(batch.seqs), batch.num_tokens, width, sum(batch.sampled))

    def stage(self, batch: ScheduledBatch, layout: StepLayout, *, pad_slot: int = 0,
              pad_page: int = 0) -> torch.Tensor:
        """Reset the workspace and put the step's flat metadata (`pack_step`, staged on the
        host) in it as its first allocation, so the same layout always lands at the same
        address; returns it."""
        if layout.size > self.staging.numel():
            raise ValueError(f"a step of {layout.num_seqs} sequences, {layout.num_tokens} tokens "
                             f"and {layout.width} page-table columns needs {layout.size} "
                             f"metadata elements; the staging buffer holds "
                             f"{self.staging.numel()} (max_step)")
        self.workspace.reset()
        flat = self.workspace.alloc((layout.size,), torch.int64)
        host = self.staging[: layout.size]
        pack_step(batch, self.cache, host, layout, pad_slot=pad_slot, pad_page=pad_page)
        flat.copy_(host, non_blocking=True)
        return flat

    def inputs(self, flat: torch.Tensor, layout: StepLayout, *, max_seq_len: int,
               max_query_len: int) -> StepInputs:
        """StepInputs viewing (and, for the int32 fields, converting) the device's `flat`;
        attention gets the host bounds and the workspace, so it reads nothing back."""
        ids, positions, slots, seq_lens, cu_seqlens, logits_indices, tables = layout.split(flat)
        meta = AttentionMetadata(
            slot_mapping=slots,
            page_tables=tables.view(layout.num_seqs, layout.width).to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            cu_seqlens_q=cu_seqlens.to(torch.int32),
            max_seq_len=max_seq_len,
            max_query_len=max_query_len,
            workspace=self.workspace,
        )
        return StepInputs(ids, positions, meta, logits_indices)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """float32 logits `[num_logits, vocab]` of one forward over `inputs`."""
        args = (inputs.input_ids, inputs.positions, inputs.meta, self.cache.pool,
                inputs.logits_indices)
        if inputs.states is None:
            return self.model(*args)
        return self.model(*args, states=inputs.states)

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Write the KV of the batch's tokens and return float32 logits `[n, vocab]` of the
        last token of each sequence whose chunk is `sampled`, in batch order."""
        layout = self.layout(batch)
        flat = self.stage(batch, layout)
        query_lens = [end - start for start, end in zip(batch.starts, batch.ends, strict=True)]
        inputs = self.inputs(flat, layout, max_seq_len=max(batch.ends),
                             max_query_len=max(query_lens))
        if isinstance(self.cache, HybridCache):
            inputs.states = self.cache.state_batch([seq.seq_id for seq in batch.seqs],
                                                   batch.starts, batch.ends)
        if isinstance(self.cache, GroupedCache):
            inputs.meta = self.group_metadata(batch, inputs.meta)
        return self.forward(inputs)

    def group_metadata(self, batch: ScheduledBatch, meta: AttentionMetadata) -> GroupedMetadata:
        """`meta` (the first group's, from the flat buffer) and the other groups' slot
        mappings and page tables in AttentionMetadata of their own."""
        seq_ids = [seq.seq_id for seq in batch.seqs]
        metas = [meta]
        for group in range(1, len(self.cache.groups)):
            slots = self.cache.slot_mapping(seq_ids, batch.starts, batch.ends, group=group)
            tables = self.cache.page_tables(seq_ids, group=group)
            metas.append(replace(meta, slot_mapping=slots.to(self.device),
                                 page_tables=tables.to(self.device)))
        return GroupedMetadata(tuple(metas))
