"""The --tensor-parallel-size flag of `kvpool bench`, `generate`, `chat`, `serve` and `plan`:
split the model across N ranks, one per device (LLM's tensor_parallel_size)."""

from __future__ import annotations

import argparse


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size N (default 1)."""
    parser.add_argument("--tensor-parallel-size", type=_ranks, default=1, metavar="N",
                        help="split the model across N ranks, one per device (N GPUs, or N "
                             "processes on the CPU); the pool and its plan are per rank "
                             "(default: 1)")


def _ranks(text: str) -> int:
    """A rank count: an int >= 1 (argparse reports the error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value
