"""EngineConfig: the options of `LLM`, validated, and how the pool size is planned."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from kvpool.devices import check_device
from kvpool.engine.params import SEED_LIMIT
from kvpool.errors import OutOfPages
from kvpool.formats import check_model_dtype, exact_bytes
from kvpool.kernels import MAX_DECODE_SPLITS, decode_scratch_bytes
from kvpool.memory.fp8 import KV_CACHE_DTYPES, check_scale
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import RESERVED_PAGES, pages_within
from kvpool.memory.workspace import ALIGNMENT
from kvpool.models.config import ModelConfig
from kvpool.numeric import check_int64, check_seconds
from kvpool.planning.planner import MemoryPlan, plan_memory

GiB = 2**30
DEFAULT_KV_CACHE_MEMORY = 4 * GiB
DEFAULT_DISK_TIER_MEMORY = 16 * GiB
TIER_OPTIONS = ("host_tier_memory", "disk_tier", "redis_tier")


def engine_device(device: str | torch.device | None) -> torch.device:
    """The device an engine (LLM, the CLI) runs on: `device` checked, or for None CUDA when
    present, else the CPU. The one place that picks a device for the user: everything below
    takes the device it is given."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return check_device(device)


def kv_budget(plan: MemoryPlan, device: torch.device, kv_cache_memory: int) -> int:
    """Bytes the plan leaves for an engine's KV cache on `device`: on the CPU at most
    `kv_cache_memory`, as the host's RAM serves everything else too."""
    if device.type == "cpu":
        return min(kv_cache_memory, plan.budget_bytes)
    return plan.budget_bytes


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Keyword options of `LLM` (vLLM's names).

    num_pages None plans the pool from the model's config before the weights load
    (`kvpool.planning.planner`): `memory_fraction` of the device's total memory (a CUDA device's, or
    the host's RAM) is this engine's share; what is already in use on the device, the
    weights, the activations, the workspace and (on CUDA) the CUDA graphs come out of it, and
    the KV cache gets the rest; on the CPU at most `kv_cache_memory` bytes of it.
    max_model_len None: the model's
    max_position_embeddings. dtype None: the checkpoint's. device None: CUDA when present,
    else the CPU (`engine_device`). kv_cache_dtype "auto" stores KV
    pages in the model's dtype, "fp8_e4m3" in float8_e4m3fn (half the bytes of 16-bit pages)
    with one K and one V scale per layer (one latent scale for an MLA model's latent pages):
    `kv_scales` (k_scale, v_scale) for every layer (MLA: one number), or None to take each
    layer's from the first prefill (kvpool.memory.fp8). seed seeds the sampling of
    requests that have no seed of their own. overlap: schedule each step while the device
    runs the one before (kvpool.engine.overlap); None: on CUDA, not on the CPU, where the
    forward runs on the host and nothing overlaps. mamba_checkpoint_slots (hybrid models with
    prefix caching): the state slots kept for checkpoints, None: max_num_seqs.
    free_out_of_window: give back the pages that fall out of a sliding window as sequences
    grow: in the one pool when every layer is windowed (Mistral, kvpool.cache), in a window
    pool beside a full pool when layers mix (Gemma 3, Qwen with layer_types:
    a KVCache of a full and a window group); False keeps every page of every layer in one pool.
    A tier keeps the prefix pages the pool evicts, to load them back for a later prompt
    instead of recomputing (needs prefix_caching; one tier per engine):
    `host_tier_memory` bytes of host memory, `disk_tier` a directory holding at most
    `disk_tier_memory` bytes of pages, or `redis_tier` the URL of a Redis server that engines
    of the same model in other processes share (bounded by the server's maxmemory).
    `tensor_parallel_size` N splits the model across N ranks, one per device
    (kvpool.engine.parallel): the pool, its plan and kv_cache_memory are per rank; a
    collective that waits over `tensor_parallel_timeout` seconds (at least 1) fails the engine.
    """

    page_size: int = 16
    num_pages: int | None = None
    memory_fraction: float = 0.9
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    dtype: torch.dtype | None = None
    kv_cache_dtype: str = "auto"
    kv_scales: tuple[float, float] | float | None = None
    device: str | torch.device | None = None
    seed: int = 0
    enforce_eager: bool = False
    overlap: bool | None = None
    mamba_checkpoint_slots: int | None = None
    free_out_of_window: bool = True
    host_tier_memory: int | None = None
    disk_tier: str | os.PathLike | None = None
    disk_tier_memory: int = DEFAULT_DISK_TIER_MEMORY
    redis_tier: str | None = None
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 300.0

    def __post_init__(self) -> None:
        for name in ("page_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size"):
            check_int64(name, getattr(self, name), 1)
        # at least a second: the ranks' groups connect within it as they form
        check_seconds("tensor_parallel_timeout", self.tensor_parallel_timeout, least=1.0)
        for name in ("num_pages", "max_model_len", "mamba_checkpoint_slots"):
            if getattr(self, name) is not None:
                check_int64(name, getattr(self, name), 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (
                0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        fraction = self.memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
                0 < fraction <= 1):
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        for name in ("prefix_caching", "enforce_eager", "free_out_of_window"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise TypeError(f"overlap must be a bool or None, got {self.overlap!r}")
        if self.overlap and self.tensor_parallel_size > 1:
            raise ValueError("overlap=True needs tensor_parallel_size 1: the workers take each "
                             "step's input ids from rank 0's message, not from the device")
        self._check_tier()
        check_model_dtype(self.dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_scales is not None:
            if self.kv_cache_dtype == "auto":
                raise ValueError(f"kv_scales {self.kv_scales!r} apply to fp8 pages; "
                                 f"pass kv_cache_dtype='fp8_e4m3'")
            if isinstance(self.kv_scales, tuple) and len(self.kv_scales) == 2:
                check_scale("k_scale", self.kv_scales[0])
                check_scale("v_scale", self.kv_scales[1])
            elif isinstance(self.kv_scales, (int, float)) and not isinstance(self.kv_scales, bool):
                check_scale("latent_scale", self.kv_scales)
            else:
                raise ValueError(f"kv_scales must be a (k_scale, v_scale) pair, or one number "
                                 f"for MLA latent pages; got {self.kv_scales!r}")

    @property
    def tier_option(self) -> str | None:
        """The name of the tier option given (host_tier_memory, disk_tier, redis_tier)."""
        given = [name for name in TIER_OPTIONS if getattr(self, name) is not None]
        return given[0] if given else None

    def _check_tier(self) -> None:
        given = [name for name in TIER_OPTIONS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"an engine has one tier: pass one of {', '.join(TIER_OPTIONS)}, "
                             f"got {' and '.join(given)}")
        if given and not self.prefix_caching:
            raise ValueError(f"{given[0]}: a tier holds evicted prefix pages; it needs "
                             f"prefix_caching=True")
        if self.host_tier_memory is not None:
            check_int64("host_tier_memory", self.host_tier_memory, 1)
        check_int64("disk_tier_memory", self.disk_tier_memory, 1)
        for name in ("disk_tier", "redis_tier"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        if self.redis_tier is not None and not str(self.redis_tier).startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_tier must be a redis:// URL, got {self.redis_tier!r}")

    def kv_layout(self, model: ModelConfig) -> KVLayout:
        """The KV layout of one rank's pool of `model` under these options (dtype,
        kv_cache_dtype, page_size, tensor_parallel_size; a window no sequence of
        max_model_len tokens passes is none). ValueError if `kv_scales` does not
        fit it (a pair for K/V pages, a number for MLA) or its KV heads do not split."""
        if model.mla and isinstance(self.kv_scales, tuple):
            raise ValueError(f"an MLA model's latent pages have one scale per layer: kv_scales "
                             f"must be one number, got {self.kv_scales!r}")
        if not model.mla and self.kv_scales is not None and not isinstance(self.kv_scales,
                                                                           tuple):
            raise ValueError(f"K/V pages have a K and a V scale per layer: kv_scales must be a "
                             f"(k_scale, v_scale) pair, got {self.kv_scales!r}")
        return model.kv_layout(dtype=self.dtype, page_size=self.page_size,
                               kv_cache_dtype=self.kv_cache_dtype,
                               max_model_len=self.resolve_max_model_len(model)
                               ).per_rank(self.tensor_parallel_size)

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        """max_model_len, or the model's limit; over the model's limit is an error."""
        limit = model.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        return self.max_model_len

    def workspace_bytes(self, model: ModelConfig, layout: KVLayout, max_model_len: int) -> int:
        """Bytes of the engine's workspace: a step's int64 metadata at its largest (tokens,
        sequences, a slot mapping and page tables of `max_model_len` tokens per layer group,
        state slots: pass the longest sequence the cache can hold, see `longest_sequence`)
        plus the split-context decode's scratch (`decode_scratch_bytes` at
        MAX_DECODE_SPLITS splits; one layer's worth, which every layer reuses) and alignment
        slack."""
        seqs, tokens = self.max_num_seqs, self.max_num_batched_tokens
        width = -(-max_model_len // layout.page_size)
        groups = len(layout.groups)
        metadata = ((2 + groups) * tokens + 4 * seqs + 1 + groups * seqs * width) * 8
        scratch = decode_scratch_bytes(seqs, model.num_heads, model.head_dim, MAX_DECODE_SPLITS)
        return metadata + scratch + 8 * ALIGNMENT

    @staticmethod
    def longest_sequence(layout: KVLayout, max_model_len: int, num_pages: int) -> int:
        """Tokens of the longest sequence a pool of `num_pages` pages can hold: max_model_len,
        at most the pool's tokens when every page of a sequence stays (no sliding window to
        give pages back), so that nothing is sized by a context the pool can never hold."""
        if any(layout.layer_windows):
            return max_model_len
        return min(max_model_len, num_pages * layout.page_size)

    def cuda_graph_bytes(self, model: ModelConfig, dtype: torch.dtype) -> int:
        """Estimated bytes of the decode CUDA graphs' memory pool (0 with enforce_eager):
        the activations of the largest bucket, which every smaller one reuses."""
        if self.enforce_eager:
            return 0
        return model.estimate_activation_bytes(dtype, max_num_batched_tokens=self.max_num_seqs,
                                               max_num_seqs=self.max_num_seqs)

    def memory_plan(self, model: ModelConfig, device: torch.device | None, max_model_len: int,
                    *, reserved_bytes: int = 0, **options) -> MemoryPlan:
        """This engine's plan of `device`'s memory (`plan_memory`, given `options` besides;
        device None with `device_memory` among them: a device of that many bytes, uncapped):
        the activations of its largest step, the decode CUDA graphs (on CUDA), the workspace
        for the longest sequence the pool can hold and `reserved_bytes` held back."""
        layout = self.kv_layout(model)
        weights_dtype = model.weights_dtype(self.dtype)
        activations = model.estimate_activation_bytes(
            weights_dtype, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs)
        if device is not None and device.type == "cuda":
            reserved_bytes += self.cuda_graph_bytes(model, weights_dtype)
        plan = functools.partial(
            plan_memory, model, memory_fraction=self.memory_fraction, dtype=weights_dtype,
            page_size=layout.page_size, activation_bytes=activations, device=device,
            kv_cache_dtype=self.kv_cache_dtype, tensor_parallel_size=self.tensor_parallel_size,
            max_model_len=max_model_len, max_num_seqs=self.max_num_seqs,
            free_out_of_window=self.free_out_of_window, **options)
        # The workspace's page tables hold the longest sequence the pool can: at most the
        # pages the budget would hold without the workspace.
        without = plan(reserved_bytes=reserved_bytes)
        most_pages = max(without.budget_bytes if device is None else
                         kv_budget(without, device, self.kv_cache_memory), 0)
        longest = self.longest_sequence(layout, max_model_len,
                                        most_pages // layout.bytes_per_page)
        return plan(reserved_bytes=reserved_bytes + self.workspace_bytes(model, layout, longest))

    def plan_num_pages(self, model: ModelConfig, device: torch.device,
                       max_model_len: int, *, state_bytes: int = 0) -> int:
        """num_pages, or the pages this engine's share of `device` holds once the model is
        loaded: call it before loading the weights, which it counts from the config. A
        hybrid's state pool (`state_bytes`) comes out of the cache's budget first."""
        if self.num_pages is not None:
            return self.num_pages
        layout = self.kv_layout(model)
        plan = self.memory_plan(model, device, max_model_len)
        budget = kv_budget(plan, device, self.kv_cache_memory) - state_bytes
        num_pages = pages_within(layout, budget)
        if num_pages == 0:
            states = f", after state slots of {exact_bytes(state_bytes)}," if state_bytes else ""
            need = (1 + RESERVED_PAGES) * layout.bytes_per_page
            raise OutOfPages(f"the KV cache budget of {exact_bytes(budget)} on {device}"
                             f"{states} holds no page of {exact_bytes(layout.bytes_per_page)} "
                             f"beside the pool's {RESERVED_PAGES} reserved one, which need "
                             f"{exact_bytes(need)} ({plan.reason or 'kv_cache_memory is too small'}"
                             f"); pass num_pages or a larger kv_cache_memory / memory_fraction")
        return num_pages
