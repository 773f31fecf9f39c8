"""Tokenizers: a checkpoint's tokenizer.json or GGUF vocabulary (through the `tokenizers`
library) and the byte tokenizer of the built-in "tiny" model. Both map text <-> token ids,
know the special ids, and decode a growing sequence incrementally (`stream`), so that a
sample's text costs time linear in its tokens, not in their square."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from kvpool.errors import CheckpointError

BYTE_BOS = 256
BYTE_EOS = 257


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], *, context: int | None = None) -> str:
        """Token ids -> text, as it reads after token `context` (a sample's: its prompt's
        last): a SentencePiece vocabulary then keeps the space that opens the text, which
        it strips at the start of a text."""

    def stream(self, *, context: int | None = None) -> TextStream:
        """A decoder for one growing sequence of token ids (after `context`, as `decode`)."""


class TextStream(Protocol):
    """Decodes one sequence's token ids as they grow, in time linear in the new ones."""

    def text(self, ids: list[int]) -> str:
        """The text of the sequence's ids so far (`ids` extends the last call's): the
        tokenizer's `decode` of them, or, while the last ids do not yet spell whole
        characters (`decode` shows U+FFFD), a prefix of it that leaves them out. Wherever
        `decode` itself never takes text back as ids are added, each text is a prefix of the
        next."""


class HFTokenizer:
    """A `tokenizers` Tokenizer: a checkpoint's tokenizer.json (`from_file`) or one built from
    a GGUF file's vocabulary. `encode` adds the special tokens its post-processor declares
    (e.g. Llama's BOS); `decode` drops special tokens."""

    def __init__(self, tokenizer: _HFTokenizer, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_file(cls, path: str | Path, bos_token_id: int | None,
                  eos_token_ids: tuple[int, ...]) -> HFTokenizer:
        """A tokenizer.json; a file the tokenizers library cannot read raises
        CheckpointError."""
        try:
            tokenizer = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises bare Exception for every fault
            raise CheckpointError(f"{path} is not a readable tokenizer.json: {e}") from None
        return cls(tokenizer, bos_token_id, eos_token_ids)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids; `add_special_tokens` False leaves out the post-processor's
        (for text that spells them already, such as a rendered chat template)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, context: int | None = None) -> str:
        """Token ids -> text, special tokens dropped; after `context`, the text that
        decoding `[context, *ids]` adds to `context`'s (the ids alone where `context` is
        part of a character they end)."""
        text = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        if context is None:
            return text
        before = self.decode([context])
        after = self._tokenizer.decode([context, *ids], skip_special_tokens=True)
        if before.endswith("\ufffd") or not after.startswith(before):
            return text
        return after[len(before):]

    def stream(self, *, context: int | None = None) -> TextStream:
        """The `tokenizers` library's DecodeStream over this tokenizer, special tokens
        dropped, primed with `context`: about 1 us a token, where `decode` of 150 tokens
        takes 27 (SmolLM2)."""
        return _HFTextStream(self, context)


class _HFTextStream:
    """A DecodeStream's chunks, joined. A sequence it cannot follow (it raises where the
    text of a piece would change what it returned before: byte pieces that turn invalid
    together) is decoded whole from then on."""

    def __init__(self, tokenizer: HFTokenizer, context: int | None):
        self._tokenizer, self._context = tokenizer, context
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=True)
        self._text, self._fed = "", 0
        if context is not None and tokenizer.decode([context]).endswith("\ufffd"):
            self._context = None  # part of a character: the ids read alone, as in decode
        elif context is not None:
            try:
                self._stream.step(tokenizer._tokenizer, context)
            except Exception:  # noqa: BLE001 - as in text(): decoded whole from then on
                self._stream = None

    def text(self, ids: list[int]) -> str:
        if self._stream is not None:
            try:
                for i in ids[self._fed:]:
                    self._text += self._stream.step(self._tokenizer._tokenizer, i) or ""
                self._fed = len(ids)
                return self._text
            except Exception:  # the tokenizers library raises bare Exception for every fault
                self._stream = None
        return self._tokenizer.decode(ids, context=self._context)


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255), plus BOS (256) and EOS (257)."""

    bos_token_id = BYTE_BOS
    eos_token_ids = (BYTE_EOS,)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text -> [BOS] + its UTF-8 bytes (no BOS when `add_special_tokens` is False)."""
        return [BYTE_BOS] * add_special_tokens + list(text.encode("utf-8"))

    def decode(self, ids: list[int], *, context: int | None = None) -> str:
        """Token ids -> text; special ids are dropped, invalid UTF-8 becomes U+FFFD. Bytes
        read the same after any `context`."""
        return bytes([i for i in ids if i < BYTE_BOS]).decode("utf-8", errors="replace")

    def stream(self, *, context: int | None = None) -> TextStream:
        """An incremental UTF-8 decoder over the byte ids (special ids dropped)."""
        return _ByteTextStream()


class _ByteTextStream:
    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text, self._fed = "", 0

    def text(self, ids: list[int]) -> str:
        self._text += self._decoder.decode(bytes([i for i in ids[self._fed:] if i < BYTE_BOS]))
        self._fed = len(ids)
        return self._text
