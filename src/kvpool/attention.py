"""Paged attention: write new tokens' K/V into the pool by slot, and attend through page tables.

Backends: "torch" (the reference: gathers pages, then SDPA), "cpu" (decode rows in the fused C
kernel of kvpool/kernels/cpu.py, other rows as torch) and "triton" (kvpool/kernels/triton_*.py,
on CUDA; Triton is optional and imported only when used).

fp8 caches (float8_e4m3fn, kvpool.memory.fp8) come with a K and a V scale (floats or float32 tensors
`[]`): write_kv quantizes under them, and every backend reads the pages dequantized. The torch
reference dequantizes the gathered K/V in float32 (`float32(byte) * scale`) and attends in
float32; the kernels fold the scales into the scores and the output instead, which differs
only by rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from kvpool.kernels import cpu as cpu_kernel
from kvpool.kernels import triton_support
from kvpool.kernels.checks import check_index_dtype, check_page_tables
from kvpool.memory.fp8 import check_scale, dequantize, is_fp8, quantize
from kvpool.numeric import FLOAT32_MAX, INT64_MAX, check_float32
from kvpool.rope import Rotation, apply_rotary

BACKENDS = ("torch", "cpu", "triton")

# Decode gathers the pages of a group of sequences into one scratch tensor of about this many
# bytes (K and V), reused for every group: small enough to stay in cache, large enough that a
# decode batch costs a handful of torch calls (benchmarks/attention.py).
_DECODE_GROUP_BYTES = 8 << 20
# The query dtypes every backend reads fp8 pages with (the kernels compute in float32).
_FP8_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(slots=True)
class AttentionMetadata:
    """The per-step inputs of attention for a packed batch of sequences (one forward pass)."""

    slot_mapping: torch.Tensor  # [total_query_tokens] int64: where each new token's K/V goes
    page_tables: torch.Tensor  # [batch, max_pages] int32, padded with any valid page id
    seq_lens: torch.Tensor  # [batch] int32: KV length of each sequence, new tokens included
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32: query token offsets, starting at 0
    max_seq_len: int | None = None  # host bound of seq_lens (tokens); None: read from the tensor
    max_query_len: int | None = None  # host bound of the query lengths (tokens)
    workspace: Any = None  # kernels' scratch: `alloc(shape, dtype)` and `scope()`, or None


class _Layer(NamedTuple):
    """One layer's paged K/V and the attention parameters shared by every sequence of a call."""

    k_cache: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    scale: float
    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None  # [num_heads] float32: each head's sink logit
    backend: str  # "torch" or "cpu"
    k_scale: torch.Tensor | float | None  # fp8 caches only
    v_scale: torch.Tensor | float | None


def write_kv(k_cache, v_cache, slots, k, v, *, k_scale=None, v_scale=None,
             rotation: Rotation | None = None) -> None:
    """Store K and V `[n, num_kv_heads, head_dim]` of n tokens at `slots` `[n]` (integers).

    `k_cache`/`v_cache` are one layer's `[num_pages, page_size, num_kv_heads, head_dim]` pool views.
    fp8 caches take K/V of any float dtype and store them quantized under `k_scale`/`v_scale`.
    Slots on the CPU are all checked before anything is written: a slot outside the caches
    raises IndexError naming it, and nothing changes. Slots on CUDA are not read back (that
    would synchronise): the Triton kernel skips an out-of-range slot, and index_copy_ (without
    Triton) stops on its device-side assertion. A `rotation` (kvpool.rope.Rotation) stores K
    rotated by RoPE and rotates its q in place: in the Triton write kernel, else by torch.
    """
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"write_kv expects caches [pages, page_size, kv_heads, head_dim] of one "
                         f"shape and dtype; got k_cache {tuple(k_cache.shape)} {k_cache.dtype}, "
                         f"v_cache {tuple(v_cache.shape)} {v_cache.dtype}")
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or slots.shape != k.shape[:1]:
        raise ValueError(
            f"write_kv expects k, v [n, {k_cache.shape[2]}, {k_cache.shape[3]}] and slots [n]; "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)}"
        )
    fp8 = _check_scales("write_kv", k_cache, v_cache, k_scale, v_scale)
    if fp8 and not (k.dtype.is_floating_point and v.dtype.is_floating_point):
        raise ValueError(f"write_kv expects floating-point k, v, got {k.dtype} and {v.dtype}")
    if not fp8 and (k.dtype != k_cache.dtype or v.dtype != v_cache.dtype):
        raise ValueError(f"write_kv expects k, v in the caches' {k_cache.dtype}, "
                         f"got {k.dtype} and {v.dtype}")
    _check_slots("write_kv", k_cache, slots)
    if rotation is not None:
        rotation.check(k)
    dense = k_cache.stride(3) == v_cache.stride(3) == 1
    if dense and triton_support.fused_on(k_cache.device, k_cache.dtype):
        from kvpool.kernels import triton_write

        triton_write.write_kv(k_cache, v_cache, slots, k, v, k_scale=k_scale, v_scale=v_scale,
                              rotation=rotation)
        return
    # Both views before rotating q: a cache that cannot be viewed must change nothing.
    k_rows = _slot_rows("write_kv", "k_cache", k_cache)
    v_rows = _slot_rows("write_kv", "v_cache", v_cache)
    if rotation is not None:
        q, cos, sin = rotation
        k = apply_rotary(k, cos, sin)
        q.copy_(apply_rotary(q, cos, sin))
    slots = slots.long()
    if fp8:  # index_copy_ has no fp8 kernel: copy the bytes
        k_rows, v_rows = k_rows.view(torch.uint8), v_rows.view(torch.uint8)
        k, v = quantize(k, k_scale).view(torch.uint8), quantize(v, v_scale).view(torch.uint8)
    k_rows.index_copy_(0, slots, k)
    v_rows.index_copy_(0, slots, v)


def write_latent(cache, slots, latent, *, scale=None) -> None:
    """Store MLA latents `[n, 1, latent_dim]` of n tokens at `slots` `[n]` in one layer's
    latent pages `cache` `[num_pages, page_size, 1, latent_dim]` (a KVLayout of kind "mla").
    An fp8 cache takes latents of any float dtype and stores them quantized under `scale` (a
    float or a float32 tensor `[]`); other caches take none. Slots are checked as `write_kv`
    checks them."""
    if latent.shape[1:] != cache.shape[2:] or slots.shape != latent.shape[:1]:
        raise ValueError(f"write_latent expects latent [n, {cache.shape[2]}, {cache.shape[3]}] "
                         f"and slots [n]; got latent {tuple(latent.shape)}, "
                         f"slots {tuple(slots.shape)}")
    fp8 = is_fp8(cache.dtype)
    if fp8 != (scale is not None):
        need = "needs a scale" if fp8 else "takes no scale"
        raise ValueError(f"write_latent: a {cache.dtype} cache {need}; got scale {scale!r}")
    if fp8:
        _check_scale("write_latent", "scale", scale)
    if fp8 and not latent.dtype.is_floating_point:
        raise ValueError(f"write_latent expects a floating-point latent, got {latent.dtype}")
    if not fp8 and latent.dtype != cache.dtype:
        raise ValueError(f"write_latent expects latent in the cache's {cache.dtype}, "
                         f"got {latent.dtype}")
    _check_slots("write_latent", cache, slots)
    rows = _slot_rows("write_latent", "cache", cache)
    if fp8:  # index_copy_ has no fp8 kernel: copy the bytes
        rows, latent = rows.view(torch.uint8), quantize(latent, scale).view(torch.uint8)
    rows.index_copy_(0, slots.long(), latent)


def _slot_rows(caller: str, name: str, cache) -> torch.Tensor:
    """`cache` as a view `[slots, kv_heads, head_dim]`, or ValueError naming its strides: a
    copy (reshape) would silently drop the write."""
    try:
        return cache.view(-1, *cache.shape[2:])
    except RuntimeError:
        raise ValueError(f"{caller}: {name} {tuple(cache.shape)} of strides {cache.stride()} "
                         f"cannot be viewed as [slots, kv_heads, head_dim]: its pages must be "
                         f"dense in (page_size, kv_heads, head_dim)") from None


def _check_slots(caller: str, cache, slots) -> None:
    """Raise unless slots are integers; on the CPU, IndexError naming the first slot outside
    the cache (CUDA slots are not read back: that would synchronise)."""
    check_index_dtype("slots", slots)
    num_slots = cache.shape[0] * cache.shape[1]
    if slots.device.type == "cpu" and slots.numel():
        lo, hi = torch.aminmax(slots)
        if lo < 0 or hi >= num_slots:
            i = int(((slots < 0) | (slots >= num_slots)).nonzero()[0])
            raise IndexError(
                f"{caller}: slot {int(slots[i])} (token {i}) is outside the caches' "
                f"[0, {num_slots})"
            )


def _check_scales(name: str, k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the caches are fp8; ValueError unless fp8 caches have both scales (as
    `_check_scale` takes them) and others none."""
    fp8 = is_fp8(k_cache.dtype)
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        need = "need k_scale and v_scale" if fp8 else "take no k_scale or v_scale"
        raise ValueError(f"{name}: {k_cache.dtype} caches {need}; got k_scale {k_scale!r}, "
                         f"v_scale {v_scale!r}")
    for scale_name, scale in (("k_scale", k_scale), ("v_scale", v_scale)) if fp8 else ():
        _check_scale(name, scale_name, scale)
    return fp8


def _check_scale(caller: str, name: str, scale) -> None:
    """Raise unless `scale` is a positive normal float32 number or a float32 tensor `[]` (its
    value unread: on CUDA that would synchronise). Any other rank would broadcast K/V."""
    if not isinstance(scale, torch.Tensor):
        check_scale(f"{caller} {name}", scale)
    elif scale.dim() != 0 or scale.dtype != torch.float32:
        raise ValueError(f"{caller}: {name} must be a number or a float32 tensor [], got "
                         f"{scale.dtype} of shape {tuple(scale.shape)}")


def paged_attention(
    q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, *, scale=None, sliding_window=None,
    softcap=None, sinks=None, backend=None, max_seq_len=None, max_query_len=None,
    workspace=None, k_scale=None, v_scale=None,
) -> torch.Tensor:
    """Causal attention of packed queries `[total_query_tokens, num_heads, head_dim]` over pages.

    Sequence b owns query rows `cu_seqlens_q[b]:cu_seqlens_q[b + 1]`, its last tokens out of
    `seq_lens[b]`. Returns `[total_query_tokens, num_heads, head_dim]` in q's dtype; an empty
    batch gives an empty result. A `softcap` (Gemma 2's attention logit softcapping) turns
    each scaled score s into `softcap * tanh(s / softcap)` before the mask and the softmax;
    None: scores as they are. `sinks` (GPT-OSS's attention sinks: a float32 tensor
    `[num_heads]` on q's device) gives each head a logit that joins every row's softmax
    denominator, taking probability mass but adding no value; None: no sinks. `backend` is
    one of BACKENDS, None for the fastest here.
    `max_seq_len`/`max_query_len` (tokens) bound the lengths: with both, the triton backend
    on CUDA trusts them and reads nothing back from the device. `workspace`
    (`kvpool.memory.workspace.Workspace` or anything with its `alloc(shape, dtype)` and
    `scope()`) provides the triton decode's scratch, taken back when the call returns. fp8
    caches need `k_scale` and `v_scale`, and q in float16, bfloat16 or float32. Triton
    launches on the current CUDA device: for tensors on another, call it under
    `kvpool.devices.made_current(q.device)`, as the engine runs its steps.
    """
    backend = _choose_backend(backend, q, k_cache.dtype)
    for name, bound in (("max_seq_len", max_seq_len), ("max_query_len", max_query_len)):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
            raise TypeError(f"paged_attention: {name} must be an int or None, got {bound!r}")
    _check_shapes(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, sliding_window)
    _check_scales("paged_attention", k_cache, v_cache, k_scale, v_scale)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif type(scale) is not float or not 0.0 < scale <= FLOAT32_MAX:  # NaN fails it too
        scale = check_float32("scale", scale, low=0.0, open_low=True)
    if softcap is not None:
        softcap = check_float32("softcap", softcap, low=0.0, open_low=True, normal=True)
    if sinks is not None:
        _check_sinks(q, sinks)
    if seq_lens.shape[0] == 0:
        return q.new_empty(q.shape)
    bounded = backend == "triton" and max_seq_len is not None and max_query_len is not None
    if bounded:
        _check_bounds(k_cache, page_tables, max_seq_len, max_query_len)
        if q.device.type != "cpu":  # trusted: reading the lengths back would synchronise
            return _attend_triton(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q,
                                  scale, sliding_window, softcap, sinks, max_seq_len,
                                  max_query_len, workspace, k_scale, v_scale)
    lens, starts = seq_lens.tolist(), cu_seqlens_q.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:], strict=False)]
    _check_values(q, k_cache, v_cache, page_tables, lens, starts, q_lens)
    for name, bound, actual in (("max_seq_len", max_seq_len, max(lens)),
                                ("max_query_len", max_query_len, max(q_lens))):
        if bound is not None and bound < actual:
            raise ValueError(f"paged_attention: {name} {bound} is below the batch's {actual}")
    if backend == "triton":
        return _attend_triton(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, scale,
                              sliding_window, softcap, sinks,
                              max_seq_len if bounded else max(lens),
                              max_query_len if bounded else max(q_lens), workspace,
                              k_scale, v_scale)
    layer = _Layer(k_cache, v_cache, scale, sliding_window, softcap, sinks, backend, k_scale,
                   v_scale)
    decode = [b for b, q_len in enumerate(q_lens) if q_len == 1]
    if len(decode) == len(q_lens):
        return _decode_rows(layer, q, page_tables, lens)
    out = torch.empty_like(q)
    if decode:
        rows = torch.tensor([starts[b] for b in decode], device=q.device)
        tables = page_tables.index_select(0, torch.tensor(decode, device=q.device))
        decoded = _decode_rows(layer, q.index_select(0, rows), tables, [lens[b] for b in decode])
        out.index_copy_(0, rows, decoded)
    for b, q_len in enumerate(q_lens):
        if q_len > 1:
            rows = slice(starts[b], starts[b] + q_len)
            out[rows] = _attend_sequence(layer, q[rows], page_tables[b], lens[b])
    return out


def _choose_backend(backend: str | None, q: torch.Tensor, cache_dtype: torch.dtype) -> str:
    """The backend to run: `backend` if it can run on q's device, else the fastest there
    (None): triton on CUDA when installed (fp8 pages from sm_89 on), the C kernel on the CPU
    unless switched off."""
    if backend is None:
        if q.device.type == "cpu":
            return "cpu" if cpu_kernel.enabled() else "torch"
        return "triton" if triton_support.runs_on(q.device, cache_dtype) else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"paged_attention: backend must be one of {BACKENDS} or None, "
                         f"got {backend!r}")
    if backend == "cpu" and q.device.type != "cpu":
        raise ValueError(f"paged_attention: the cpu backend needs CPU tensors, got {q.device}")
    if backend == "triton" and not triton_support.runs_on(q.device, cache_dtype):
        if not triton_support.triton_installed():
            why = "needs the triton package, which is not installed"
        elif q.device.type == "cuda":
            why = f"reads fp8 pages on sm_89 and later only, got {q.device}"
        else:
            why = f"needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}"
        raise ValueError(f"paged_attention: the triton backend {why}")
    return backend


def _attend_triton(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, scale, window,
                   softcap, sinks, max_seq_len: int, max_query_len: int, workspace, k_scale,
                   v_scale) -> torch.Tensor:
    """The triton kernels: decode when every query is one token, else prefill (any mix)."""
    from kvpool.kernels import triton_decode, triton_prefill

    q = q if q.stride(2) == 1 else q.contiguous()
    # the kernels step through the index tensors and the sinks densely (a no-op for dense ones)
    page_tables, seq_lens, cu_seqlens_q = (
        t.contiguous() for t in (page_tables, seq_lens, cu_seqlens_q))
    sinks = None if sinks is None else sinks.contiguous()
    scales = dict(k_scale=k_scale, v_scale=v_scale, softcap=softcap, sinks=sinks)
    if max_query_len == 1:
        span = max_seq_len if window is None else min(max_seq_len, window)
        splits = triton_decode.choose_num_splits(
            seq_lens.shape[0], k_cache.shape[2], span, triton_support.num_sms(q.device))
        if workspace is None:
            return triton_decode.paged_decode(
                q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, scale=scale,
                window=window, num_splits=splits, max_span=span, **scales)
        # The split scratch is dead once this call's merge is queued: the next layer reuses it.
        with workspace.scope():
            return triton_decode.paged_decode(
                q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, scale=scale,
                window=window, num_splits=splits, max_span=span, workspace=workspace,
                **scales)
    return triton_prefill.paged_prefill(
        q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, scale=scale, window=window,
        max_query_len=max_query_len, **scales)


def _fail(q, k_cache, v_cache, page_tables, problem: str):
    """Raise ValueError: `problem`, then the shapes of the inputs."""
    raise ValueError(
        f"paged_attention: {problem}; got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
        f"v_cache {tuple(v_cache.shape)}, page_tables {tuple(page_tables.shape)}"
    )


def _check_shapes(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, window) -> None:
    """Raise ValueError naming the shapes if they do not describe one consistent batch (reads
    no tensor's values)."""
    problem = None
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        problem = (
            "expected q [tokens, heads, head_dim], caches [pages, page_size, kv_heads, head_dim]"
        )
    elif k_cache.dtype != v_cache.dtype or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        problem = "k_cache and v_cache must share a dtype and be dense in head_dim"
    elif k_cache.shape[2] == 0 or k_cache.shape[3] == 0:
        problem = "num_kv_heads and head_dim must be at least 1"
    elif q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        problem = "head_dim must match and num_heads must be a multiple of num_kv_heads"
    elif (
        page_tables.dim() != 2
        or seq_lens.dim() != 1
        or page_tables.shape[0] != seq_lens.shape[0]
        or cu_seqlens_q.shape != (seq_lens.shape[0] + 1,)
    ):
        problem = (
            "expected page_tables [batch, max_pages], seq_lens [batch], cu_seqlens_q [batch+1]; "
            f"seq_lens {tuple(seq_lens.shape)}, cu_seqlens_q {tuple(cu_seqlens_q.shape)}"
        )
    elif seq_lens.shape[0] == 0 and q.shape[0] != 0:
        problem = f"an empty batch has no query tokens, got {q.shape[0]}"
    elif not is_fp8(k_cache.dtype) and q.dtype != k_cache.dtype:
        problem = f"q must be in the caches' {k_cache.dtype}, got {q.dtype}"
    elif is_fp8(k_cache.dtype) and q.dtype not in _FP8_Q_DTYPES:
        problem = f"q over fp8 caches must be float16, bfloat16 or float32, got {q.dtype}"
    elif window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                 or not 1 <= window <= INT64_MAX):
        problem = f"sliding_window must be an int64 of at least 1 token, got {window!r}"
    if problem:
        _fail(q, k_cache, v_cache, page_tables, problem)
    for name, tensor in (("page_tables", page_tables), ("seq_lens", seq_lens),
                         ("cu_seqlens_q", cu_seqlens_q)):
        check_index_dtype(name, tensor)
        if tensor.dtype not in (torch.int32, torch.int64):  # what every backend indexes with
            raise TypeError(f"paged_attention: {name} must be int32 or int64, got {tensor.dtype}")


def _check_sinks(q, sinks) -> None:
    """Raise ValueError unless `sinks` is a float32 tensor `[num_heads]` on q's device (its
    values unread: on CUDA that would synchronise)."""
    if (not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32
            or sinks.shape != (q.shape[1],) or sinks.device != q.device):
        got = (f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
               if isinstance(sinks, torch.Tensor) else repr(sinks))
        raise ValueError(f"paged_attention: sinks must be a float32 tensor [{q.shape[1]}] on "
                         f"{q.device}, got {got}")


def _check_bounds(k_cache, page_tables, max_seq_len: int, max_query_len: int) -> None:
    """Raise ValueError unless the host bounds fit the page tables (reads no tensor)."""
    capacity = page_tables.shape[1] * k_cache.shape[1]
    if not 1 <= max_query_len <= max_seq_len <= capacity:
        raise ValueError(
            f"paged_attention: need 1 <= max_query_len ({max_query_len}) <= max_seq_len "
            f"({max_seq_len}) <= {page_tables.shape[1]} pages of {k_cache.shape[1]} tokens"
        )


def _check_values(q, k_cache, v_cache, page_tables, lens, starts, q_lens) -> None:
    """Raise ValueError (IndexError for a page id) if the lengths or page ids are inconsistent."""
    problem = None
    if starts[0] != 0 or starts[-1] != q.shape[0]:
        problem = f"cu_seqlens_q must run from 0 to {q.shape[0]}, not {starts[0]}..{starts[-1]}"
    elif any(not 0 < q_len <= n for q_len, n in zip(q_lens, lens, strict=True)):
        problem = f"each sequence needs 1 <= q_len <= seq_len; q_lens {q_lens}, seq_lens {lens}"
    elif max(lens) > page_tables.shape[1] * k_cache.shape[1]:
        problem = f"seq_len {max(lens)} exceeds {page_tables.shape[1]} pages of {k_cache.shape[1]}"
    if problem:
        _fail(q, k_cache, v_cache, page_tables, problem)
    check_page_tables(page_tables, k_cache.shape[0])


def _first_visible(seq_len: int, q_len: int, window: int | None) -> int:
    """Position of the oldest key that any of a sequence's last q_len query tokens may see."""
    return 0 if window is None else max(0, seq_len - q_len - window + 1)


def _attend_sequence(layer: _Layer, q, pages, seq_len: int) -> torch.Tensor:
    """Attention of one sequence's `q [q_len, heads, head_dim]` (prefill or chunk) over its K/V."""
    q_len, page_size = q.shape[0], layer.k_cache.shape[1]
    first = _first_visible(seq_len, q_len, layer.window)
    first_page = first // page_size
    ids = pages[first_page : -(-seq_len // page_size)]
    # Gather only visible tokens, so unused slots (any bits, NaN included) never enter the math.
    lo, hi = first - first_page * page_size, seq_len - first_page * page_size
    k = layer.k_cache.index_select(0, ids).flatten(0, 1)[lo:hi].transpose(0, 1)
    v = layer.v_cache.index_select(0, ids).flatten(0, 1)[lo:hi].transpose(0, 1)
    dtype = q.dtype
    if layer.k_scale is not None:  # in float32, as the kernels: float16 K/V could overflow
        q = q.float()
        k, v = dequantize(k, layer.k_scale, q.dtype), dequantize(v, layer.v_scale, q.dtype)
    mask = None
    if layer.window is not None or q_len != seq_len or _scored(layer):
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        key_pos = torch.arange(first, seq_len, device=q.device)
        mask = key_pos <= query_pos
        if layer.window is not None:
            mask &= key_pos > query_pos - layer.window
    if _scored(layer):  # the query heads of a KV head as rows [kv_heads, group, ...]
        grouped = q.transpose(0, 1).unflatten(0, (k.shape[0], -1))
        sinks = None if layer.sinks is None else layer.sinks.view(k.shape[0], -1, 1, 1)
        out = _scored_attention(grouped, k[:, None], v[:, None], mask, layer.scale,
                                layer.softcap, sinks)
        return out.flatten(0, 1).transpose(0, 1).to(dtype)
    # 4-D inputs: CPU SDPA sends 3-D ones to its slow math path, which repeats K/V for GQA.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[None],
        v[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=layer.scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).to(dtype)


def _decode_rows(layer: _Layer, q, page_tables, lens: list[int]) -> torch.Tensor:
    """Attention of one query token per sequence, `q [batch, heads, head_dim]`: the fused CPU
    kernel when it takes these inputs (kvpool/kernels), else the torch path."""
    if layer.backend == "cpu" and cpu_kernel.supports(q, layer.k_cache, layer.v_cache):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        return cpu_kernel.paged_decode(
            q, layer.k_cache, layer.v_cache, page_tables, seq_lens, layer.scale, layer.window,
            softcap=layer.softcap, sinks=layer.sinks, k_scale=layer.k_scale,
            v_scale=layer.v_scale,
        )
    return _decode(layer, q, page_tables, lens)


def _decode(layer: _Layer, q, page_tables, lens: list[int]) -> torch.Tensor:
    """Attention of one query token per sequence, `q [batch, heads, head_dim]`, group by group."""
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = layer.k_cache.shape[1:3]
    firsts = [_first_visible(n, 1, layer.window) for n in lens]
    widest = max(-(-n // page_size) - f // page_size for n, f in zip(lens, firsts, strict=True))
    page_bytes = 2 * layer.k_cache[0].numel() * layer.k_cache.element_size()
    group = min(batch, max(1, _DECODE_GROUP_BYTES // (widest * page_bytes)))
    k_buf = layer.k_cache.new_empty(group * widest, *layer.k_cache.shape[1:])
    v_buf = torch.empty_like(k_buf)
    # GQA without copying K/V: the query heads sharing a KV head become its query rows.
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(grouped)
    if layer.k_scale is not None:  # in float32, as the kernels: float16 K/V could overflow
        grouped = grouped.float()
    for i in range(0, batch, group):
        rows = slice(i, i + group)
        ids, visible = _visible_pages(page_tables[rows], lens[rows], firsts[rows], page_size)
        k = _gather(layer.k_cache, ids, k_buf, visible)
        v = _gather(layer.v_cache, ids, v_buf, visible)
        if layer.k_scale is not None:
            k = dequantize(k, layer.k_scale, grouped.dtype)
            v = dequantize(v, layer.v_scale, grouped.dtype)
        mask = None if visible is None else visible[:, None, None, :]
        if not _scored(layer):
            out[rows] = F.scaled_dot_product_attention(
                grouped[rows], k, v, attn_mask=mask, scale=layer.scale
            )
        else:
            sinks = None if layer.sinks is None else layer.sinks.view(num_kv_heads, -1, 1)
            out[rows] = _scored_attention(grouped[rows], k, v, mask, layer.scale,
                                          layer.softcap, sinks)
    return out.view(batch, num_heads, head_dim)


def _scored(layer: _Layer) -> bool:
    """Whether the layer's scores need more than SDPA takes: a softcap or sinks."""
    return layer.softcap is not None or layer.sinks is not None


def _scored_attention(q, k, v, mask, scale: float, softcap: float | None,
                      sinks) -> torch.Tensor:
    """Attention of `q [..., rows, head_dim]` over `k`, `v [..., keys, head_dim]` (batch
    dimensions broadcast) in float32 (SDPA takes neither option): each scaled score s becomes
    `softcap * tanh(s / softcap)` unless `softcap` is None, and `sinks [..., rows, 1]` (or
    None) join each row's softmax denominator as a logit of no value. `mask [..., rows, keys]`
    is True where a key is visible (None: all are). Returns q's shape and dtype."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    # at most float32's largest, as the kernels take it: infinity less infinity would be NaN
    sinks = sinks.clamp(max=FLOAT32_MAX).expand(*scores.shape[:-1], 1)
    weights = torch.cat([scores, sinks], -1).softmax(-1)[..., :-1]
    return torch.matmul(weights, v.float()).to(q.dtype)


def _visible_pages(page_tables, lens: list[int], firsts: list[int], page_size: int):
    """Page ids `[batch, pages]` covering each sequence's visible tokens, padded to the widest,
    and a `[batch, pages * page_size]` bool mask of the visible tokens (None if all are)."""
    device = page_tables.device
    first_pages = [f // page_size for f in firsts]
    num_pages = max(-(-n // page_size) - p for n, p in zip(lens, first_pages, strict=True))
    first_page = torch.tensor(first_pages, device=device).unsqueeze(1)
    # Columns past a sequence's own pages read a padding entry (a valid page id), masked below.
    cols = first_page + torch.arange(num_pages, device=device)
    ids = page_tables.gather(1, cols.clamp_(max=page_tables.shape[1] - 1))
    span = num_pages * page_size
    if all(
        f == p * page_size and n - f == span
        for n, f, p in zip(lens, firsts, first_pages, strict=True)
    ):
        return ids, None
    key_pos = first_page * page_size + torch.arange(span, device=device)
    visible = key_pos < torch.tensor(lens, device=device).unsqueeze(1)
    visible &= key_pos >= torch.tensor(firsts, device=device).unsqueeze(1)
    return ids, visible


def _gather(cache, ids, buf, visible) -> torch.Tensor:
    """Copy pages `ids [batch, pages]` into `buf`; return `[batch, kv_heads, tokens, head_dim]`."""
    batch, num_pages = ids.shape
    if cache.requires_grad and torch.is_grad_enabled():  # out= and in place record no grad
        tokens = cache[ids.flatten()].view(batch, num_pages * cache.shape[1], *cache.shape[2:])
        if visible is not None:
            tokens = tokens.masked_fill(~visible[..., None, None], 0)
        return tokens.transpose(1, 2)
    pages = torch.index_select(cache, 0, ids.flatten(), out=buf[: batch * num_pages])
    tokens = pages.view(batch, num_pages * cache.shape[1], *cache.shape[2:])
    if visible is not None:
        # A masked score gets zero weight, but 0 * NaN is NaN: zero the hidden slots themselves.
        # Indexing by the hidden positions is ~15x faster than a boolean-mask assignment here.
        tokens[(~visible).nonzero(as_tuple=True)] = 0
    return tokens.transpose(1, 2)
