"""Mixtures of experts (DeepSeek's, GLM-4.5's, Ernie 4.5's, Qwen3-MoE's, GPT-OSS's): a router
(its logits with a bias: GPT-OSS) that picks `top_k` routed experts per token (Qwen3-MoE's and
DeepSeek-V2's softmax scores with greedy or group-limited choice, V3's and GLM-4.5's sigmoid
scores and Ernie 4.5's softmax ones with a bias that steers the choice only), the chosen
experts weighted (each with biases: GPT-OSS), and shared experts
applied to every token where the model has them. Numerics follow transformers'
default (grouped_mm) experts: softmax in float32 (DeepSeek routes in float32 throughout), each
expert's output weighted in the routing weights' dtype, and a token's experts summed in float32
and rounded once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.models.config import ModelConfig
from kvpool.models.layers import MLP
from kvpool.models.parallel import ONE_RANK, TensorParallel


class Router(nn.Module):
    """Scores every routed expert per token and picks `top_k` (checkpoint name: `gate`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.moe = moe = config.moe
        # DeepSeek's router weight is kept in float32 whatever the model's dtype, as
        # transformers keeps it: a float32 checkpoint's weight routes unrounded
        self.weight = nn.Parameter(torch.empty(
            moe.num_experts, config.hidden_size,
            dtype=torch.float32 if moe.router_in_float32 else dtype))
        if moe.router_bias:  # GPT-OSS's
            self.bias = nn.Parameter(torch.empty(moe.num_experts, dtype=self.weight.dtype))
        if moe.choice_bias_shape:  # kept in float32, as transformers keeps it
            self.register_buffer("e_score_correction_bias",
                                 torch.empty(moe.choice_bias_shape, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, hidden]` -> (weights `[T, top_k]`, float32 (DeepSeek, GLM-4.5, Mixtral) or
        x's dtype, expert ids `[T, top_k]`)."""
        moe = self.moe
        bias = self.bias if moe.router_bias else None
        if moe.router_in_float32:
            logits = F.linear(x.float(), self.weight, bias)
        else:
            logits = F.linear(x, self.weight, bias)
        if moe.scoring == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        else:
            scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias if moe.choice_bias_shape else scores
        if moe.topk_method != "greedy":
            choice = self._eligible_groups_only(choice)
        ids = choice.topk(moe.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            total = weights.sum(dim=-1, keepdim=True) + 1e-20
            weights = weights / total.clamp(min=moe.norm_min)
        weights = weights * moe.routed_scaling_factor
        return (weights if moe.weights_in_float32 else weights.to(x.dtype)), ids

    def _eligible_groups_only(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside each token's best `topk_groups` groups masked:
        a group scores by its best expert (V2) or the sum of its best two (V3)."""
        moe = self.moe
        grouped = choice.view(choice.shape[0], moe.num_groups, -1)
        if moe.topk_method == "group_limited_greedy":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(moe.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        masked = 0.0 if moe.scoring == "softmax" else float("-inf")  # as transformers masks
        return grouped.masked_fill(~keep[..., None], masked).view_as(choice)


class MoE(nn.Module):
    """`sum_e weight_e * expert_e(x)` over each token's routed experts, plus the shared
    experts (one MLP `shared_intermediate_size` wide; None where there are none), their
    output times `sigmoid(shared_expert_gate(x))` where the config gates it (Qwen2-MoE).
    Under tensor parallelism (`tp`) every expert holds this rank's share of its intermediate
    features, the router and the gate are whole, and the output is this rank's partial sum."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = ONE_RANK):
        super().__init__()
        moe, hidden = config.moe, config.hidden_size
        self.gate = Router(config, dtype)
        self.experts = nn.ModuleList(
            MLP(hidden, moe.intermediate_size, moe.expert_bias, dtype, config.hidden_act, tp,
                what="the experts' intermediate size")
            for _ in range(moe.num_experts))
        self.shared_experts = MLP(hidden, moe.shared_intermediate_size, config.mlp_bias, dtype,
                                  config.hidden_act, tp,
                                  what="the shared experts' intermediate size"
                                  ) if moe.shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype) \
            if moe.shared_gate else None

    def forward(self, x: torch.Tensor, static: bool) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`. `static` (decode steps): shapes independent of
        the routing, so a CUDA graph can replay it; otherwise only the chosen tokens go
        through each expert, which reads the routing on the host."""
        weights, ids = self.gate(x)
        routed = self.routed_static(x, weights, ids) if static else \
            self.routed_sparse(x, weights, ids)
        if self.shared_experts is None:
            return routed
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return routed + shared

    def routed_static(self, x: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
        """Every routed expert on every token, weighted by its routing weight, summed in
        float32; the experts a token did not choose add exactly 0 to it (masked, not weighted
        by 0: an unchosen expert's float16 output may overflow, and inf * 0 is NaN). It costs
        num_experts / top_k times the chosen experts' FLOPs (64 / 6 for DeepSeek-V2-Lite), but
        a decode step is bound by reading the experts' weights, and once the batch holds
        more than about num_experts / top_k tokens it reads nearly all of them anyway (128 / 8
        for Qwen3-MoE)."""
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype,
                            device=x.device).scatter_(1, ids, weights)  # [T, experts]
        chosen = torch.zeros_like(dense, dtype=torch.bool).scatter_(1, ids, True)
        out = torch.zeros_like(x, dtype=torch.float32)
        for expert, mlp in enumerate(self.experts):
            out += torch.where(chosen[:, expert, None], mlp(x) * dense[:, expert, None], 0)
        return out.to(x.dtype)

    def routed_sparse(self, x: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
        """Each expert on the tokens that chose it (prefill: the FLOPs of the chosen experts
        only; the expert ids are read on the host, so a CUDA graph cannot hold it)."""
        out = torch.zeros_like(x, dtype=torch.float32)
        for expert in ids.unique().tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            y = self.experts[expert](x[tokens]) * weights[tokens, slots, None]
            out.index_add_(0, tokens, y.float())
        return out.to(x.dtype)
