"""Requests and their sequences (one per sample), and the outputs the engine returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpool.engine.handoff import PrefilledKV
from kvpool.engine.params import SamplingParams
from kvpool.errors import KVPoolError
from kvpool.models.tokenizer import TextStream


class SequenceStatus(enum.Enum):
    """Where a sequence is: in the waiting queue, running (holds pages), or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request: the prompt followed by the tokens generated so far.

    `num_computed_tokens` leading tokens have their KV written in the cache; the cache's
    sequence with id `seq_id` exists exactly while the status is RUNNING.
    """

    seq_id: int
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    # One per generated token when the request asks for logprobs.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Decodes the generated tokens while the sequence runs (made at its first output).
    text_stream: TextStream | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens whose ids are known: a last token still being sampled on the
        device (a negative placeholder, see kvpool.engine.overlap) is left out."""
        end = len(self.token_ids) - (self.token_ids[-1] < 0)
        return self.token_ids[len(self.request.prompt_token_ids):end]

    @property
    def params(self) -> SamplingParams:
        """The request's sampling settings."""
        return self.request.params

    @property
    def finished(self) -> bool:
        """True once stopped or aborted."""
        return self.status is SequenceStatus.FINISHED


@dataclass(slots=True, eq=False)
class Request:
    """A prompt and its `params.n` sequences. Only the first exists until its prompt is
    prefilled; the other samples are then forked from it and share its pages."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    error: KVPoolError | None = None  # why the request was refused, or failed in a step
    aborted: bool = False
    # Set when the first sample is first admitted (a preempted one keeps them).
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served
    scheduled_time: float | None = None  # time.perf_counter() of that admission
    cache_salt: str | None = None  # shares cached prefix pages only with requests of this salt
    # The KV of the first prompt tokens, computed by another engine; used at the first
    # admission only (kvpool.engine.disaggregated).
    prefilled: PrefilledKV | None = None

    @property
    def forked(self) -> bool:
        """True once all n samples exist."""
        return len(self.seqs) == self.params.n

    @property
    def finished(self) -> bool:
        """True when refused, aborted, or when every sample has finished."""
        if self.error is not None or self.aborted:
            return True
        return self.forked and all(s.finished for s in self.seqs)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probability (natural log) of one generated token under the model, from the
    logits it was sampled from before temperature, top-k and top-p; and `top`, the
    (token id, log-probability) pairs of the most likely tokens there, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. `token_ids` are the generated tokens, the stop or EOS token
    included; `text` decodes them without the stop token ("" when there is no tokenizer).
    `finish_reason`: None while running, "stop", "length", "abort" or "error".
    `logprobs`: one TokenLogprobs per token of `token_ids` when the request asked for them
    (SamplingParams.logprobs), else None."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and one CompletionOutput per sample. `error` is
    the KVPoolError that refused the request (SequenceTooLong, OutOfPages) or failed it in a
    step (StepFailed), else None.
    `num_cached_tokens`: prompt tokens the prefix cache served at its first admission (0
    before it); `scheduled_time`: time.perf_counter() of that admission (None before)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: KVPoolError | None = None
    num_cached_tokens: int = 0
    scheduled_time: float | None = None
