"""One request in flight: its choices' text, its usage, and the OpenAI JSON it turns into,
whole (`response`) or as server-sent-event chunks (`chunks`), for completions and chat."""

from __future__ import annotations

import json
import time

from kvpool.engine import RequestOutput
from kvpool.server.detokenize import ChoiceText


class Generation:
    """The choices of one request, fed the engine's outputs by `update`.

    `chat` selects the chat completion objects; `stop` are the request's stop strings.
    `done` is True once every choice has ended (the engine may still be running the request
    when stop strings ended them: the caller aborts it).
    """

    def __init__(self, request_id: str, model: str, *, n: int, stop: tuple[str, ...],
                 chat: bool, include_usage: bool):
        self.request_id, self.model, self.chat = request_id, model, chat
        self.include_usage = include_usage
        self.created = int(time.time())
        self.choices = [ChoiceText(stop) for _ in range(n)]
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.scheduled_time: float | None = None

    @property
    def done(self) -> bool:
        """True once every choice has ended."""
        return all(c.finished for c in self.choices)

    def update(self, output: RequestOutput) -> list[tuple[int, str, str | None]]:
        """Take an engine output; returns (choice index, new text, finish reason if the
        choice ended now) for each choice that changed."""
        self.num_prompt_tokens = len(output.prompt_token_ids)
        self.num_cached_tokens = output.num_cached_tokens
        self.scheduled_time = output.scheduled_time
        changes = []
        for sample in output.outputs:
            choice = self.choices[sample.index]
            if choice.finished:
                continue
            delta = choice.update(sample.text, len(sample.token_ids), sample.finish_reason)
            if delta or choice.finished:
                changes.append((sample.index, delta, choice.finish_reason))
        return changes

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
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": None, "finish_reason": c.finish_reason}
                       for i, c in enumerate(self.choices)]
        else:
            choices = [{"index": i, "text": c.text, "logprobs": None,
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

    def chunks(self, changes: list[tuple[int, str, str | None]]) -> list[bytes]:
        """The events of one update: a text delta per choice that grew, and a chunk with
        the finish reason for each that ended (chat sends it with an empty delta)."""
        events = []
        for index, delta, finish_reason in changes:
            if self.chat:
                if delta:
                    events.append(self._event([{"index": index, "delta": {"content": delta},
                                                "logprobs": None, "finish_reason": None}]))
                if finish_reason is not None:
                    events.append(self._event([{"index": index, "delta": {},
                                                "logprobs": None,
                                                "finish_reason": finish_reason}]))
            else:
                events.append(self._event([{"index": index, "text": delta, "logprobs": None,
                                            "finish_reason": finish_reason}]))
        return events

    def final_chunks(self) -> list[bytes]:
        """The usage chunk when asked for (no choices), then the end of the stream."""
        events = []
        if self.include_usage:
            events.append(self._event([], usage=self.usage()))
        return [*events, b"data: [DONE]\n\n"]

    def _event(self, choices: list[dict], **extra) -> bytes:
        body = {"id": self.request_id, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.model,
                "choices": choices}
        if self.include_usage:
            body["usage"] = extra.get("usage")
        return sse(body)


def sse(body: dict) -> bytes:
    """One server-sent event carrying `body` as JSON."""
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"
