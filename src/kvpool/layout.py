"""KV-cache geometry (bytes per token and per page) and memory planning: how many pages,
tokens and sequences fit on a device next to a model's weights and activations."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path

import torch

from kvpool.config import ModelConfig

ModelSource = ModelConfig | dict | str | Path  # a config dict, config.json, folder or preset

CONFIG_DEFAULT_DTYPE = torch.float32  # for configs that state no dtype, as the loader does
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256
_MEMINFO = Path("/proc/meminfo")
_BYTE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of the paged KV cache: for every token, K and V of `num_kv_heads` heads of
    `head_dim` elements of `dtype` in each of `num_layers` layers; pages of `page_size` tokens."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            _check_int(name, getattr(self, name), minimum=1)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {self.dtype!r}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page: `page_size` tokens."""
        return self.page_size * self.bytes_per_token

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens (a partly filled last page counts whole)."""
        _check_int("num_tokens", num_tokens, minimum=0)
        return -(-num_tokens // self.page_size)

    @classmethod
    def from_hf_config(
        cls, config: ModelSource, *, dtype: torch.dtype | None = None, page_size: int = 16
    ) -> KVLayout:
        """The KV layout of a model, from its config (dict, config.json path, checkpoint folder,
        preset name or ModelConfig). The dtype is `dtype` if given, else the config's (`dtype`,
        or `torch_dtype` before transformers 5), else float32 (as `load_model` does)."""
        model = _model_config(config)
        dtype = dtype if dtype is not None else model.dtype or CONFIG_DEFAULT_DTYPE
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, dtype, page_size)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """How a model and its paged KV cache share memory (all sizes in bytes).

    budget_bytes = int(device_memory * memory_fraction) - in_use_bytes - weight_bytes
    - activation_bytes (negative when the model alone does not fit); the KV cache gets the
    whole pages that fit in it. When not one page fits, num_pages is 0 and `reason` says why."""

    layout: KVLayout
    num_parameters: int
    weight_bytes: int
    activation_bytes: int
    device: str | None  # where device_memory was read; None when the caller gave it
    device_memory: int  # the given figure, a CUDA device's total, or the host's available RAM
    in_use_bytes: int  # CUDA only: memory other processes already hold
    memory_fraction: float
    budget_bytes: int
    num_pages: int
    reason: str | None = None

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.layout.page_size

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token (K and V, all layers)."""
        return self.layout.bytes_per_token

    @property
    def bytes_per_page(self) -> int:
        """KV bytes of one page."""
        return self.layout.bytes_per_page

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV pool: `num_pages` pages."""
        return self.num_pages * self.bytes_per_page

    @property
    def max_tokens(self) -> int:
        """Token slots in the KV pool."""
        return self.num_pages * self.page_size

    def max_sequences(self, context_len: int) -> int:
        """How many sequences of `context_len` tokens fit at once, each in whole pages."""
        _check_int("context_len", context_len, minimum=1)
        return self.num_pages // self.layout.num_pages_for(context_len)


def plan_memory(
    config: ModelSource,
    device_memory: int | None = None,
    *,
    memory_fraction: float = 0.9,
    page_size: int = 16,
    dtype: torch.dtype | None = None,
    activation_bytes: int | None = None,
    device: str | torch.device | None = None,
) -> MemoryPlan:
    """Plan the KV pool of a model: the pages left in `memory_fraction` of the memory after the
    weights and activations. `device_memory` (bytes) is the memory this model may use; None reads
    `device` (default CUDA if available, else CPU): on CUDA the fraction is of the total and what
    other processes hold is subtracted too; on CPU it is of the available RAM. Call it before
    loading the weights. `activation_bytes` None: `estimate_activation_bytes` with its defaults."""
    if device_memory is not None:
        _check_int("device_memory", device_memory, minimum=1)
    if activation_bytes is not None:
        _check_int("activation_bytes", activation_bytes, minimum=0)
    _check_fraction(memory_fraction)
    model = _model_config(config)
    layout = KVLayout.from_hf_config(model, dtype=dtype, page_size=page_size)
    num_parameters = count_parameters(model)
    weight_bytes = num_parameters * layout.dtype.itemsize
    if activation_bytes is None:
        activation_bytes = estimate_activation_bytes(model, layout.dtype)
    device_name, device_memory, in_use_bytes = _memory(device_memory, device)
    usable = int(device_memory * memory_fraction)
    budget = usable - in_use_bytes - weight_bytes - activation_bytes
    plan = MemoryPlan(
        layout, num_parameters, weight_bytes, activation_bytes, device_name, device_memory,
        in_use_bytes, memory_fraction, budget, num_pages=max(budget, 0) // layout.bytes_per_page,
    )
    return plan if plan.num_pages else replace(plan, reason=_reason(plan, usable))


def count_parameters(model: ModelConfig) -> int:
    """Exact parameter count of a Llama-family decoder: embeddings, per layer attention
    (q, k, v, o and their biases, Qwen3's q/k norms), gated MLP and two RMSNorms, the final
    norm, and the lm_head unless tied to the embeddings."""
    hidden, head_dim = model.hidden_size, model.head_dim
    q, kv = model.num_heads * head_dim, model.num_kv_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    if model.qkv_bias:
        attention += q + 2 * kv
    if model.o_bias:
        attention += hidden
    if model.qk_norm:
        attention += 2 * head_dim
    mlp = 3 * hidden * model.intermediate_size
    if model.mlp_bias:
        mlp += 2 * model.intermediate_size + hidden
    layer = attention + mlp + 2 * hidden
    embeddings = model.vocab_size * hidden
    lm_head = 0 if model.tie_word_embeddings else model.vocab_size * hidden
    return embeddings + model.num_layers * layer + hidden + lm_head


def estimate_activation_bytes(
    model: ModelConfig,
    dtype: torch.dtype,
    *,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> int:
    """Rough peak activation bytes of one forward over `max_num_batched_tokens` tokens. Layers
    run one at a time, so per token: the residual stream and its normed copy (2 x hidden) plus
    the larger of attention (q, k, v and its output) and the MLP (gate, up and their product,
    3 x intermediate), in `dtype`; plus float32 logits of the last token of up to `max_num_seqs`
    sequences. Not covered: attention scores of unfused kernels, CUDA graphs, fragmentation."""
    _check_int("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
    _check_int("max_num_seqs", max_num_seqs, minimum=1)
    attention = 2 * (model.num_heads + model.num_kv_heads) * model.head_dim
    mlp = 3 * model.intermediate_size
    per_token = (2 * model.hidden_size + max(attention, mlp)) * dtype.itemsize
    num_logits = min(max_num_seqs, max_num_batched_tokens)
    return max_num_batched_tokens * per_token + num_logits * model.vocab_size * 4


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


def _reason(plan: MemoryPlan, usable: int) -> str:
    """Why a plan has no pages, naming the sizes; `usable` is the fraction of the memory."""
    if plan.budget_bytes >= 0:
        return (f"the {format_bytes(plan.budget_bytes)} left for the KV cache is less than "
                f"one page ({format_bytes(plan.bytes_per_page)})")
    parts = [f"weights {format_bytes(plan.weight_bytes)}",
             f"activations {format_bytes(plan.activation_bytes)}"]
    if plan.in_use_bytes:
        parts.append(f"{format_bytes(plan.in_use_bytes)} in use by other processes")
    return (f"{' + '.join(parts)} exceed {plan.memory_fraction * 100:g}% of "
            f"{format_bytes(plan.device_memory)} ({format_bytes(usable)})")


def _model_config(config: ModelSource) -> ModelConfig:
    return config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)


def _memory(
    device_memory: int | None, device: str | torch.device | None
) -> tuple[str | None, int, int]:
    """(device name, memory, bytes in use by others): the given memory on no device, else a
    CUDA device's total and what is not free on it, or the host's available RAM and 0."""
    if device_memory is not None:
        return None, device_memory, 0
    device = _device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return str(device), total, total - free
    if device.type == "cpu":
        return str(device), _available_ram(), 0
    raise ValueError(f"cannot read the memory of device {str(device)!r}; pass device_memory")


def _device(device: str | torch.device | None) -> torch.device:
    """`device` parsed; None means CUDA if available, else CPU."""
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        msg = f"bad device {device!r}: expected e.g. 'cpu', 'cuda' or 'cuda:1'"
        raise ValueError(msg) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"cannot read the memory of {str(device)!r}: CUDA is not available")
    return device


def _available_ram() -> int:
    """Bytes of RAM this process could get without swapping: MemAvailable from /proc/meminfo,
    or where there is none, the free pages the OS reports (which omits reclaimable caches)."""
    with contextlib.suppress(OSError):
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        msg = "cannot read this machine's available memory; pass device_memory"
        raise ValueError(msg) from None


def _check_int(name: str, value: object, *, minimum: int) -> None:
    """Raise TypeError unless `value` is an int (not a bool), ValueError if below `minimum`."""
    expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be {expected}, got {value}")


def _check_fraction(memory_fraction: object) -> None:
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)):
        raise TypeError(f"memory_fraction must be a number in (0, 1], got {memory_fraction!r}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
