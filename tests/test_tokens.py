"""Packed token ids: how the prefix cache keeps them."""

import pytest

from kvpool.tokens import TOKEN_BYTES, TOKEN_MAX, TOKEN_MIN, pack_tokens, unpack_tokens


def test_pack_is_four_little_endian_bytes_per_token():
    assert TOKEN_BYTES == 4
    assert pack_tokens([1, 258, -1]) == b"\x01\x00\x00\x00\x02\x01\x00\x00\xff\xff\xff\xff"
    assert pack_tokens([]) == b""


def test_unpack_inverts_pack_over_the_whole_int32_range():
    ids = (TOKEN_MIN, -1, 0, 1, 151_645, TOKEN_MAX)
    assert unpack_tokens(pack_tokens(ids)) == ids
    assert unpack_tokens(bytearray(pack_tokens(ids))) == ids


def test_a_page_of_ids_packs_to_equal_bytes_whatever_the_int_objects():
    fresh = [int(str(x)) for x in range(1000, 1016)]  # new int objects, as a tokenizer returns
    assert pack_tokens(fresh) == pack_tokens(list(range(1000, 1016)))


@pytest.mark.parametrize(("ids", "error", "message"), [
    ([1, 2, 3.0], TypeError, "token id 2 is float 3.0, expected an int"),
    (["a"], TypeError, "token id 0 is str 'a', expected an int"),
    ([0, TOKEN_MAX + 1], ValueError, r"token id 1 is 2147483648, outside int32 "
                                     r"\[-2147483648, 2147483647\]"),
    ([TOKEN_MIN - 1], ValueError, "token id 0 is -2147483649"),
])
def test_bad_ids_are_typed_errors_naming_the_position(ids, error, message):
    with pytest.raises(error, match=message):
        pack_tokens(ids)
