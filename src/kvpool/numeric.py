"""Numbers as the device holds them: the one check of a numeric parameter that ends up in a
float32 or int64 tensor. A value that is fine as a Python number can overflow to inf, flush
to 0 or wrap around there; these checks refuse it first, naming the parameter and the value.
SamplingParams, the server's request parsing, the model configs, fp8 scales and the CLI all
use them. `int_tensor` puts Python ints in a host tensor, the way every step's metadata
reaches the device."""

from __future__ import annotations

import math
from array import array

import torch

from kvpool.errors import check_int

INT64_MAX = 2**63 - 1
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # 3.4028e38
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # 1.1755e-38, the least normal float32


def check_int64(name: str, value: object, low: int, high: int = INT64_MAX) -> int:
    """`value` if it is an int in `[low, min(high, INT64_MAX)]`; TypeError for another type,
    ValueError out of range, naming `name` and the value."""
    return check_int(name, value, low, min(high, INT64_MAX))


def check_float32(name: str, value: object, *, low: float = -FLOAT32_MAX,
                  high: float = FLOAT32_MAX, open_low: bool = False,
                  normal: bool = False) -> float:
    """`value` as a float if it is a real number, finite in float32, in `[low, high]` (or
    `(low, high]` with `open_low`); with `normal` also a normal float32 (at least
    FLOAT32_TINY in magnitude: smaller ones lose precision or flush to 0 on the device).
    TypeError for another type, ValueError otherwise, naming `name` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value) if abs(value) <= FLOAT32_MAX * 2 else math.inf
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
        raise ValueError(f"{name} must be finite as a float32 (at most {FLOAT32_MAX:.4g} in "
                         f"magnitude), got {value!r}")
    if number < low or number > high or (open_low and number == low):
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}")
    if normal and abs(number) < FLOAT32_TINY:
        raise ValueError(f"{name} must be a normal float32 (at least {FLOAT32_TINY:.4g} in "
                         f"magnitude), got {value!r}")
    return number


MAX_SECONDS = 365 * 24 * 3600.0  # the longest timeout the process groups' clocks take


def check_seconds(name: str, value: object, least: float | None = None) -> float:
    """`value` as a float if it is a number of seconds in (0, MAX_SECONDS] (a year: an
    infinite or huge timeout overflows torch.distributed's), or in [least, MAX_SECONDS];
    TypeError for another type, ValueError otherwise, naming `name` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} "
                        f"{value!r}")
    above_least = value > 0 if least is None else value >= least
    if not above_least or not value <= MAX_SECONDS:
        low = "(0" if least is None else f"[{least:g}"
        raise ValueError(f"{name} must be a number of seconds in {low}, {MAX_SECONDS:.0f}] "
                         f"(a year), got {value!r}")
    return float(value)


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def int_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D CPU tensor of a list of Python ints (int32 or int64), built through an `array`:
    torch.tensor takes several times longer, which a decode step pays
    for every section it stages (benchmarks/host_step.py). OverflowError for a value out of
    the dtype's range."""
    packed = array(_ARRAY_CODES[dtype], values)
    if not packed:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(packed, dtype=dtype)
