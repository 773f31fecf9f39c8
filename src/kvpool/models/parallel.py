"""Tensor parallelism inside a model: which part of each checkpoint weight a rank holds, the
layers that hold those parts, and the collectives (torch.distributed, on the process group
the engine gives) that join the ranks' partial results.

N ranks split a decoder the way Megatron-LM does:
- attention: the query heads in N contiguous parts; the KV heads too, or, when there are fewer
  KV heads than ranks, rank r holds KV head `r * num_kv_heads // N` (each replicated on
  N / num_kv_heads ranks, next to the query heads that read it); o_proj by its input features.
  MLA (DeepSeek): the query heads and kv_b_proj by heads; the latent (kv_a) is replicated, so
  every rank writes the same latent pages.
- MLP: gate_proj and up_proj by their output features, down_proj by its input; a mixture of
  experts splits every expert and the shared experts this way and replicates the router.
- embedding and lm_head: by vocabulary rows (vocab-parallel); the logits are gathered.
Attention and the MLP each end in a partial sum that the decoder layer all-reduces: one
all-reduce after attention, one after the MLP. With one rank every part is the whole and every
collective is the identity."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpool.errors import ConfigError

Index = tuple[slice, ...]  # the part of a checkpoint tensor a rank holds
WHOLE: Index = (slice(None),)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place among the `size` ranks that split one model: rank `rank`, whose
    collectives run on `group` (None: the default process group)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")

    def part(self, total: int, what: str) -> range:
        """The units (heads, features, rows) of `total` this rank holds: an equal contiguous
        share. ConfigError when `total` does not split evenly."""
        if total % self.size:
            raise ConfigError(f"{what} {total} does not split across {self.size} "
                              f"tensor-parallel ranks")
        share = total // self.size
        return range(self.rank * share, (self.rank + 1) * share)

    def kv_part(self, num_kv_heads: int) -> range:
        """The KV heads this rank holds: its share, or one head replicated when there are
        fewer heads than ranks (then the ranks must be a multiple of the heads)."""
        if num_kv_heads >= self.size:
            return self.part(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ConfigError(f"{num_kv_heads} KV heads cannot be replicated evenly across "
                              f"{self.size} tensor-parallel ranks")
        head = self.rank * num_kv_heads // self.size
        return range(head, head + 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` `[n, k]` side by side: `[n, size * k]`, rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class ColumnLinear(nn.Linear):
    """nn.Linear holding the output features `part` (in units of `unit` features, such as
    heads of head_dim) of a checkpoint's weight and bias; its output is this rank's share of
    the features."""

    def __init__(self, in_features: int, part: range, unit: int, bias: bool,
                 dtype: torch.dtype):
        super().__init__(in_features, len(part) * unit, bias=bias, dtype=dtype)
        self.rows = slice(part.start * unit, part.stop * unit)

    def checkpoint_index(self, name: str) -> Index:
        return (self.rows,)


class RowLinear(nn.Linear):
    """nn.Linear holding the input features `part` (in units of `unit`) of a checkpoint's
    weight; its output is this rank's partial sum, the bias counted once (by rank 0), so the
    ranks' outputs sum to the whole layer's."""

    def __init__(self, part: range, unit: int, out_features: int, bias: bool,
                 dtype: torch.dtype, tp: TensorParallel):
        super().__init__(len(part) * unit, out_features, bias=bias, dtype=dtype)
        self.cols = slice(part.start * unit, part.stop * unit)
        self.adds_bias = tp.rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.adds_bias else None)

    def checkpoint_index(self, name: str) -> Index:
        return (slice(None), self.cols) if name == "weight" else WHOLE


class VocabEmbedding(nn.Embedding):
    """nn.Embedding holding the vocabulary rows `part` of a checkpoint's table: ids outside
    them embed to zeros and the all-reduce adds the rank that holds them. As a tied lm_head
    its rows give this rank's share of the logits."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: TensorParallel):
        self.part = tp.part(vocab_size, "vocab_size")
        super().__init__(len(self.part), hidden_size, dtype=dtype)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.part.start
        outside = (local < 0) | (local >= len(self.part))
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))

    def checkpoint_index(self, name: str) -> Index:
        return (slice(self.part.start, self.part.stop),)


ONE_RANK = TensorParallel()  # a model on one device: every part is the whole

ShardedLayer = ColumnLinear | RowLinear | VocabEmbedding


def checkpoint_index(model: nn.Module, name: str) -> Index:
    """The part of checkpoint tensor `name` that `model`'s parameter of that name holds."""
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
    return module.checkpoint_index(leaf) if isinstance(module, ShardedLayer) else WHOLE


def part_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    """The shape of the part `index` of a tensor of `shape`."""
    return tuple(torch.empty(shape, device="meta")[index].shape)
