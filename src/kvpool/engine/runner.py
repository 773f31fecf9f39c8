"""ModelRunner: packs one scheduled batch (prefill chunks and decodes together) into the
model's inputs and runs a single forward over the paged KV cache."""

from __future__ import annotations

import torch

from kvpool.attention import AttentionMetadata
from kvpool.cache import KVCache
from kvpool.engine.scheduler import ScheduledBatch


class ModelRunner:
    """Runs `model(input_ids, positions, meta, pool, logits_indices)` for a batch."""

    def __init__(self, model: torch.nn.Module, cache: KVCache):
        self.model = model
        self.cache = cache
        self.device = cache.pool.device

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Write the KV of the batch's tokens and return float32 logits `[n, vocab]` of the
        last token of each sequence whose chunk is `sampled`, in batch order."""
        seq_ids = [seq.seq_id for seq in batch.seqs]
        input_ids: list[int] = []
        for seq, start, end in zip(batch.seqs, batch.starts, batch.ends, strict=True):
            input_ids += seq.token_ids[start:end]
        starts = torch.tensor(batch.starts, dtype=torch.int32)
        seq_lens = torch.tensor(batch.ends, dtype=torch.int32)
        query_lens = seq_lens - starts
        cu_seqlens_q = torch.zeros(len(seq_ids) + 1, dtype=torch.int32)
        torch.cumsum(query_lens, 0, out=cu_seqlens_q[1:])
        # position of packed token t of sequence b: starts[b] + (t - cu_seqlens_q[b])
        offsets = (starts - cu_seqlens_q[:-1]).repeat_interleave(query_lens)
        positions = torch.arange(len(input_ids), dtype=torch.int64) + offsets
        logits_indices = cu_seqlens_q[1:][torch.tensor(batch.sampled)] - 1
        meta = AttentionMetadata(
            slot_mapping=self.cache.slot_mapping(seq_ids, batch.starts, batch.ends,
                                                 device=self.device),
            page_tables=self.cache.page_tables(seq_ids, device=self.device),
            seq_lens=seq_lens.to(self.device),
            cu_seqlens_q=cu_seqlens_q.to(self.device),
        )
        return self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions.to(self.device), meta, self.cache.pool, logits_indices.to(self.device))
