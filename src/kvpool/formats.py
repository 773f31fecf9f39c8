"""The forms people read and type for kvpool's figures: byte sizes ("24GiB", "14.96 GiB"),
dtype names ("bfloat16") and two-column tables."""

from __future__ import annotations

import re
from decimal import Decimal

import torch

# The dtypes a model's weights and KV cache may have, by the name config.json and --dtype use.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# What a terminal acts on rather than shows, in visible forms (a str.translate table), so that
# a random model cannot send escape sequences to the terminal nor reorder what it shows: the C0
# controls (but tab and newline) and DEL as their Unicode pictures; the C1 controls (U+009B is
# CSI, U+009D OSC to a terminal that reads them in UTF-8) and the bidirectional embeddings,
# overrides and isolates as Python escapes, e.g. "\x9b", "\u202e".
_ESCAPED = (*range(0x80, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A))
VISIBLE_CONTROLS = ({c: 0x2400 + c for c in range(32) if chr(c) not in "\t\n"} | {127: 0x2421}
                    | {c: chr(c).encode("unicode_escape").decode() for c in _ESCAPED})
_BYTE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_bytes(text: str) -> int:
    """Bytes in a size such as "24GiB", "512 MiB", "1.5GB" or "1048576": GB means 10**9 bytes,
    GiB 2**30; units are case-insensitive; a fraction of a byte is dropped."""
    match = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = _BYTE_UNITS.get(match[2].upper() or "B") if match else None
    if unit is None:
        units = ", ".join(u.replace("I", "i") for u in _BYTE_UNITS)
        raise ValueError(f"bad size {text!r}: expected a number with an optional unit "
                         f"({units}), e.g. 24GiB")
    return int(Decimal(match[1]) * unit)


def format_bytes(num_bytes: int) -> str:
    """`num_bytes` in the largest binary unit it reaches, e.g. "14.96 GiB" or "512 B"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"


def exact_bytes(num_bytes: int) -> str:
    """`num_bytes` counted, then rounded as `format_bytes` rounds, e.g. "4,095 B (4.00 KiB)"
    (for messages that compare sizes, which rounding can make look equal)."""
    rounded = format_bytes(num_bytes)
    return f"{num_bytes:,} B" if rounded == f"{num_bytes} B" else f"{num_bytes:,} B ({rounded})"


def check_model_dtype(dtype: object) -> None:
    """TypeError unless `dtype` is None or a torch.dtype; ValueError unless it is one that
    kvpool's models compute in (DTYPES)."""
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__} "
                        f"{dtype!r}")
    if dtype not in DTYPES.values():
        names = ", ".join(f"torch.{name}" for name in DTYPES)
        raise ValueError(f"dtype {dtype} is not one kvpool's models compute in ({names})")


def dtype_name(dtype: torch.dtype) -> str:
    """The name of `dtype` as DTYPES spells it, e.g. "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def format_table(rows: list[tuple[str, str]]) -> str:
    """Rows as two columns, the labels padded to one width."""
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
