"""The Mamba2 mixer of a hybrid model, reading and writing its sequences' state slots.

Per token t of a sequence, per head: `h_t = exp(dt_t * A) h_{t-1} + dt_t x_t B_t^T` (an SSM
state of head_dim x state_size) and `y_t = h_t C_t + D x_t`, where x, B and C come out of a
causal depthwise convolution over the token's inputs. A decode token takes one step of that
recurrence; a prefill chunk runs the chunked scan (within a chunk, attention-like products
weighted by the decay between tokens; across chunks, the recurrence on the chunk-end
states). The state slot holds the last `conv_kernel - 1` conv inputs and h after the
sequence's last computed token; a sequence whose chunk starts at position 0 starts from
zeros and never reads its slot.

Under tensor parallelism each rank holds a contiguous share of the heads (their x, z, dt, A,
D and SSM states) and of the B/C groups (or, with fewer groups than ranks, the one group its
heads read, replicated): in_proj and the convolution by those output channels, out_proj by
its input features, ending in a partial sum the decoder layer all-reduces. The gated norm
normalizes within groups of channels; a group split across ranks gets its mean square summed
across them (one all-reduce of `[tokens, num_groups]`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.forward_context import ForwardContext
from kvpool.models.hybrid_config import MambaConfig
from kvpool.models.parallel import (
    ONE_RANK,
    Index,
    RowLinear,
    Sharded,
    StackedColumnLinear,
    TensorParallel,
    row_parts,
)


class GatedRMSNorm(nn.Module, Sharded):
    """`y * silu(z)`, then RMS-normed within each group of `group_size` channels, in float32,
    and scaled by the learned weight (Mamba2's norm before out_proj). It holds the channels
    `part` of the whole: whole groups, or a piece of one group whose mean square the ranks
    holding its other pieces (under `tp`) add to."""

    def __init__(self, part: range, group_size: int, eps: float, dtype: torch.dtype,
                 tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(len(part), dtype=dtype))
        self.part, self.group_size, self.eps, self.tp = part, group_size, eps, tp
        self.piece = min(group_size, len(part))  # channels of a group this rank holds
        self.first_group = part.start // group_size
        self.num_groups = tp.size * len(part) // group_size  # groups of the whole

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z `[T, len(part)]` -> `[T, len(part)]` in y's dtype."""
        h = y.float() * F.silu(z.float())
        groups = h.view(h.shape[0], -1, self.piece)
        variance = groups.pow(2).mean(-1, keepdim=True)
        if self.piece < self.group_size:  # the group's mean square: its pieces' shares summed
            g = self.first_group
            whole = variance.new_zeros(h.shape[0], self.num_groups, 1)
            whole[:, g] = variance[:, 0] * (self.piece / self.group_size)
            variance = self.tp.all_reduce(whole)[:, g:g + 1]
        groups = groups * torch.rsqrt(variance + self.eps)
        return self.weight * groups.view_as(h).to(y.dtype)

    def checkpoint_index(self, name: str) -> Index:
        return row_parts(self.part)


class DepthwiseConv1d(nn.Conv1d, Sharded):
    """A depthwise nn.Conv1d holding the channels `parts` of a checkpoint's weight and bias,
    stacked in order (a mixer's x, B and C channels)."""

    def __init__(self, parts: tuple[range, ...], kernel: int, bias: bool, dtype: torch.dtype):
        channels = sum(len(part) for part in parts)
        super().__init__(channels, channels, kernel, groups=channels, bias=bias, dtype=dtype)
        self.rows = row_parts(*parts)

    def checkpoint_index(self, name: str) -> Index:
        return self.rows


class SlotMixer(nn.Module):
    """A mixer whose sequences each keep a state slot (conv and recurrent states, updated in
    place): a subclass computes one token each of several sequences (`_decode`) and a run of
    tokens of one sequence (`_prefill`), both from per-token inputs (tensors of T rows), and
    names the shape of its output per token (`output_shape`, computed in float32)."""

    output_shape: tuple[int, ...]

    def _mixed(self, inputs: tuple[torch.Tensor, ...], conv: torch.Tensor,
               ssm: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """A step with prefill chunks: one-token rows take a decode step together, each
        longer chunk its prefill in segments ending at its checkpoints, whose state is saved
        then. Row bounds come from the host copies of the lengths."""
        host, states = context.host, context.states
        cu, q_lens = host.query_starts, host.query_lens
        starts = [seq_len - n for seq_len, n in zip(host.seq_lens, q_lens, strict=True)]
        first = inputs[0]
        y = first.new_empty(first.shape[0], *self.output_shape, dtype=torch.float32)
        decodes = [b for b, n in enumerate(q_lens) if n == 1]
        if decodes:
            rows = torch.tensor([cu[b] for b in decodes], device=first.device)
            fresh = torch.tensor([starts[b] == 0 for b in decodes], device=first.device)
            slots = states.slots[torch.tensor(decodes, device=first.device)]
            y[rows] = self._decode(*(x[rows] for x in inputs), conv, ssm, slots, fresh)
        saves: dict[int, list[tuple[int, int]]] = {}  # sequence -> (tokens, checkpoint slot)
        for request in states.checkpoints:
            saves.setdefault(request.index, []).append((request.num_tokens, request.slot))
        for b, n in enumerate(q_lens):
            if n == 1:
                continue
            slot, begin = states.slots[b:b + 1], starts[b]
            for end, checkpoint in [*sorted(saves.get(b, ())), (starts[b] + n, None)]:
                if end > begin:
                    lo, hi = cu[b] + begin - starts[b], cu[b] + end - starts[b]
                    y[lo:hi] = self._prefill(*(x[lo:hi] for x in inputs), conv, ssm, slot,
                                             begin == 0)
                    begin = end
                if checkpoint is not None:
                    conv[checkpoint] = conv.index_select(0, slot)[0]
                    ssm[checkpoint] = ssm.index_select(0, slot)[0]
        return y

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """The causal depthwise convolution of `self.conv1d` over `window`
        `[..., channels, K - 1 + L]` -> `[..., channels, L]`, as K multiply-adds in float32
        (not cuDNN's conv1d, which computes float32 in TF32 on CUDA by default), cast back to
        the window's dtype."""
        weight = self.conv1d.weight[:, 0].float()  # [channels, K]
        k = weight.shape[-1]
        length = window.shape[-1] - (k - 1)
        out = sum(window[..., i:i + length].float() * weight[:, i, None] for i in range(k))
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias.float()[:, None]
        return out.to(window.dtype)


class Mamba2Mixer(SlotMixer, Sharded):
    """in_proj -> (gate z, conv inputs, dt); causal conv + SiLU -> (x, B, C); the SSM scan;
    gated norm; out_proj. Parameter names follow the Hugging Face checkpoints. Under `tp` it
    holds this rank's heads and groups (`self.m` is their geometry: MambaConfig.per_rank) and
    returns its partial sum."""

    def __init__(self, m: MambaConfig, hidden_size: int, eps: float, dtype: torch.dtype,
                 tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.m = m.per_rank(tp.size)
        self.heads = tp.part(m.num_heads, "mamba_n_heads")
        groups = tp.shared_part(m.num_groups, "mamba_n_groups")
        d, n, bc = m.head_dim, m.state_size, m.num_groups * m.state_size
        x = range(self.heads.start * d, self.heads.stop * d)
        b = range(groups.start * n, groups.stop * n)
        # the checkpoint's conv channels are x, B, C; its in_proj outputs z, x, B, C, dt
        conv = (x, _shift(b, m.intermediate_size), _shift(b, m.intermediate_size + bc))
        self.in_proj = StackedColumnLinear(
            hidden_size, (x, *(_shift(c, m.intermediate_size) for c in conv),
                          _shift(self.heads, m.intermediate_size + m.conv_dim)),
            m.proj_bias, dtype)
        self.conv1d = DepthwiseConv1d(conv, m.conv_kernel, m.conv_bias, dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.m.num_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(self.m.num_heads, dtype=dtype))
        self.D = nn.Parameter(torch.empty(self.m.num_heads, dtype=dtype))
        self.norm = GatedRMSNorm(x, m.intermediate_size // m.num_groups, eps, dtype, tp)
        self.out_proj = RowLinear(self.heads, d, hidden_size, m.proj_bias, dtype, tp)
        self.output_shape = (self.m.num_heads, self.m.head_dim)

    def checkpoint_index(self, name: str) -> Index:
        """dt_bias, A_log and D: one per head."""
        return row_parts(self.heads)

    def forward(self, hidden: torch.Tensor, context: ForwardContext,
                layer: int) -> torch.Tensor:
        """hidden `[T, hidden]` (packed sequences) -> `[T, hidden]`; updates the state slots
        of Mamba layer `layer` to the state after each sequence's last token. A decode-only
        step reads the host only through its batch size (a CUDA graph replays it); the
        checkpoints of one-token rows (the state the step leaves) are the runner's to save."""
        m, states = self.m, context.states
        z, xbc, dt = self.in_proj(hidden).split(
            [m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*m.time_step_limit)
        conv, ssm = states.pool.conv[layer], states.pool.ssm[layer]
        if context.host.decode_only:
            y = self._decode(xbc, dt, conv, ssm, states.slots, context.positions == 0)
        else:
            y = self._mixed((xbc, dt), conv, ssm, context)
        out = self.norm(y.view(hidden.shape[0], -1).to(hidden.dtype), z)
        return self.out_proj(out)

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor,
                ssm: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """One token each of B sequences: xbc `[B, conv_dim]`, dt `[B, heads]`, their state
        slots `[B]` and whether each starts from zeros `[B]` (device tensors all) -> y
        `[B, heads, head_dim]` float32; their conv and SSM states advance one step."""
        fresh = fresh[:, None, None]  # where, not a product: an unwritten slot may hold NaN
        past = torch.where(fresh, conv.new_zeros(()), conv[slots])
        window = torch.cat([past, xbc.unsqueeze(-1)], dim=-1)
        conv[slots] = window[..., 1:]
        x, B, C = self._split(F.silu(self._conv(window)[..., -1]))
        A = -torch.exp(self.A_log.float())
        h = torch.where(fresh[..., None], 0.0, ssm[slots].float())
        h = h * torch.exp(dt * A)[..., None, None] + (
            (dt[..., None] * x)[..., None] * B[:, :, None, :])
        ssm[slots] = h.to(ssm.dtype)
        return torch.einsum("bhpn,bhn->bhp", h, C) + self.D.float()[:, None] * x

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor,
                 ssm: torch.Tensor, slot: torch.Tensor, fresh: bool) -> torch.Tensor:
        """L tokens of one sequence: xbc `[L, conv_dim]`, dt `[L, heads]`, its state slot
        `[1]` (a device tensor) -> y `[L, heads, head_dim]` float32; the slot ends holding
        the state after the last of them."""
        m = self.m
        past = conv.index_select(0, slot)[0]
        past = torch.zeros_like(past) if fresh else past
        window = torch.cat([past, xbc.t()], dim=-1)  # [conv_dim, K - 1 + L]
        conv.index_copy_(0, slot, window[None, :, -(m.conv_kernel - 1):])
        x, B, C = self._split(F.silu(self._conv(window).t()))
        h0 = torch.zeros(m.num_heads, m.head_dim, m.state_size, device=xbc.device) if fresh \
            else ssm.index_select(0, slot)[0].float()
        y, h = chunked_scan(x, dt, -torch.exp(self.A_log.float()), B, C, h0, m.chunk_size)
        ssm.index_copy_(0, slot, h[None].to(ssm.dtype))
        return y + self.D.float()[:, None] * x

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs `[N, conv_dim]` -> float32 x `[N, heads, head_dim]` and B, C
        `[N, heads, state_size]` (each group's B and C repeated for its heads)."""
        m = self.m
        x, B, C = xbc.float().split(
            [m.intermediate_size, m.num_groups * m.state_size, m.num_groups * m.state_size],
            dim=-1)
        per_group = m.num_heads // m.num_groups
        B = B.view(-1, m.num_groups, m.state_size).repeat_interleave(per_group, dim=1)
        C = C.view(-1, m.num_groups, m.state_size).repeat_interleave(per_group, dim=1)
        return x.view(-1, m.num_heads, m.head_dim), B, C


def _shift(part: range, offset: int) -> range:
    return range(part.start + offset, part.stop + offset)


def chunked_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, h: torch.Tensor, chunk_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over L tokens of one sequence, `chunk_size` at a time (float32 throughout).

    x `[L, heads, head_dim]`, dt `[L, heads]`, A `[heads]` (negative), B and C
    `[L, heads, state_size]`, h `[heads, head_dim, state_size]` the state before the first
    token. Returns (y `[L, heads, head_dim]` without the D skip, the state after the last
    token). Within a chunk, token l reads token s <= l through `C_l . B_s` decayed by
    `exp(a_l - a_s)` (a: the running sum of dt * A from the chunk's start) and the chunk's
    initial state decayed by `exp(a_l)`."""
    outputs = []
    for begin in range(0, x.shape[0], chunk_size):
        xs, dts = x[begin:begin + chunk_size], dt[begin:begin + chunk_size]
        Bs, Cs = B[begin:begin + chunk_size], C[begin:begin + chunk_size]
        a = torch.cumsum(dts * A, dim=0)  # [l, heads]
        n = a.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        gaps = (a[:, None] - a[None]).masked_fill(~causal[..., None], float("-inf"))
        scores = torch.einsum("lhn,shn->lsh", Cs, Bs) * torch.exp(gaps)
        inputs = xs * dts[..., None]  # dt_s x_s: [l, heads, head_dim]
        y = torch.einsum("lsh,shp->lhp", scores, inputs)
        y = y + torch.einsum("lhn,hpn->lhp", Cs, h) * torch.exp(a)[..., None]
        to_end = torch.exp(a[-1] - a)  # decay from each token to the chunk's end
        h = h * torch.exp(a[-1])[:, None, None] + torch.einsum(
            "lh,lhp,lhn->hpn", to_end, inputs, Bs)
        outputs.append(y)
    return torch.cat(outputs), h
