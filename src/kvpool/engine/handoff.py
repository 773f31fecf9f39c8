"""The KV of a prompt's first tokens as one engine hands it to another (prefill/decode
disaggregation): whole pages, copied off one pool and written into another's pages."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from kvpool.cache import KVCache


@dataclass(slots=True)
class PrefilledKV:
    """The KV of `num_tokens` leading tokens of a sequence: `pages` shaped as
    `KVPool.read_pages` returns them, `[num_layers, num_planes, n, page_size, kvh, d]` with
    n = ceil(num_tokens / page_size) (slots past num_tokens in the last page hold anything)."""

    num_tokens: int
    pages: torch.Tensor

    @property
    def num_pages(self) -> int:
        """Pages of KV held."""
        return self.pages.shape[2]


def read_prefilled(cache: KVCache, seq_id: Hashable, num_tokens: int) -> PrefilledKV:
    """A copy of the KV of the first `num_tokens` tokens of sequence `seq_id`."""
    num_pages = -(-num_tokens // cache.page_size)
    return PrefilledKV(num_tokens, cache.pool.read_pages(cache.pages(seq_id)[:num_pages]))


def write_prefilled(cache: KVCache, seq_id: Hashable, kv: PrefilledKV, first_page: int) -> None:
    """Write `kv`'s pages from `first_page` on into the same pages of sequence `seq_id`
    (which holds at least kv.num_tokens tokens); the pages before are its prefix hit, whose
    KV is the same."""
    pages = cache.pages(seq_id)[first_page:kv.num_pages]
    cache.pool.write_pages(pages, kv.pages[:, :, first_page:])
