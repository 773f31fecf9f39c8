"""Overlap scheduling: the host prepares step N+1 while the device still runs step N.

A step is launched (scheduled, run, sampled on the device) and finished (its sampled tokens
read on the host, stop checks, outputs, callbacks) as two halves. Without overlap the engine
finishes each step right after launching it. With overlap it launches step N+1 first and
finishes step N after: step N+1's input ids take step N's tokens on the device (the
scheduler's placeholders, `kvpool.engine.scheduler.placeholder`), and the host copy of step
N's tokens was queued behind step N's sampling, so waiting for it never waits for step N+1.
A sequence that stopped at step N and was scheduled into step N+1 has that step's token
dropped; its pages went back when it stopped."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.engine.request import Sequence, TokenLogprobs
from kvpool.engine.sampling import SampledLogprobs
from kvpool.engine.scheduler import ScheduledBatch


class HostCopy:
    """A step's sampled tokens, whether each row's logits were finite, and the logprobs
    asked for, on their way to the host: copies queued on the device's stream without
    waiting; `wait` returns them once there."""

    def __init__(self, tokens: torch.Tensor, finite: torch.Tensor,
                 logprobs: SampledLogprobs | None):
        self.tokens = tokens.to("cpu", non_blocking=True)
        self.finite = finite.to("cpu", non_blocking=True)
        self.logprobs = None if logprobs is None else logprobs.to("cpu", non_blocking=True)
        # A copy from a CUDA device is done when its stream passes this event; a copy
        # from the CPU is done already.
        self.event = torch.cuda.Event() if tokens.is_cuda else None
        if self.event is not None:  # on the tokens' stream, whichever device is current
            self.event.record(torch.cuda.current_stream(tokens.device))

    def wait(self) -> tuple[list[int], list[bool], list[TokenLogprobs | None] | None]:
        """The sampled token ids, whether each row's logits were finite, and each row's
        TokenLogprobs (None: no row asked)."""
        if self.event is not None:
            self.event.synchronize()
        token_ids = self.tokens.tolist()
        entries = None if self.logprobs is None else self.logprobs.entries(token_ids)
        return token_ids, self.finite.tolist(), entries


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward and sampling are queued on the device, not yet finished:
    `seqs[i]` samples `tokens[i]` (on the device; it holds `placeholder(i)` for it)."""

    batch: ScheduledBatch
    seqs: list[Sequence]
    tokens: torch.Tensor
    host: HostCopy

    @classmethod
    def sampled(cls, batch: ScheduledBatch, seqs: list[Sequence], tokens: torch.Tensor,
                finite: torch.Tensor, logprobs: SampledLogprobs | None) -> LaunchedStep:
        """The launched step, its tokens' copy to the host queued now."""
        return cls(batch, seqs, tokens, HostCopy(tokens, finite, logprobs))
