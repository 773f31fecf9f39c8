"""Token sampling for a batch: greedy rows by one argmax, the others by temperature,
top-k and top-p, drawn with the exponential race (argmax of p / E, E ~ Exp(1)), which is
a categorical draw that needs one noise tensor and no cumulative search."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from kvpool.engine.params import SamplingParams


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`logits` [n, vocab] with -inf outside each row's `top_k` largest (0: no limit; ties
    with the k-th value are kept), then outside the smallest set of most likely tokens whose
    probability reaches `top_p` (1.0: no limit). `top_k` [n] int, `top_p` [n] float."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.long)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def stop_reason(
    token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: Collection[int]
) -> str | None:
    """Why a sequence ends after sampling `token_id` as its `num_output_tokens`-th token:
    "stop" (a stop token, or EOS unless ignore_eos), "length" (max_tokens), or None."""
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None


class Sampler:
    """Chooses one token per row of a batch of logits. Rows with their own generator (a
    seeded request) draw their noise from it alone; the others share `generator`."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """Token ids for `logits` [n, vocab] (float32), row i by `params[i]`."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            chosen = [params[i] for i in rows]
            tokens[rows] = self._sample(logits[rows], chosen, [generators[i] for i in rows])
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        """Draw one token per row of `logits` [n, vocab], every row sampled (temperature > 0)."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        return (probs / self._exponential_noise(probs, generators)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor,
                           generators: list[torch.Generator | None]) -> torch.Tensor:
        """Exp(1) draws shaped like `probs`, each row from its own generator if it has one."""
        noise = torch.empty_like(probs)
        if all(g is None for g in generators):
            noise.exponential_(generator=self.generator)
        else:
            for row, g in zip(noise, generators, strict=True):
                row.exponential_(generator=g or self.generator)
        # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax picks.
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
