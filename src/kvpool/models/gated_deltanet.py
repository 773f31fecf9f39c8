"""Qwen3-Next's Gated DeltaNet: linear attention by the gated delta rule, reading and writing
its sequences' state slots.

Per token t, per value head: `S_t = exp(g_t) S_{t-1}`, then `S_t += k_t (beta_t (v_t -
S_t^T k_t))^T` (a recurrent state of head_k_dim x head_v_dim) and `o_t = S_t^T q_t`, where q,
k and v come out of a causal depthwise convolution (with SiLU) over the token's projections,
q and k L2-normed (q also scaled by head_k_dim^-1/2), `g = -exp(A_log) softplus(a + dt_bias)`
and `beta = sigmoid(b)`. Each key head serves num_v_heads / num_k_heads consecutive value
heads. A decode token takes one step of that recurrence; a prefill chunk runs the chunked form
(transformers' torch fallback: within a chunk the updates solved as one triangular system,
across chunks the recurrence on the chunk-end states). The output is RMS-normed per head,
times silu(z), and projected back. The state slot holds the last `conv_kernel - 1` conv
inputs and S after the sequence's last computed token; a sequence whose chunk starts at
position 0 starts from zeros and never reads its slot. It runs on one rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.forward_context import ForwardContext
from kvpool.models.hybrid_config import GatedDeltaNetConfig
from kvpool.models.mamba2 import SlotMixer

L2_EPS = 1e-6  # of q's and k's L2 norms, as transformers' (and the FLA library's)


class HeadGatedRMSNorm(nn.Module):
    """RMS-normed per head in float32, cast back, times the learned weight, then times
    silu(z) in float32 (Qwen3-Next's gated norm: the norm before the gate)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z `[..., size]` -> y's shape and dtype."""
        h = y.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(y.dtype) * F.silu(z.float())).to(y.dtype)


class GatedDeltaNet(SlotMixer):
    """in_proj_qkvz -> (q, k, v, gate z) and in_proj_ba -> (b, a), each grouped by key head
    as the Hugging Face checkpoints store them; causal conv + SiLU over q, k, v; the delta
    rule; the gated norm; out_proj. Parameter names follow the checkpoints."""

    def __init__(self, m: GatedDeltaNetConfig, hidden_size: int, eps: float,
                 dtype: torch.dtype):
        super().__init__()
        self.m = m
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * m.key_dim + 2 * m.value_dim,
                                      bias=False, dtype=dtype)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * m.num_v_heads, bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(m.conv_dim, m.conv_dim, m.conv_kernel, groups=m.conv_dim,
                                bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(m.num_v_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(m.num_v_heads, dtype=dtype))
        self.norm = HeadGatedRMSNorm(m.head_v_dim, eps, dtype)
        self.out_proj = nn.Linear(m.value_dim, hidden_size, bias=False, dtype=dtype)
        self.output_shape = (m.num_v_heads, m.head_v_dim)

    def forward(self, hidden: torch.Tensor, context: ForwardContext,
                layer: int) -> torch.Tensor:
        """hidden `[T, hidden]` (packed sequences) -> `[T, hidden]`; updates the state slots
        of state layer `layer` to the state after each sequence's last token. A decode-only
        step reads the host only through its batch size (a CUDA graph replays it)."""
        m, states, tokens = self.m, context.states, hidden.shape[0]
        per_key = m.num_v_heads // m.num_k_heads
        q, k, v, z = self.in_proj_qkvz(hidden).view(tokens, m.num_k_heads, -1).split(
            [m.head_k_dim, m.head_k_dim, per_key * m.head_v_dim, per_key * m.head_v_dim],
            dim=-1)
        b, a = self.in_proj_ba(hidden).view(tokens, m.num_k_heads, -1).split(
            [per_key, per_key], dim=-1)
        qkv = torch.cat([x.reshape(tokens, -1) for x in (q, k, v)], dim=-1)
        beta = b.reshape(tokens, -1).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(tokens, -1).float()
                                                   + self.dt_bias.float())
        conv, ssm = states.pool.conv[layer], states.pool.ssm[layer]
        if context.host.decode_only:
            y = self._decode(qkv, g, beta, conv, ssm, states.slots, context.positions == 0)
        else:
            y = self._mixed((qkv, g, beta), conv, ssm, context)
        out = self.norm(y.to(hidden.dtype), z.reshape(tokens, m.num_v_heads, m.head_v_dim))
        return self.out_proj(out.view(tokens, m.value_dim))

    def _decode(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                conv: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor,
                fresh: torch.Tensor) -> torch.Tensor:
        """One token each of B sequences: qkv `[B, conv_dim]`, g and beta `[B, v_heads]`,
        their state slots `[B]` and whether each starts from zeros `[B]` (device tensors
        all) -> o `[B, v_heads, head_v_dim]` float32; their states advance one step."""
        fresh = fresh[:, None, None]  # where, not a product: an unwritten slot may hold NaN
        past = torch.where(fresh, conv.new_zeros(()), conv[slots])
        window = torch.cat([past, qkv.unsqueeze(-1)], dim=-1)
        conv[slots] = window[..., 1:]
        q, k, v = self._split(F.silu(self._conv(window)[..., -1]))
        s = torch.where(fresh[..., None], 0.0, ssm[slots].float())  # [B, heads, dk, dv]
        s = s * g.exp()[..., None, None]
        delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta[..., None]
        s = s + k[..., None] * delta[..., None, :]
        ssm[slots] = s.to(ssm.dtype)
        return torch.einsum("bhkv,bhk->bhv", s, q)

    def _prefill(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 conv: torch.Tensor, ssm: torch.Tensor, slot: torch.Tensor,
                 fresh: bool) -> torch.Tensor:
        """L tokens of one sequence: qkv `[L, conv_dim]`, g and beta `[L, v_heads]`, its
        state slot `[1]` (a device tensor) -> o `[L, v_heads, head_v_dim]` float32; the slot
        ends holding the state after the last of them."""
        m = self.m
        past = conv.index_select(0, slot)[0]
        past = torch.zeros_like(past) if fresh else past
        window = torch.cat([past, qkv.t()], dim=-1)  # [conv_dim, K - 1 + L]
        conv.index_copy_(0, slot, window[None, :, -(m.conv_kernel - 1):])
        q, k, v = self._split(F.silu(self._conv(window).t()))
        s = torch.zeros(m.num_v_heads, m.head_k_dim, m.head_v_dim, device=qkv.device) \
            if fresh else ssm.index_select(0, slot)[0].float()
        o, s = chunked_delta_rule(q, k, v, g, beta, s, m.chunk_size)
        ssm.index_copy_(0, slot, s[None].to(ssm.dtype))
        return o

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs `[N, conv_dim]` -> float32 q and k `[N, v_heads, head_k_dim]` (each
        key head repeated for its value heads, L2-normed, q scaled by head_k_dim^-1/2) and v
        `[N, v_heads, head_v_dim]`."""
        m = self.m
        q, k, v = qkv.float().split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
        per_key = m.num_v_heads // m.num_k_heads
        q, k = (_l2norm(x.view(-1, m.num_k_heads, m.head_k_dim)).repeat_interleave(
            per_key, dim=1) for x in (q, k))
        return q * m.head_k_dim**-0.5, k, v.view(-1, m.num_v_heads, m.head_v_dim)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x over its last dimension divided by sqrt(sum of squares + L2_EPS), as transformers."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, s: torch.Tensor, chunk_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over L tokens of one sequence, `chunk_size` at a time (float32).

    q, k `[L, heads, dk]` (normed, q scaled), v `[L, heads, dv]`, g and beta `[L, heads]`, s
    `[heads, dk, dv]` the state before the first token. Returns (o `[L, heads, dv]`, the state
    after the last token). Within a chunk, the chunk's updates `u` solve the unit lower
    triangular system `(I + strictly lower (beta_i k_i . k_j decay_ij)) u = beta v`, and its keys'
    reads of the initial state likewise; across chunks, the recurrence on the chunk-end
    states, as transformers' torch_chunk_gated_delta_rule."""
    outputs = []
    for begin in range(0, q.shape[0], chunk_size):
        qs, ks, vs = (x[begin:begin + chunk_size].transpose(0, 1) for x in (q, k, v))
        gs, bs = (x[begin:begin + chunk_size].t() for x in (g, beta))  # [heads, n]
        n = gs.shape[1]
        decay = gs.cumsum(-1)  # [heads, n]
        strictly_upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        pairwise = (decay[:, :, None] - decay[:, None, :]).masked_fill(
            strictly_upper, float("-inf")).exp()  # [heads, n, n]
        k_beta, v_beta = ks * bs[..., None], vs * bs[..., None]
        system = (k_beta @ ks.mT) * pairwise  # its diagonal is read as ones
        u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
        k_decayed = torch.linalg.solve_triangular(
            system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
        v_new = u - k_decayed @ s
        attn = (qs @ ks.mT) * pairwise
        o = (qs * decay.exp()[..., None]) @ s + attn @ v_new
        to_end = (decay[:, -1:] - decay).exp()[..., None]
        s = s * decay[:, -1].exp()[:, None, None] + (ks * to_end).mT @ v_new
        outputs.append(o.transpose(0, 1))
    return torch.cat(outputs), s
