"""Byte sizes, dtype names and tables as people read and type them."""

import pytest
import torch

from kvpool.formats import (
    DTYPES,
    VISIBLE_CONTROLS,
    dtype_name,
    format_bytes,
    format_table,
    parse_bytes,
)

GiB = 2**30


# Byte sizes


@pytest.mark.parametrize(("text", "num_bytes"), [
    ("24GiB", 24 * GiB), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
    ("1048576", 1_048_576), ("24 gib", 24 * GiB), ("2KB", 2000), ("0.5KiB", 512),
    ("1TiB", 2**40), ("100B", 100),
])
def test_parse_bytes(text, num_bytes):
    assert parse_bytes(text) == num_bytes


@pytest.mark.parametrize("text", ["", "GiB", "24XB", "-1GiB", "1e9", "24 G iB"])
def test_parse_bytes_rejects_what_is_not_a_size(text):
    with pytest.raises(ValueError, match=f"bad size {text!r}: expected a number"):
        parse_bytes(text)


@pytest.mark.parametrize(("num_bytes", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (24 * GiB, "24.00 GiB"),
    (16_060_522_496, "14.96 GiB"), (-2 * GiB, "-2.00 GiB"),
])
def test_format_bytes_uses_the_largest_binary_unit(num_bytes, text):
    assert format_bytes(num_bytes) == text


# Dtype names


def test_dtype_names_round_trip():
    assert {name: dtype_name(dtype) for name, dtype in DTYPES.items()} == {
        "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
    assert DTYPES["bfloat16"] is torch.bfloat16


# Tables


def test_table_pads_the_labels_to_one_width():
    assert format_table([("pages", "12"), ("KV budget", "1.00 GiB")]) == (
        "pages      12\nKV budget  1.00 GiB")


# Text for the terminal


def test_c0_controls_and_del_show_as_their_pictures_but_tab_and_newline_pass():
    assert "a\x1b[2Jb\x00\x7f\t\n".translate(VISIBLE_CONTROLS) == "a\u241b[2Jb\u2400\u2421\t\n"


def test_c1_controls_show_as_escapes():
    assert "B\x9b2J C\x9d0;x\x9c \x80\x9f".translate(VISIBLE_CONTROLS) == \
        "B\\x9b2J C\\x9d0;x\\x9c \\x80\\x9f"


def test_bidirectional_embeddings_overrides_and_isolates_show_as_escapes():
    text = "".join(map(chr, [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]))
    assert text.translate(VISIBLE_CONTROLS) == ("\\u202a\\u202b\\u202c\\u202d\\u202e"
                                                "\\u2066\\u2067\\u2068\\u2069")


def test_the_characters_next_to_the_ranges_mapped_pass_unchanged():
    text = "Grüße ~ \u00a0\u2029\u2065\u206a 日本"
    assert text.translate(VISIBLE_CONTROLS) == text
