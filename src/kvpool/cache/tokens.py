"""Token ids as the prefix cache keeps them: packed little-endian int32, 4 bytes a token.

A list of ids costs a 28-byte int object and an 8-byte pointer per token, and every full
garbage collection walks it; a cache of a million pages would hold half a gigabyte of them.
Packed, a page's ids are one bytes object: 64 bytes at page size 16, hashed and compared
(memcmp) in one step, freed in one step, and never walked by the collector.

Packing is the largest single cost of a prefix hit, so a list of plain ints is packed by a
small C loop (`_tokens.c`, built with the package when a C compiler is there). Everything
else, and every list when it is not built, takes the portable path through `struct`; both
give the same bytes."""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from functools import lru_cache

try:
    from kvpool.cache._tokens import pack_list
except ImportError:  # built without a C compiler
    pack_list = None

TOKEN_BYTES = 4
TOKEN_MIN, TOKEN_MAX = -(2**31), 2**31 - 1


@lru_cache(maxsize=512)
def _codec(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}i")


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """`token_ids` packed, `TOKEN_BYTES` per token. Raises TypeError for an id that is not
    an int and ValueError for one outside int32, naming its position."""
    if type(token_ids) is list and pack_list is not None:
        packed = pack_list(token_ids)  # None unless every id is a plain int in int32
        if packed is not None:
            return packed
    return pack_portable(token_ids)


def pack_portable(token_ids: Sequence[int]) -> bytes:
    """`pack_tokens` without the compiled loop: any sequence of objects with `__index__`,
    bools excepted (True is not token 1)."""
    if bool in map(type, token_ids):
        raise _bad_token(token_ids)
    try:
        return _codec(len(token_ids)).pack(*token_ids)
    except struct.error:
        raise _bad_token(token_ids) from None


def unpack_tokens(data: bytes | bytearray) -> tuple[int, ...]:
    """The token ids packed in `data`."""
    return _codec(len(data) // TOKEN_BYTES).unpack(data)


def _bad_token(token_ids: Sequence[int]) -> Exception:
    """The error for the first id of `token_ids` that cannot be packed."""
    for i, token in enumerate(token_ids):
        try:
            if type(token) is bool:
                raise TypeError
            value = operator.index(token)
        except TypeError:
            return TypeError(f"token id {i} is {type(token).__name__} {token!r}, expected an int")
        if not TOKEN_MIN <= value <= TOKEN_MAX:
            return ValueError(f"token id {i} is {value}, outside int32 "
                              f"[{TOKEN_MIN}, {TOKEN_MAX}]")
    return ValueError(f"token_ids has len {len(token_ids)} but yields another number of ids")
