"""The KV of a prompt's first tokens as one engine hands it to another (prefill/decode
disaggregation): whole pages, copied off one pool and written into another's pages, and for
a hybrid model the Mamba state after those tokens, copied from one state slot to another."""

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
    # A hybrid's Mamba state after those tokens, as MambaPool.read gives it (conv, SSM);
    # empty for a model without state.
    state: tuple[torch.Tensor, ...] = ()
    # fp8 pages: the scales they were written under (KVPool.scales, on the CPU); None else
    scales: torch.Tensor | None = None

    @property
    def num_pages(self) -> int:
        """Pages of KV held."""
        return self.pages.shape[2]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Everything it holds, in order: the pages, then the state's tensors."""
        return [self.pages, *self.state]


def read_prefilled(cache: KVCache, seq_id: Hashable, num_tokens: int, *,
                   with_state: bool) -> PrefilledKV:
    """A copy of the KV of the first `num_tokens` tokens of sequence `seq_id`, and with
    `with_state` (a hybrid's cache) its state slot, which must hold the state after them."""
    num_pages = -(-num_tokens // cache.page_size)
    pages = cache.pool.read_pages(cache.pages(seq_id)[:num_pages])
    state = cache.states.read(cache.state_slot(seq_id)) if with_state else ()
    scales = None if cache.pool.scales is None else cache.pool.scales.cpu()
    return PrefilledKV(num_tokens, pages, state, scales)


def check_prefilled(cache: KVCache, kv: PrefilledKV, prompt_len: int) -> None:
    """ValueError (TypeError for another object), naming the numbers, unless `kv` fits a
    prompt of `prompt_len` tokens in `cache`: fewer tokens than the prompt (its last token is
    computed where it is sampled), their pages shaped and typed as the pool's, a state only
    for a cache with state slots and shaped as theirs, and fp8 pages only under the scales
    they were written with, which the pool must hold already."""
    if not isinstance(kv, PrefilledKV):
        raise TypeError(f"prefilled KV must be a PrefilledKV, got {type(kv).__name__}")
    if not isinstance(kv.pages, torch.Tensor):
        raise TypeError(f"prefilled KV's pages must be a torch.Tensor, got "
                        f"{type(kv.pages).__name__}")
    if not all(isinstance(x, torch.Tensor) for x in kv.state):
        raise TypeError(f"prefilled KV's state must hold torch.Tensors, got "
                        f"{[type(x).__name__ for x in kv.state]}")
    n = kv.num_tokens
    if type(n) is not int or not 0 <= n < prompt_len:
        raise ValueError(f"prefilled KV of {n!r} tokens for a prompt of {prompt_len}: it "
                         f"must cover 0 to {prompt_len - 1} of them (the last is computed here)")
    pool, states = cache.pool, cache.states
    expected = (*pool.kv.shape[:2], -(-n // cache.page_size), *pool.kv.shape[3:])
    if tuple(kv.pages.shape) != expected or kv.pages.dtype != pool.kv.dtype:
        raise ValueError(f"prefilled KV of {n} tokens must be {pool.kv.dtype} pages of shape "
                         f"{expected}, got {kv.pages.dtype} of shape {tuple(kv.pages.shape)}")
    rows = () if states is None else (states.conv, states.ssm)
    expected_state = [(r.dtype, (r.shape[0], *r.shape[2:])) for r in rows]
    got = [(x.dtype, tuple(x.shape)) for x in kv.state]
    if got != expected_state:
        raise ValueError(f"prefilled state must be (dtype, shape) {expected_state}, got {got}")
    if pool.scales is None:
        return
    if kv.scales is None or not pool.scales_ready or not torch.equal(kv.scales,
                                                                     pool.scales.cpu()):
        raise ValueError("fp8 pages computed by another engine read right only under the "
                         "scales they were written with: give both engines the same kv_scales "
                         "(scales each calibrates from its first prefill differ)")


def write_prefilled(cache: KVCache, seq_id: Hashable, kv: PrefilledKV) -> None:
    """Write `kv`'s pages into the same pages of sequence `seq_id` (which holds at least
    kv.num_tokens tokens) past those the prefix cache indexes: its prefix match, which holds
    the same KV and may be shared, so is never rewritten (a hybrid's match may run past the
    checkpoint it resumes from). Its state, if any, goes into the sequence's state slot."""
    pages = cache.pages(seq_id)[:kv.num_pages]
    first = 0
    while first < len(pages) and cache.allocator.is_cached(pages[first]):
        first += 1
    cache.pool.write_pages(pages[first:], kv.pages[:, :, first:])
    if kv.state:
        cache.states.write(cache.state_slot(seq_id), *kv.state)
