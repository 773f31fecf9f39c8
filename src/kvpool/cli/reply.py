"""One request's reply as the commands that run requests see it: streamed to the terminal
(`generate`, `chat`), and failed when the engine finished it with "error" (those two and
`bench`)."""

from __future__ import annotations

from typing import TextIO

from kvpool.engine import LLM, SamplingParams
from kvpool.engine.request import RequestOutput
from kvpool.errors import KVPoolError
from kvpool.formats import VISIBLE_CONTROLS


def request_error(output: RequestOutput) -> KVPoolError | None:
    """Why the engine failed the request (its finish reason is "error"); None for a request
    that finished otherwise or still runs."""
    return output.error if output.outputs[0].finish_reason == "error" else None


def stream_reply(llm: LLM, prompt: str | list[int], params: SamplingParams,
                 stdout: TextIO) -> RequestOutput:
    """Generate one reply, writing its text to `stdout` as it arrives (controls in visible
    forms) and a newline at the end; returns its final output, failed or not
    (`request_error`)."""
    llm.add_request(prompt, params)
    shown, final = "", None
    while llm.has_unfinished():
        for output in llm.step():
            text = output.outputs[0].text
            # A trailing U+FFFD may be a character whose bytes have not all arrived yet.
            if output.finished or not text.endswith("\ufffd"):
                stdout.write(text[len(shown):].translate(VISIBLE_CONTROLS))
                stdout.flush()
                shown = text
            if output.finished:
                final = output
    stdout.write("\n")
    return final
