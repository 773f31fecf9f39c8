"""SamplingParams: how the tokens of one request are chosen and when they stop."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.errors import check_int
from kvpool.numeric import INT64_MAX, check_float32, check_int64

SEED_LIMIT = 2**64  # torch generators take seeds in [0, 2**64)
MAX_LOGPROBS = 20  # alternatives per token at most, as the OpenAI API allows
# Temperatures below this are greedy: dividing logits by ~1e-38 overflows to inf and the
# softmax to NaN. vLLM uses the same bound.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names).

    temperature 0 (or below MIN_TEMPERATURE) is greedy (argmax); otherwise logits are
    divided by it, filtered by
    `top_k` (0: off) then `top_p` (1.0: off), and a token is drawn. `seed` gives the request
    its own random generator, so its samples do not depend on the rest of the batch.
    Generation stops after `max_tokens` tokens, at a token of `stop_token_ids`, or at the
    model's EOS unless `ignore_eos`. `n` samples share the prompt's pages (forked).
    `logprobs` (None: off) asks for each generated token's log-probability and those of the
    `logprobs` most likely tokens at its position (0 to MAX_LOGPROBS).
    Every field is checked here, type and range as the device holds it (float32, int64:
    kvpool.numeric), so a request never fails mid-step; `temperature` and `top_p` are kept
    as floats (an int given is converted), `stop_token_ids` as a tuple and `stop_token_set`
    as a frozenset, for a test of each sampled token that takes the same time however many
    there are.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int64("max_tokens", self.max_tokens, 1)
        check_int64("top_k", self.top_k, 0)
        check_int64("n", self.n, 1)
        if self.seed is not None:
            check_int("seed", self.seed, 0, SEED_LIMIT - 1)  # the sampler keys 64-bit seeds
        temperature = check_float32("temperature", self.temperature, low=0.0)
        # A top_p that is 0 in float32 still keeps the most likely token (see sampling).
        top_p = check_float32("top_p", self.top_p, low=0.0, high=1.0, open_low=True)
        stop = self.stop_token_ids
        if not isinstance(stop, (tuple, list)) or not all(
                _is_int(t) and 0 <= t <= INT64_MAX for t in stop):
            raise ValueError(f"stop_token_ids must be a tuple of token ids (ints in "
                             f"[0, 2**63)), got {stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r} "
                            f"({type(self.ignore_eos).__name__})")
        if self.logprobs is not None:
            check_int64("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        # the checked values, so that an int (10**20: finite in float32) is held as a float
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "stop_token_ids", tuple(stop))
        object.__setattr__(self, "stop_token_set", frozenset(stop))

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature below MIN_TEMPERATURE)."""
        return self.temperature < MIN_TEMPERATURE


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
