"""What the planner reads of a model: its geometry. A model's config provides it
(kvpool.models.config.ModelConfig is one); the planner needs nothing else of the model."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from kvpool.memory.layout import KVLayout
from kvpool.memory.state_pool import MambaLayout


@runtime_checkable
class ModelGeometry(Protocol):
    """The sizes of a decoder that decide its memory: its KV layout, its Mamba state layout
    (None without Mamba layers), its weights' dtype and parameter counts, its activations and
    the longest prompt it takes (tokens)."""

    @property
    def max_position_embeddings(self) -> int:
        """The longest sequence the model takes, in tokens."""

    def weights_dtype(self, dtype: torch.dtype | None = None) -> torch.dtype:
        """The dtype the weights load in: `dtype` if given, else the model's own."""

    def kv_layout(self, *, dtype: torch.dtype | None = None, page_size: int = 16,
                  kv_cache_dtype: str = "auto", max_model_len: int | None = None) -> KVLayout:
        """The KV pages of the attention layers, in `dtype` (None: the weights') or
        `kv_cache_dtype`, of `page_size` tokens; a window that no sequence of `max_model_len`
        tokens passes is none (full attention)."""

    def mamba_layout(self, *, dtype: torch.dtype | None = None,
                     tensor_parallel_size: int = 1) -> MambaLayout | None:
        """The state slots of the Mamba layers, one rank's of `tensor_parallel_size`; None
        for a model without them."""

    def count_parameters(self, tensor_parallel_size: int = 1) -> int:
        """Parameters of the whole model, or of one rank of `tensor_parallel_size`: its part
        of the split tensors and the whole of those every rank holds."""

    def count_float32_parameters(self, tensor_parallel_size: int = 1) -> int:
        """Of those, the parameters held in float32 whatever the weights' dtype."""

    def estimate_activation_bytes(self, dtype: torch.dtype, *, max_num_batched_tokens: int,
                                  max_num_seqs: int) -> int:
        """Peak activation bytes of one forward over `max_num_batched_tokens` tokens of up to
        `max_num_seqs` sequences, in `dtype`."""
