"""One request in flight: its choices' text, its usage, and the OpenAI JSON it turns into,
whole (`response`) or as server-sent-event chunks (`chunks`), for completions and chat.

Log-probabilities, when asked for, cover a choice's tokens up to where it ended. A streamed
chunk carries those of the tokens generated since the previous chunk of its choice: text
held back (a character not complete yet, the start of a stop string) does not hold back
its tokens' log-probabilities.
"""

from __future__ import annotations

import functools
import json
import time
from collections import abc
from typing import NamedTuple

from kvpool.engine import TokenLogprobs
from kvpool.models.tokenizer import Tokenizer
from kvpool.server.detokenize import ChoiceText, StopMatcher
from kvpool.server.engine_loop import Update
from kvpool.server.metrics import ChoiceTimes, RequestTimes

REPLACEMENT = "\ufffd"


class Change(NamedTuple):
    """What one engine update changed in a choice: its new text, the finish reason if it
    ended now, and the log-probabilities of its tokens since its previous change (None
    when the request did not ask for them)."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None


class Generation:
    """The choices of one request, fed the engine's updates by `update`.

    `num_prompt_tokens`: the prompt's length, for `usage`. `chat` selects the chat
    completion objects; `stop` are the request's stop strings.
    `logprobs`: the request's count of most likely tokens (None: no log-probabilities), shown
    with `token_text(token_id)` as each token's text; `tokenizer` (None: the model has none)
    decodes a choice's ids as they read after `context` (the prompt's last id), which places
    each token in the choice's text (completions' `text_offset`). `done` is True once every
    choice has ended (the engine may still be running the request when stop strings ended
    them: the caller aborts it). `token_times[i]`: when choice i got its first and its
    latest token (time.perf_counter() seconds; None before its first).
    """

    def __init__(self, request_id: str, model: str, *, num_prompt_tokens: int, n: int,
                 stop: tuple[str, ...], chat: bool, include_usage: bool, logprobs: int | None,
                 token_text: abc.Callable[[int], str], tokenizer: Tokenizer | None = None,
                 context: int | None = None):
        self.request_id, self.model, self.chat = request_id, model, chat
        self.include_usage = include_usage
        self.logprobs, self.token_text = logprobs, token_text
        self.created = int(time.time())
        matcher = StopMatcher(stop)  # built once: its cost grows with the stop strings
        self.choices = [ChoiceText(matcher) for _ in range(n)]
        self._logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]  # all received
        self._num_logprobs_sent = [0] * n
        # completions: where each choice's tokens start in its text
        self._offsets = [_Offsets(tokenizer, context) for _ in range(n)]
        self.token_times: list[tuple[float, float] | None] = [None] * n
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.scheduled_time: float | None = None
        head = _json({"id": request_id, "object": "chat.completion.chunk" if chat
                      else "text_completion", "created": self.created, "model": model})
        self._event_head = b"data: " + head[:-1] + b', "choices": '  # each event's start

    @property
    def done(self) -> bool:
        """True once every choice has ended."""
        return all(c.finished for c in self.choices)

    def update(self, update: Update, now: float | None = None) -> list[Change]:
        """Take an engine update, which arrived at `now` (time.perf_counter(), the default);
        returns the Change of each choice that changed."""
        now = time.perf_counter() if now is None else now
        self.num_cached_tokens = update.num_cached_tokens
        self.scheduled_time = update.scheduled_time
        changes = []
        for sample in update.samples:
            choice = self.choices[sample.index]
            if choice.finished:
                continue
            num_tokens = choice.num_tokens
            delta = choice.update(sample.text, sample.num_tokens, sample.finish_reason,
                                  sample.earlier)
            if choice.num_tokens > num_tokens:
                first = self.token_times[sample.index]
                self.token_times[sample.index] = (now if first is None else first[0], now)
            if sample.new_logprobs is not None:
                self._logprobs[sample.index] += sample.new_logprobs
            if delta or choice.finished:
                changes.append(Change(sample.index, delta, choice.finish_reason,
                                      self._new_logprobs(sample.index)))
        return changes

    def _new_logprobs(self, index: int) -> list[TokenLogprobs] | None:
        """The log-probabilities of the choice's tokens not sent yet, up to its end."""
        if self.logprobs is None:
            return None
        start, end = self._num_logprobs_sent[index], self.choices[index].num_tokens
        self._num_logprobs_sent[index] = end
        return self._logprobs[index][start:end]

    def times(self, arrival: float, finish: float) -> RequestTimes:
        """The request's times, for the metrics: it arrived at `arrival`, ended at
        `finish`, and each choice got its tokens when `token_times` says."""
        choices = tuple(ChoiceTimes(*times, c.num_tokens)
                        for times, c in zip(self.token_times, self.choices, strict=True)
                        if times is not None)
        return RequestTimes(arrival, self.scheduled_time,
                            min((c.first_token for c in choices), default=None), finish,
                            choices)

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens of all choices (up to where each ended)."""
        return sum(c.num_tokens for c in self.choices)

    def usage(self) -> dict:
        """The OpenAI usage object, with the prompt tokens the prefix cache served."""
        completion = self.num_completion_tokens
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    def response(self) -> dict:
        """The whole (non-streamed) response of a finished generation."""
        entries = [None if self.logprobs is None else self._logprobs[i][:c.num_tokens]
                   for i, c in enumerate(self.choices)]
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": self._chat_logprobs(entries[i]),
                        "finish_reason": c.finish_reason}
                       for i, c in enumerate(self.choices)]
        else:
            choices = [{"index": i, "text": c.text,
                        "logprobs": self._completion_logprobs(entries[i], i),
                        "finish_reason": c.finish_reason} for i, c in enumerate(self.choices)]
        return {"id": self.request_id, "object": "chat.completion" if self.chat
                else "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    # ---- server-sent events ------------------------------------------------------------

    def role_chunks(self) -> list[bytes]:
        """Chat streams open each choice with the assistant role (none for completions)."""
        if not self.chat:
            return []
        return [self._event([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for i in range(len(self.choices))]

    def chunks(self, changes: list[Change]) -> list[bytes]:
        """The events of one update: a text delta per choice that grew, and a chunk with
        the finish reason for each that ended (chat sends it with an empty delta, and
        there the log-probabilities go with the text, or with the finish when no text)."""
        events = []
        for index, delta, finish_reason, entries in changes:
            if self.chat:
                logprobs = self._chat_logprobs(entries)
                if delta:
                    events.append(self._event([{"index": index, "delta": {"content": delta},
                                                "logprobs": logprobs, "finish_reason": None}]))
                if finish_reason is not None:
                    events.append(self._event([{"index": index, "delta": {},
                                                "logprobs": None if delta else logprobs,
                                                "finish_reason": finish_reason}]))
            else:
                logprobs = self._completion_logprobs(entries, index)
                events.append(self._event([{"index": index, "text": delta,
                                            "logprobs": logprobs,
                                            "finish_reason": finish_reason}]))
        return events

    def final_chunks(self) -> list[bytes]:
        """The usage chunk when asked for (no choices), then the end of the stream."""
        events = []
        if self.include_usage:
            events.append(self._event([], usage=self.usage()))
        return [*events, b"data: [DONE]\n\n"]

    # ---- log-probabilities ----------------------------------------------------------------

    def _completion_logprobs(self, entries: list[TokenLogprobs] | None,
                             index: int) -> dict | None:
        """The completions `logprobs` object of choice `index`'s next `entries`. As
        OpenAI's, `top_logprobs` holds the sampled token too (up to logprobs + 1), each token
        named by `_token_names`."""
        if entries is None:
            return None
        tokens, tops = [], []
        for entry in entries:
            ids = [entry.token_id, *(t for t, _ in entry.top if t != entry.token_id)]
            names = dict(zip(ids, self._token_names(ids), strict=True))
            tokens.append(names[entry.token_id])
            top = {names[t]: v for t, v in entry.top}
            top.setdefault(names[entry.token_id], entry.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops,
                "text_offset": self._offsets[index].of([e.token_id for e in entries])}

    def _token_names(self, token_ids: list[int]) -> list[str]:
        """The names of one position's distinct tokens: each one's text, or "token_id:N"
        where that is no whole character (a byte of a longer one: such tokens all read
        U+FFFD), empty, or another's text too ("▁the" and "the" both read "the" alone):
        completions key the top tokens by name, so no two may share one."""
        texts = [self.token_text(t) for t in token_ids]
        return [text if text and REPLACEMENT not in text and texts.count(text) == 1
                else f"token_id:{token_id}" for token_id, text in zip(token_ids, texts,
                                                                      strict=True)]

    def _chat_logprobs(self, entries: list[TokenLogprobs] | None) -> dict | None:
        """The chat `logprobs` object of `entries`: each token's text, bytes and
        log-probability, and its `top_logprobs` (the request's count, most likely first)."""
        if entries is None:
            return None
        return {"content": [{**self._chat_token(e.token_id, e.logprob),
                             "top_logprobs": [self._chat_token(t, v) for t, v in e.top]}
                            for e in entries]}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        """A token as chat logprobs show it: its text, its UTF-8 bytes (None when its text is
        not whole characters, a byte of a longer character for instance) and logprob."""
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob,
                "bytes": None if REPLACEMENT in text else list(text.encode())}

    def _event(self, choices: list[dict], usage: dict | None = None) -> bytes:
        """An event of the stream: the fields every event repeats (encoded once), `choices`,
        and `usage` when the request asked for it (null but in the last)."""
        tail = b"}\n\n"
        if self.include_usage:
            tail = (b', "usage": null' if usage is None else b', "usage": ' + _json(usage)) + tail
        return self._event_head + _json(choices) + tail


def sse(body: dict) -> bytes:
    """One server-sent event carrying `body` as JSON."""
    return b"data: " + _json(body) + b"\n\n"


_ENCODER = json.JSONEncoder(ensure_ascii=False)  # json.dumps would build one per call


class _Offsets:
    """Where each token of a choice starts in its text, in characters: the length of what
    the tokens before it decode to, so the tokens holding the bytes of one character all
    start where it does, and a token after bytes that never made a character starts after
    the U+FFFD they read as. 0 without a tokenizer (the text is empty)."""

    def __init__(self, tokenizer: Tokenizer | None, context: int | None):
        self._tokenizer, self._context = tokenizer, context
        self._stream = None if tokenizer is None else tokenizer.stream(context=context)
        self._ids, self._length = [], 0
        self._held = False  # whether the stream may be holding back bytes of the ids so far

    def of(self, token_ids: list[int]) -> list[int]:
        """The offsets of the choice's next tokens, `token_ids`."""
        offsets = []
        for token_id in token_ids:
            offset = self._length
            if self._stream is not None:
                self._ids.append(token_id)
                if self._held:
                    offset = self._after_held_bytes()
                text = self._stream.text(self._ids)
                # A stream shows bytes that make no character yet as nothing (a tokenizers
                # DecodeStream: a whole run of them) or, once invalid, as U+FFFD.
                self._held = len(text) == self._length or text.endswith(REPLACEMENT)
                self._length = len(text)
            offsets.append(offset)
        return offsets

    def _after_held_bytes(self) -> int:
        """Where the last token starts when the stream may have held back bytes before it,
        from the decoded text: those bytes end the text of the ids before it in U+FFFD (one
        for a character not complete yet). The token joins that character, and starts on
        it, when it changes that text, or when it adds none to it though it reads as some
        alone (another byte of the character); else it starts after it."""
        decode = functools.partial(self._tokenizer.decode, context=self._context)
        before, after = decode(self._ids[:-1]), decode(self._ids)
        joins = not after.startswith(before) or (
            after == before and self._tokenizer.decode(self._ids[-1:]) != "")
        return len(before) - (before.endswith(REPLACEMENT) and joins)


def _json(value: object) -> bytes:
    return _ENCODER.encode(value).encode()
