"""Devices are explicit: every pool, state pool, workspace and model lives on the device its
caller names. Only the user-facing entry points (`LLM`, the CLI) choose one for the user
(`kvpool.engine.config.engine_device`); below them `check_device` is the one check."""

from __future__ import annotations

import contextlib

import torch


def check_device(device: object) -> torch.device:
    """`device` (a torch.device or a name: "cpu", "cuda", "cuda:1") as a torch.device. None,
    a bad name and a CUDA device this machine lacks raise ValueError saying what was expected,
    instead of failing inside torch (or on another device than meant)."""
    if device is None:
        raise ValueError("device must be given (e.g. 'cpu' or 'cuda'): there is no default "
                         "device below LLM and the CLI")
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be a torch.device or a name such as 'cpu' or 'cuda', "
                         f"got {type(device).__name__} {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} needs CUDA, and this machine has no CUDA "
                             f"device (torch {torch.__version__}); use device='cpu'")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {str(device)!r} does not exist: this machine has "
                             f"{count} CUDA device(s)")
    return device


def made_current(device: torch.device) -> contextlib.AbstractContextManager:
    """Within the block, `device` is the current CUDA device: streams, events, graph captures
    and Triton launches follow the current device, not their tensors', so an engine on
    cuda:1 runs its steps under this. Nothing for another device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
