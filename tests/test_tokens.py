"""Packed token ids: how the prefix cache keeps them."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.cache import tokens
from kvpool.cache.tokens import (
    TOKEN_BYTES,
    TOKEN_MAX,
    TOKEN_MIN,
    pack_portable,
    pack_tokens,
    unpack_tokens,
)

needs_compiled = pytest.mark.skipif(tokens.pack_list is None,
                                    reason="the package was built without a C compiler")


@pytest.fixture(params=["compiled", "portable"])
def pack(request, monkeypatch):
    """pack_tokens as the package runs it, and with the compiled loop absent."""
    if request.param == "compiled" and tokens.pack_list is None:
        pytest.skip("the package was built without a C compiler")
    if request.param == "portable":
        monkeypatch.setattr(tokens, "pack_list", None)
    return pack_tokens


def test_pack_is_four_little_endian_bytes_per_token(pack):
    assert TOKEN_BYTES == 4
    assert pack([1, 258, -1]) == b"\x01\x00\x00\x00\x02\x01\x00\x00\xff\xff\xff\xff"
    assert pack([]) == b""


def test_unpack_inverts_pack_over_the_whole_int32_range():
    ids = (TOKEN_MIN, -1, 0, 1, 151_645, TOKEN_MAX)
    assert unpack_tokens(pack_tokens(ids)) == ids
    assert unpack_tokens(bytearray(pack_tokens(ids))) == ids


def test_a_page_of_ids_packs_to_equal_bytes_whatever_the_int_objects(pack):
    fresh = [int(str(x)) for x in range(1000, 1016)]  # new int objects, as a tokenizer returns
    assert pack(fresh) == pack(list(range(1000, 1016)))


@needs_compiled
@given(st.lists(st.integers(TOKEN_MIN, TOKEN_MAX), max_size=300))
def test_the_compiled_loop_packs_exactly_as_struct_does(ids):
    assert tokens.pack_list(ids) == pack_portable(ids) == pack_tokens(ids)


@needs_compiled
@pytest.mark.parametrize("ids", [[np.int64(7), 2], [2, np.int32(-3)]])
def test_ids_the_compiled_loop_does_not_take_are_packed_by_the_portable_path(ids):
    assert tokens.pack_list(ids) is None
    assert pack_tokens(ids) == pack_portable([int(x) for x in ids])


@needs_compiled
@pytest.mark.parametrize("ids", [[0, TOKEN_MAX + 1], [TOKEN_MIN - 1], [1, 2**70], [1, "a"],
                                 [True, 2]])
def test_the_compiled_loop_leaves_bad_ids_to_the_portable_path(ids):
    assert tokens.pack_list(ids) is None


def test_sequences_other_than_lists_pack_too():
    ids = [5, 1 << 20, -7]
    expected = pack_tokens(ids)
    assert pack_tokens(tuple(ids)) == pack_tokens(np.array(ids)) == expected
    assert pack_tokens(range(3)) == pack_tokens([0, 1, 2])


@pytest.mark.parametrize(("ids", "error", "message"), [
    ([1, 2, 3.0], TypeError, "token id 2 is float 3.0, expected an int"),
    (["a"], TypeError, "token id 0 is str 'a', expected an int"),
    ([7, True], TypeError, "token id 1 is bool True, expected an int"),  # True is not token 1
    ([0, TOKEN_MAX + 1], ValueError, r"token id 1 is 2147483648, outside int32 "
                                     r"\[-2147483648, 2147483647\]"),
    ([TOKEN_MIN - 1], ValueError, "token id 0 is -2147483649"),
])
def test_bad_ids_are_typed_errors_naming_the_position(pack, ids, error, message):
    with pytest.raises(error, match=message):
        pack(ids)
