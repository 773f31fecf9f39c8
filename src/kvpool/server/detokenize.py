"""The text of one choice as it streams: stop strings matched on decoded text, and nothing
sent that may still change.

The engine hands over the whole decoded text of a sample after every step. A choice sends
only what is final: a trailing U+FFFD may be a character whose bytes have not all arrived,
and a tail that begins a stop string may become one. A stop string ends the choice at its
first occurrence, wherever token boundaries fall; the text before it is the choice's text.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class ChoiceText:
    """One choice's text, fed the sample's full decoded text by `update`.

    `text` is what has been sent, `finish_reason` None until the choice ends ("stop" for
    a stop string too), `num_tokens` the sample's tokens when the choice ended or last seen.
    """

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.text = ""
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self._longest_stop = max((len(s) for s in stop), default=0)

    @property
    def finished(self) -> bool:
        """True once the choice has ended (its text is complete)."""
        return self.finish_reason is not None

    def update(self, text: str, num_tokens: int, finish_reason: str | None) -> str:
        """Take the sample's decoded text so far (`num_tokens` generated tokens), and the
        engine's finish reason; return the new text to send (maybe "")."""
        if self.finished:
            return ""
        self.num_tokens = num_tokens
        cut = self._find_stop(text)
        if cut is not None:
            text, finish_reason = text[:cut], "stop"
        end = len(text) if finish_reason is not None else self._final_length(text)
        delta = text[len(self.text):end]
        self.text += delta
        self.finish_reason = finish_reason
        return delta

    def _find_stop(self, text: str) -> int | None:
        """Where the first stop string starts in `text`, or None. Text already sent holds
        none, so the search starts where a stop string could overlap the new text."""
        if not self.stop:
            return None
        start = max(0, len(self.text) - self._longest_stop + 1)
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(found, default=None)

    def _final_length(self, text: str) -> int:
        """How much of an unfinished text cannot change: without a trailing U+FFFD run and
        without the longest tail that a stop string begins with."""
        end = len(text.rstrip(REPLACEMENT))
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, end), held, -1):
                if text.endswith(stop[:k], 0, end):
                    held = k
                    break
        return max(end - held, len(self.text))
