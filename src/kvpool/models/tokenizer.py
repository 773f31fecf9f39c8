"""Tokenizers: a checkpoint's tokenizer.json or GGUF vocabulary (through the `tokenizers`
library) and the byte tokenizer of the built-in "tiny" model. Both map text <-> token ids and
know the special ids."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as _HFTokenizer

from kvpool.errors import CheckpointError

BYTE_BOS = 256
BYTE_EOS = 257


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


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

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text, special tokens dropped."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255), plus BOS (256) and EOS (257)."""

    bos_token_id = BYTE_BOS
    eos_token_ids = (BYTE_EOS,)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text -> [BOS] + its UTF-8 bytes (no BOS when `add_special_tokens` is False)."""
        return [BYTE_BOS] * add_special_tokens + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes([i for i in ids if i < BYTE_BOS]).decode("utf-8", errors="replace")
