"""Memory planning: how many KV pages, tokens and sequences fit on a device next to a model's
weights and activations, from the model's geometry (kvpool.planning.geometry) before any
weight is loaded.

`memory_fraction` means what it means in vLLM: the share of the device's total memory (a CUDA
device's, or the host's RAM) this model may use. The KV cache gets the whole pages of what
is left of it (MemoryPlan.budget_bytes), of which a hybrid model gives `mamba_memory_ratio`
to state slots first."""

from __future__ import annotations

import contextlib
import os
import reprlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvpool.devices import check_device
from kvpool.formats import check_model_dtype, exact_bytes, format_bytes
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import RESERVED_PAGES, pages_within
from kvpool.memory.state_pool import RESERVED_SLOTS, MambaLayout, slots_within
from kvpool.numeric import check_int64
from kvpool.planning.geometry import ModelGeometry
from kvpool.planning.group_plan import GroupPlan, pages_held, split_budget

# The forward whose activations a plan sets aside unless given activation_bytes
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256
_MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """How a model and its paged KV cache share memory (sizes in bytes).

    budget_bytes = int(device_memory * memory_fraction) - in_use_bytes - weight_bytes
    - activation_bytes - reserved_bytes (negative when the model alone does not fit). When not
    one page (or, for a hybrid, one state slot) fits, `reason` says why. `num_pages` counts
    pages of every layer, as one pool holds them; a model mixing full and windowed layers
    splits their bytes between the pools of `groups`, and `kv_bytes`, `max_tokens` and
    `max_sequences` are then the pools'."""

    layout: KVLayout
    num_parameters: int
    weight_bytes: int
    activation_bytes: int
    reserved_bytes: int  # the caller's other needs, e.g. the engine's workspace and CUDA graphs
    device: str | None  # where device_memory was read; None when the caller gave it
    device_memory: int  # the given figure, or the device's total (a CUDA device, host RAM)
    in_use_bytes: int  # what is not free on the device when planned; 0 for a given figure
    memory_fraction: float
    budget_bytes: int
    num_pages: int
    reason: str | None = None
    mamba_layout: MambaLayout | None = None  # None for attention-only models
    num_state_slots: int = 0
    mamba_memory_ratio: float = 0.0  # the share of budget_bytes given to state slots
    groups: tuple[GroupPlan, ...] = ()  # the full and window pools of a mixed model
    window: int | None = None  # every layer windowed and pages given back: the widest window
    tensor_parallel_size: int = 1  # > 1: the plan of one rank of that many (weights, layout)

    @property
    def state_bytes(self) -> int:
        """Bytes of the state pool, its reserved slot included (0 without slots)."""
        if not self.num_state_slots:
            return 0
        return (self.num_state_slots + RESERVED_SLOTS) * self.mamba_layout.bytes_per_slot

    @property
    def usable_bytes(self) -> int:
        """The share of the device memory this model may use: memory_fraction of it."""
        return usable_bytes(self.device_memory, self.memory_fraction)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV pool (or the groups' pools), reserved pages included; 0 without
        pages."""
        if self.groups:
            return sum(group.nbytes for group in self.groups)
        if not self.num_pages:
            return 0
        return (self.num_pages + RESERVED_PAGES) * self.layout.bytes_per_page

    @property
    def max_tokens(self) -> int:
        """Token slots in the KV pool (for a pair, in the full-attention pool, where every token
        of a sequence has a slot)."""
        if self.groups:
            return self.groups[0].max_tokens
        return self.num_pages * self.layout.page_size

    def max_sequences(self, context_len: int) -> int:
        """How many sequences of `context_len` tokens fit at once: in whole pages of every pool
        (`pages_per_sequence`) and, for a hybrid, each with a state slot."""
        by_pages = self.num_pages // self.pages_per_sequence(context_len)
        if self.groups:
            by_pages = min(group.num_pages // group.pages_per_sequence(context_len)
                           for group in self.groups)
        return min(by_pages, self.num_state_slots) if self.mamba_layout else by_pages

    def pages_per_sequence(self, context_len: int) -> int:
        """Pages of the one pool a decoding sequence of `context_len` tokens holds: all of
        them, or a window and a page when every layer is windowed and pages go back."""
        check_int64("context_len", context_len, 1)  # positions are int64 on the device
        return pages_held(context_len, self.window, self.layout.page_size)

    def max_checkpoints(self, context_len: int) -> int:
        """State slots left for the prefix cache's checkpoints while `max_sequences` run."""
        return self.num_state_slots - self.max_sequences(context_len) if self.mamba_layout else 0


def usable_bytes(device_memory: int, memory_fraction: float) -> int:
    """`memory_fraction` of `device_memory`, never more than all of it (a float product of
    a number past 2**53 may round up)."""
    return min(device_memory, int(device_memory * memory_fraction))


def plan_memory(
    model: ModelGeometry,
    device_memory: int | None = None,
    *,
    memory_fraction: float = 0.9,
    page_size: int = 16,
    dtype: torch.dtype | None = None,
    activation_bytes: int | None = None,
    reserved_bytes: int = 0,
    device: str | torch.device | None = None,
    mamba_memory_ratio: float = 0.5,
    num_state_slots: int | None = None,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    free_out_of_window: bool = True,
    max_num_seqs: int = 64,
    max_model_len: int | None = None,
) -> MemoryPlan:
    """Plan the KV pool of `model` (a geometry: a `ModelConfig`) before loading it.
    `device_memory` (bytes) is the memory to plan in; None reads the total and in-use memory
    of `device`. `dtype` None: the model's, for the weights and (unless `kv_cache_dtype` is
    "fp8_e4m3") the pages. `activation_bytes` None: the model's estimate for a forward of
    DEFAULT_MAX_NUM_BATCHED_TOKENS tokens of DEFAULT_MAX_NUM_SEQS sequences.
    `mamba_memory_ratio` in (0, 1): a hybrid's share of the budget for state slots, unless
    `num_state_slots` gives their count (the engine's: `max_num_seqs` seats and, with prefix
    caching, as many checkpoint slots), taken out of the budget before the pages.
    `max_model_len`: the longest sequence, in tokens (None: max_position_embeddings); a window
    no such sequence passes is full attention, as the engine keeps it. A model mixing full and
    windowed layers gets window pools unless not `free_out_of_window`, sized for `max_num_seqs`
    windows and one prompt of `max_model_len` tokens.
    `tensor_parallel_size` N plans one rank of N: its part of the split weights and the
    whole of those every rank holds (norms, routers, MLA's latent projections, row-parallel
    biases, KV heads fewer than the ranks), its share of the KV heads and Mamba state, in
    `device_memory` of its own (read from `device`: a GPU of its own, or on the CPU 1/N of
    the host's memory, which the N rank processes share)."""
    if not isinstance(model, ModelGeometry):
        raise TypeError(f"plan_memory takes a model geometry, got {type(model).__name__} "
                        f"{reprlib.repr(model)}; parse a preset, config.json, checkpoint folder "
                        f"or config dict first: plan_memory(ModelConfig.from_hf(source), ...) "
                        f"(kvpool.models.config)")
    if device_memory is not None:
        check_int64("device_memory", device_memory, 1)
    if activation_bytes is not None:
        check_int64("activation_bytes", activation_bytes, 0)
    check_int64("reserved_bytes", reserved_bytes, 0)
    check_int64("max_num_seqs", max_num_seqs, 1)
    check_model_dtype(dtype)
    if max_model_len is None:
        max_model_len = model.max_position_embeddings
    check_int64("max_model_len", max_model_len, 1)
    if max_model_len > model.max_position_embeddings:  # as the engine refuses it
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {model.max_position_embeddings}")
    if not isinstance(free_out_of_window, bool):
        raise TypeError(f"free_out_of_window must be a bool, got "
                        f"{type(free_out_of_window).__name__} {free_out_of_window!r}")
    _check_share("memory_fraction", memory_fraction, "(0, 1]")
    _check_share("mamba_memory_ratio", mamba_memory_ratio, "(0, 1)")
    layout = model.kv_layout(dtype=dtype, page_size=page_size, kv_cache_dtype=kv_cache_dtype,
                             max_model_len=max_model_len).per_rank(tensor_parallel_size)
    weights_dtype = model.weights_dtype(dtype)
    rank_parameters = model.count_parameters(tensor_parallel_size)
    rank_float32 = model.count_float32_parameters(tensor_parallel_size)
    weight_bytes = (rank_parameters - rank_float32) * weights_dtype.itemsize + rank_float32 * 4
    if activation_bytes is None:
        activation_bytes = model.estimate_activation_bytes(
            weights_dtype, max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=DEFAULT_MAX_NUM_SEQS)
    device_name, device_memory, in_use_bytes = _memory(device_memory, device,
                                                       tensor_parallel_size)
    usable = usable_bytes(device_memory, memory_fraction)
    budget = usable - in_use_bytes - weight_bytes - activation_bytes - reserved_bytes
    mamba = model.mamba_layout(dtype=dtype, tensor_parallel_size=tensor_parallel_size)
    ratio = mamba_memory_ratio if mamba and num_state_slots is None else 0.0
    if num_state_slots is not None:
        num_slots = check_int64("num_state_slots", num_state_slots, 1) * (mamba is not None)
    else:
        num_slots = slots_within(mamba, int(max(budget, 0) * ratio)) if mamba else 0
    plan = MemoryPlan(
        layout, model.count_parameters(), weight_bytes, activation_bytes, reserved_bytes,
        device_name, device_memory, in_use_bytes, memory_fraction, budget, num_pages=0,
        mamba_layout=mamba, num_state_slots=num_slots, mamba_memory_ratio=ratio,
        tensor_parallel_size=tensor_parallel_size,
    )
    plan = replace(plan, num_pages=pages_within(layout, budget - plan.state_bytes))
    windows = layout.layer_windows
    if free_out_of_window and windows and None not in windows:  # as KVCache gives pages back
        plan = replace(plan, window=max(windows))
    if free_out_of_window and len(layout.groups) > 1 and plan.num_pages:
        plan = replace(plan, groups=split_budget(
            layout, plan.num_pages * layout.bytes_per_page, max_num_seqs=max_num_seqs,
            prefill_tokens=max_model_len))
    if plan.num_pages and (mamba is None or num_slots):
        return plan
    return replace(plan, reason=_reason(plan))


def _reason(plan: MemoryPlan) -> str:
    """Why a plan has no pages (or, for a hybrid, no state slot), naming the sizes."""
    if plan.budget_bytes >= 0 and plan.mamba_layout and not plan.num_state_slots:
        return (f"{plan.mamba_memory_ratio * 100:g}% of the {exact_bytes(plan.budget_bytes)} "
                f"left for the cache is less than one state slot of "
                f"{exact_bytes(plan.mamba_layout.bytes_per_slot)} and the reserved one")
    if plan.budget_bytes >= 0:
        slots = (f" after {plan.num_state_slots} state slots of "
                 f"{exact_bytes(plan.state_bytes)}" if plan.state_bytes else "")
        page = plan.layout.bytes_per_page
        return (f"the {exact_bytes(plan.budget_bytes - plan.state_bytes)} left for the KV "
                f"cache{slots} is less than one page of {exact_bytes(page)} and the pool's "
                f"reserved one: {exact_bytes((1 + RESERVED_PAGES) * page)}")
    parts = [f"weights {format_bytes(plan.weight_bytes)}",
             f"activations {format_bytes(plan.activation_bytes)}"]
    if plan.reserved_bytes:
        parts.append(f"reserved {format_bytes(plan.reserved_bytes)}")
    if plan.in_use_bytes:
        parts.append(f"{format_bytes(plan.in_use_bytes)} already in use")
    return (f"{' + '.join(parts)} exceed {plan.memory_fraction * 100:g}% of "
            f"{format_bytes(plan.device_memory)} ({format_bytes(plan.usable_bytes)})")


def _memory(device_memory: int | None, device: str | torch.device | None, ranks: int = 1
            ) -> tuple[str | None, int, int]:
    """(device name, memory, bytes already in use): the given memory on no device, else the
    device's total memory and what is not free on it (a CUDA device, or the host's RAM, of
    which each of `ranks` processes sharing it gets an equal share)."""
    if device_memory is not None:
        return None, device_memory, 0
    if device is None:
        raise ValueError("plan_memory needs device_memory (bytes) or the device to read it "
                         "from (e.g. device='cpu' or 'cuda')")
    device = check_device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        index = torch.cuda.current_device() if device.index is None else device.index
        # blocks torch's allocator keeps for this process with no tensor in them are free to it
        allocated = torch.cuda.memory_allocated(index)
        free += torch.cuda.memory_reserved(index) - allocated
        # torch may cap this process at a share of the device (torch >= 2.9 reports it)
        share = (torch.cuda.get_per_process_memory_fraction(index)
                 if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0)
        if share < 1:
            total = int(total * share)
            free = max(min(free, total - allocated), 0)
    elif device.type == "cpu":
        total, free = (size // ranks for size in host_memory())
    else:
        raise ValueError(f"cannot read the memory of device {str(device)!r}; "
                         f"pass device_memory")
    return str(device), total, total - free


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of this machine's RAM, available meaning without swapping:
    MemTotal and MemAvailable from /proc/meminfo, else the physical and free pages the OS
    reports."""
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        lines = _MEMINFO.read_text().splitlines()  # "MemTotal:       33554432 kB"
        kib = dict(line.split(":", 1) for line in lines if ":" in line)
        return int(kib["MemTotal"].split()[0]) * 1024, int(kib["MemAvailable"].split()[0]) * 1024
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (AttributeError, ValueError, OSError):
        raise ValueError("cannot read this machine's memory; pass device_memory") from None


def _check_share(name: str, value: object, interval: str) -> None:
    """TypeError unless `value` is a number, ValueError unless it lies in `interval`: "(0, 1]"
    or "(0, 1)"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in {interval}, got {value!r}")
    if not (0 < value < 1 or (value == 1 and interval.endswith("]"))):
        raise ValueError(f"{name} must be in {interval}, got {value}")
