"""Token sampling for a batch, on the logits' device: greedy rows by one argmax, the others by
temperature, top-k and top-p, drawn with the exponential race (argmax of p / E, E ~ Exp(1)),
a categorical draw that needs one noise tensor and no cumulative search.

The noise of a row is a counter-based hash of (seed, stream, position, token id): no random
generator state, so a whole batch draws in a few elementwise kernels, and a row's draw depends
only on its own key, never on the other rows of the batch (nor on preemption and recompute)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch

from kvpool.engine.params import SamplingParams
from kvpool.engine.request import TokenLogprobs

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1  # odd constant (2**32 / golden ratio) that spreads token ids apart


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`logits` [n, vocab] with -inf outside each row's `top_k` largest (0: no limit; ties
    with the k-th value are kept), then outside the smallest set of most likely tokens whose
    probability reaches `top_p` (1.0: no limit; the most likely token always stays).
    `top_k` [n] int, `top_p` [n] float."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.long)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    # The most likely token always stays, even when top_p is 0 in float32 (1e-46 is).
    outside[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def stop_reason(
    token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: Collection[int]
) -> str | None:
    """Why a sequence ends after sampling `token_id` as its `num_output_tokens`-th token:
    "stop" (a stop token, or EOS unless ignore_eos), "length" (max_tokens), or None."""
    if token_id in params.stop_token_set or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None


class SampledLogprobs(NamedTuple):
    """The log-probabilities a step's rows asked for, still on the logits' device: row
    `rows[j]` has its sampled token's in `values[j, 0]` and its most likely tokens' in
    `values[j, 1:]` (ids `top_ids[j]`), of which it keeps `counts[rows[j]]`."""

    rows: list[int]
    counts: list[int | None]
    values: torch.Tensor
    top_ids: torch.Tensor

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> SampledLogprobs:
        """The same with its tensors on `device` (a copy to the host that may be pending
        when non_blocking)."""
        return self._replace(values=self.values.to(device, non_blocking=non_blocking),
                             top_ids=self.top_ids.to(device, non_blocking=non_blocking))

    def entries(self, token_ids: Sequence[int]) -> list[TokenLogprobs | None]:
        """One TokenLogprobs per row (None for rows that did not ask), `token_ids` being the
        sampled tokens."""
        values, top_ids = self.values.tolist(), self.top_ids.tolist()
        entries: list[TokenLogprobs | None] = [None] * len(self.counts)
        for j, i in enumerate(self.rows):
            n = self.counts[i]
            entries[i] = TokenLogprobs(token_ids[i], values[j][0],
                                       tuple(zip(top_ids[j][:n], values[j][1:n + 1],
                                                 strict=True)))
        return entries


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, counts: Sequence[int | None],
) -> SampledLogprobs | None:
    """The log-probabilities of the sampled tokens for the rows that ask, on the logits'
    device: row i with `counts[i]` not None gets the log_softmax of `logits[i]` (the
    model's, before temperature, top-k and top-p) at its token `tokens[i]` and at the
    `counts[i]` most likely tokens. None when no row asks, so the usual step computes
    nothing."""
    rows = [i for i, count in enumerate(counts) if count is not None]
    if not rows:
        return None
    index = torch.tensor(rows).to(logits.device, non_blocking=True)
    logprobs = logits[index].float().log_softmax(dim=-1)
    sampled = logprobs.gather(1, tokens[index].unsqueeze(1))
    k = min(max(counts[i] for i in rows), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return SampledLogprobs(rows, list(counts), torch.cat([sampled, top_values], dim=1), top_ids)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """An avalanching hash of int64 values in [0, 2**32) to int64 values in [0, 2**32).

    Multipliers stay below 2**31 so every product fits in int64 without wrapping."""
    for multiplier in (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39):
        x = x ^ (x >> 16)
        x = (x * multiplier) & _MASK32
    return x ^ (x >> 16)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws `[n, vocab]` float32, row i a pure function of `keys[i]` (int64 in
    [0, 2**32)) and the token id; strictly positive (no 0 / 0 for a masked token)."""
    tokens = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    bits = hash32((keys.unsqueeze(1) + tokens * _GOLDEN) & _MASK32)
    # 32 bits and a half step: uniform on (0, 1), exact near 0 in float32, where log1p keeps
    # the draws apart down to 1e-10 (-log(1 - u) would stop at 3e-8, so that a token less
    # likely than 3e-8 times the likeliest could never win); below 1, so never infinite
    uniform = ((bits.float() + 0.5) * 2.0**-32).clamp(max=1 - 2.0**-24)
    return -torch.log1p(-uniform)


def row_keys(
    seeds: Sequence[int], streams: Sequence[int], positions: Sequence[int]
) -> torch.Tensor:
    """`[n]` int64 keys in [0, 2**32) on the CPU, row i hashing (seeds[i], streams[i],
    positions[i]), each any int >= 0 (seeds up to 2**64). The position is hashed first: two
    (seed, stream) pairs then share a key only at scattered positions, never a whole stream
    (hashing the seed first would fold it to 32 bits for every position at once)."""
    seed = torch.tensor([[s & _MASK32, (s >> 32) & _MASK32] for s in seeds], dtype=torch.int64)
    key = hash32(torch.tensor(positions, dtype=torch.int64) & _MASK32)
    key = hash32(key ^ seed[:, 0].reshape(-1))
    key = hash32(key ^ seed[:, 1].reshape(-1))
    return hash32(key ^ (torch.tensor(streams, dtype=torch.int64) & _MASK32))


class Sampler:
    """Chooses one token per row of a batch of logits, on their device.

    A seeded request's row i draws from (its seed, its sample index, its position), so it
    samples the same whatever else is in the batch; the other rows draw from (the engine's
    `seed`, a stream unique to the sequence, the position)."""

    def __init__(self, seed: int):
        self.seed = seed

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        streams: Sequence[int],
        positions: Sequence[int],
    ) -> torch.Tensor:
        """Token ids `[n]` int64 on the logits' device for `logits` [n, vocab] (float32), row i
        by `params[i]`. `streams[i]`: the sample index of a seeded request, else a sequence id
        unique in this engine; `positions[i]`: the position of the token being sampled."""
        greedy = [p.greedy for p in params]
        tokens = logits.argmax(dim=-1)
        if all(greedy):
            return tokens
        device = logits.device
        # Greedy rows are sampled at temperature 1 too (no per-row split) and then replaced.
        # dtypes given: inferred, they would follow the values (int64 for int temperatures)
        temperature = torch.tensor([1.0 if g else p.temperature
                                    for p, g in zip(params, greedy, strict=True)],
                                   dtype=torch.float32)
        scaled = logits / temperature.to(device, non_blocking=True).unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            scaled = apply_top_k_top_p(scaled, top_k.to(device, non_blocking=True),
                                       top_p.to(device, non_blocking=True))
        seeds = [self.seed if p.seed is None else p.seed for p in params]
        # Seeded and unseeded rows live in separate stream spaces (low bit of the stream).
        tagged = [2 * s + (p.seed is not None) for p, s in zip(params, streams, strict=True)]
        keys = row_keys(seeds, tagged, positions).to(device, non_blocking=True)
        probs = scaled.softmax(dim=-1)
        sampled = (probs / exponential_noise(keys, logits.shape[-1])).argmax(dim=-1)
        greedy_rows = torch.tensor(greedy, dtype=torch.bool).to(device, non_blocking=True)
        return torch.where(greedy_rows, tokens, sampled)
