"""The text of one choice as it streams: stop strings matched on decoded text, and nothing
sent that may still change.

The engine hands over the whole decoded text of a sample after every step. A choice sends
only what is final: a trailing U+FFFD may be a character whose bytes have not all arrived,
and a tail that begins a stop string may become one. A stop string ends the choice where it
first ends (as a model stopping at once would), wherever token boundaries fall; the text
before it is the choice's text (of two ending at the same character, the longer wins).

The stop strings are matched by one Aho-Corasick automaton that reads each character once,
so a choice costs time linear in its text plus the stop strings' length, whatever their
number: the automaton's state also says how long a tail may still begin one.
"""

from __future__ import annotations

from collections import deque

REPLACEMENT = "\ufffd"


class StopMatcher:
    """An Aho-Corasick automaton over stop strings; state 0 is the empty text. Built once
    per request (its choices share it) in time linear in the strings' total length."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]  # characters of the longest stop-string prefix the state stands for
        self.ends = [0]  # length of the longest stop string that ends at this state (0: none)
        for string in stop:
            state = 0
            for char in string:
                nxt = self.goto[state].get(char)
                if nxt is None:
                    nxt = self.goto[state][char] = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.ends.append(0)
                state = nxt
            self.ends[state] = len(string)
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())
        while queue:
            state = queue.popleft()
            for char, nxt in self.goto[state].items():
                back = self.fail[state]
                while back and char not in self.goto[back]:
                    back = self.fail[back]
                self.fail[nxt] = self.goto[back].get(char, 0)
                if not self.ends[nxt]:
                    self.ends[nxt] = self.ends[self.fail[nxt]]
                queue.append(nxt)

    def feed(self, state: int, text: str, start: int, end: int) -> tuple[int, int | None]:
        """Read `text[start:end]` from `state`; returns the state after it and, if a stop
        string ended on the way, where the first one to end starts (the state then is of
        no further use)."""
        goto, fail, ends = self.goto, self.fail, self.ends
        for i in range(start, end):
            char = text[i]
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            if ends[state]:
                return state, i + 1 - ends[state]
        return state, None


NO_STOP = StopMatcher(())


class ChoiceText:
    """One choice's text, fed the sample's full decoded text by `update`; `matcher` holds
    the request's stop strings.

    `text` is what has been sent, `finish_reason` None until the choice ends ("stop" for
    a stop string too), `num_tokens` the sample's tokens when the choice ended or last seen.
    """

    def __init__(self, matcher: StopMatcher = NO_STOP):
        self.matcher = matcher
        self.text = ""
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self._state = 0  # the matcher's state after the text scanned
        self._scanned = 0  # characters of the text the matcher has read (they cannot change)

    @property
    def finished(self) -> bool:
        """True once the choice has ended (its text is complete)."""
        return self.finish_reason is not None

    def update(self, text: str, num_tokens: int, finish_reason: str | None,
               earlier: list[tuple[int, int]] | None = None) -> str:
        """Take the sample's decoded text so far (`num_tokens` generated tokens), and the
        engine's finish reason; return the new text to send (maybe ""). `earlier`: the
        (characters, tokens) of updates skipped since the last call (`Sample.earlier`); a
        stop string counts the tokens of the first update whose text held all of it, as if
        each had been taken."""
        if self.finished:
            return ""
        self.num_tokens = num_tokens
        end = len(text)
        if finish_reason is None:  # a trailing U+FFFD run may still change
            floor = max(self._scanned, len(self.text))
            while end > floor and text[end - 1] == REPLACEMENT:
                end -= 1
        if self.matcher.stop:
            self._state, cut = self.matcher.feed(self._state, text, self._scanned, end)
            self._scanned = end
            if cut is not None:
                end, finish_reason = cut, "stop"
                stop_end = cut + self.matcher.ends[self._state]
                self.num_tokens = next((tokens for chars, tokens in earlier or ()
                                        if chars >= stop_end), num_tokens)
            elif finish_reason is None:  # hold back the tail that may begin a stop string
                end -= self.matcher.depth[self._state]
        delta = text[len(self.text):max(end, len(self.text))]
        self.text += delta
        self.finish_reason = finish_reason
        return delta
