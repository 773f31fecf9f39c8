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

Piece = tuple[slice, ...]  # a rectangular part of a checkpoint tensor
Index = tuple[Piece, ...]  # the part a rank holds: its pieces, stacked along the first dim
WHOLE: Index = ((slice(None),),)


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
        """The KV heads this rank holds (`shared_part`)."""
        return self.shared_part(num_kv_heads, "num_key_value_heads")

    def shared_part(self, total: int, what: str) -> range:
        """The units of `total` this rank holds when each serves a group of ranks' other units
        (KV heads, a Mamba mixer's B/C groups): its share, or one unit replicated when there
        are fewer units than ranks (then the ranks must be a multiple of the units)."""
        if total >= self.size:
            return self.part(total, what)
        if self.size % total:
            raise ConfigError(f"{what} {total} cannot be replicated evenly across "
                              f"{self.size} tensor-parallel ranks")
        unit = self.rank * total // self.size
        return range(unit, unit + 1)

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


class Sharded:
    """A module that holds a part of some of its checkpoint tensors: `checkpoint_index(name)`
    says which part of its tensor `name` (a parameter's name within the module)."""

    def checkpoint_index(self, name: str) -> Index:
        raise NotImplementedError


def row_parts(*parts: range) -> Index:
    """The rows `parts` of a checkpoint tensor (and all of its other dimensions), stacked."""
    return tuple((slice(part.start, part.stop),) for part in parts)


def rotary_halves(heads: range, head_dim: int, rotary_dim: int) -> Index:
    """The rows of `heads` of a q/k projection whose checkpoint rotates adjacent rows together
    (rows 2i and 2i + 1 of a head's first `rotary_dim`): each head's even rotary rows, then its
    odd ones, then the rows it does not rotate, so that row i rotates with row
    i + rotary_dim / 2 as kvpool rotates them. The attention's dot products are unchanged, q
    and k being reordered alike."""
    pieces = []
    for start in (h * head_dim for h in heads):
        pieces += [(slice(start, start + rotary_dim, 2),),
                   (slice(start + 1, start + rotary_dim, 2),)]
        if rotary_dim < head_dim:
            pieces.append((slice(start + rotary_dim, start + head_dim),))
    return tuple(pieces)


class ColumnLinear(nn.Linear, Sharded):
    """nn.Linear holding the output features `part` (in units of `unit` features, such as
    heads of head_dim) of a checkpoint's weight and bias; its output is this rank's share of
    the features."""

    def __init__(self, in_features: int, part: range, unit: int, bias: bool,
                 dtype: torch.dtype):
        super().__init__(in_features, len(part) * unit, bias=bias, dtype=dtype)
        self.rows = row_parts(range(part.start * unit, part.stop * unit))

    def checkpoint_index(self, name: str) -> Index:
        return self.rows


class StackedColumnLinear(nn.Linear, Sharded):
    """nn.Linear whose outputs are the sections of a fused projection (a Mamba mixer's
    in_proj: gate, x, B, C, dt), holding the output features `parts` of a checkpoint's weight
    and bias, one range per section, stacked in order."""

    def __init__(self, in_features: int, parts: tuple[range, ...], bias: bool,
                 dtype: torch.dtype):
        super().__init__(in_features, sum(len(part) for part in parts), bias=bias, dtype=dtype)
        self.rows = row_parts(*parts)

    def checkpoint_index(self, name: str) -> Index:
        return self.rows


class RowLinear(nn.Linear, Sharded):
    """nn.Linear holding the input features `part` (in units of `unit`) of a checkpoint's
    weight; its output is this rank's partial sum, the bias counted once (by rank 0), so the
    ranks' outputs sum to the whole layer's."""

    def __init__(self, part: range, unit: int, out_features: int, bias: bool,
                 dtype: torch.dtype, tp: TensorParallel):
        super().__init__(len(part) * unit, out_features, bias=bias, dtype=dtype)
        self.cols = ((slice(None), slice(part.start * unit, part.stop * unit)),)
        self.adds_bias = tp.rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.adds_bias else None)

    def checkpoint_index(self, name: str) -> Index:
        return self.cols if name == "weight" else WHOLE


class VocabEmbedding(nn.Embedding, Sharded):
    """nn.Embedding holding the vocabulary rows `part` of a checkpoint's table: ids outside
    them embed to zeros and the all-reduce adds the rank that holds them. As a tied lm_head
    its rows give this rank's share of the logits."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: TensorParallel):
        self.part = tp.part(vocab_size, "vocab_size")
        # An uninitialised table (the loader fills it): nn.Embedding's own normal_ init on the
        # meta device would import torch._dynamo, seconds of every fresh process's start.
        super().__init__(len(self.part), hidden_size, dtype=dtype,
                         _weight=torch.empty(len(self.part), hidden_size, dtype=dtype))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.part.start
        outside = (local < 0) | (local >= len(self.part))
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))

    def checkpoint_index(self, name: str) -> Index:
        return row_parts(self.part)


ONE_RANK = TensorParallel()  # a model on one device: every part is the whole


def checkpoint_index(model: nn.Module, name: str) -> Index:
    """The part of checkpoint tensor `name` that `model`'s parameter of that name holds."""
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
    return module.checkpoint_index(leaf) if isinstance(module, Sharded) else WHOLE


def take(tensor, index: Index) -> torch.Tensor:
    """The part `index` of `tensor` (a torch tensor, or a safetensors slice: then only its
    bytes are read): its pieces stacked along the first dimension."""
    pieces = [tensor[piece] for piece in index]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
