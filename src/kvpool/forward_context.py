"""The forward context: everything one step's forward needs, built by the engine's runner
alone and taken by every model through one signature, `model(context) -> logits`.

It holds the step's device tensors (input ids, positions, logits indices, one
AttentionMetadata per layer group, a hybrid model's state slots), the KV pool they index,
and host copies of the lengths and bounds (as vLLM keeps `seq_lens_cpu`), so that nothing in
a forward reads device data on the host. A decode-only step may be replayed by a CUDA graph
with other lengths: its forward reads the host only through the batch size and the static
bounds, and its host `seq_lens` is None."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.attention import AttentionMetadata
from kvpool.memory.grouped_pool import GroupedPool
from kvpool.memory.pool import KVPool
from kvpool.memory.state_pool import StateBatch


@dataclass(frozen=True, slots=True)
class HostLengths:
    """Host copies of a step's lengths (tokens): `query_starts` `[batch + 1]` (cu_seqlens_q),
    `seq_lens` `[batch]` (KV lengths, new tokens included; None where a CUDA graph replays
    the step with other lengths) and bounds of both."""

    query_starts: list[int]
    seq_lens: list[int] | None
    max_seq_len: int
    max_query_len: int

    @property
    def query_lens(self) -> list[int]:
        """New tokens of each sequence."""
        return [end - start for start, end in zip(self.query_starts, self.query_starts[1:],
                                                       strict=False)]

    @property
    def decode_only(self) -> bool:
        """Whether every sequence computes one token (the step a CUDA graph may replay)."""
        return self.max_query_len == 1


@dataclass(slots=True)
class ForwardContext:
    """One step's forward inputs: a packed batch of sequences, their new tokens back to back.

    `attention[g]` is layer group g's metadata (slot mapping and page tables of `kv.pools[g]`;
    seq_lens and cu_seqlens_q are shared by every group). `states` holds a hybrid model's
    state slots in batch order (None for attention-only models)."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    logits_indices: torch.Tensor  # [num_logits] int64: packed rows whose logits are returned
    attention: tuple[AttentionMetadata, ...]
    kv: GroupedPool
    host: HostLengths
    states: StateBatch | None = None

    @property
    def seq_lens(self) -> torch.Tensor:
        """KV lengths `[batch]` int32 on the device."""
        return self.attention[0].seq_lens

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """Query offsets `[batch + 1]` int32 on the device."""
        return self.attention[0].cu_seqlens_q

    def locate(self, layer: int) -> tuple[KVPool, int, AttentionMetadata]:
        """(pool, layer in that pool, metadata) of attention layer `layer` in this step."""
        return self.kv.locate(layer, self.attention)
