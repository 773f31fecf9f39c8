"""Helpers for the hybrid-model tests: small random Bamba checkpoints, and a runner that drives
a kvpool hybrid model over a KVCache and a MambaPool in packed steps."""

from __future__ import annotations

import random

import torch
import transformers
from packaging.version import Version

from kvpool.cache import KVCache, StateSpec
from kvpool.memory.state_pool import MambaPool, StateBatch
from models_util import packed_context

SMALL_BAMBA = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
    mamba_chunk_size=8, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,
)
BAMBA_CONFIGS = {
    "bamba": lambda: transformers.BambaConfig(**SMALL_BAMBA),
    "bamba-biases-tied-two-attention": lambda: transformers.BambaConfig(
        **{**SMALL_BAMBA, "attn_layer_indices": [0, 3], "mamba_n_groups": 1},
        mamba_proj_bias=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
}
# Mamba2's gated RMSNorm normalises each of mamba_n_groups channel groups apart (mamba_ssm's
# RMSNormGated with group_size = d_ssm // ngroups, which its fused kernel and Bamba's training
# use). transformers' BambaRMSNormGated normalised all of intermediate_size at once until 5.23,
# which gave it a group_size (Mamba2 and GraniteMoeHybrid alike); with 2 groups the two differ.
HF_BAMBA_NORM_IS_GROUPED = Version(transformers.__version__) >= Version("5.23")


def make_bamba(name: str, seed: int = 0, configs=BAMBA_CONFIGS) -> transformers.PreTrainedModel:
    """A small random float32 Bamba of configs[name]. Norm scales, biases, A_log, D and
    dt_bias are randomised too (transformers initialises them to constants). Before
    transformers 5.23 its mixers get transformers' own grouped gated norm (see above)."""
    torch.manual_seed(seed)
    config = configs[name]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if not HF_BAMBA_NORM_IS_GROUPED:
        _group_the_gated_norms(model)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(1.0, 0.2)
            elif param_name.endswith((".bias", ".dt_bias", ".D")):
                param.normal_(0.0, 0.5)
            elif param_name.endswith(".A_log"):
                param.uniform_(-1.0, 1.5)
    return model


def _group_the_gated_norms(model: transformers.PreTrainedModel) -> None:
    """Replaces each mixer's norm by Zamba2RMSNormGated, the code transformers 5.23 gave
    BambaRMSNormGated, normalising each of the mixer's groups apart."""
    from transformers.models.zamba2.modeling_zamba2 import Zamba2RMSNormGated

    mixers = [module for name, module in model.named_modules() if name.endswith(".mamba")]
    for mixer in mixers:
        mixer.norm = Zamba2RMSNormGated(mixer.intermediate_size,
                                        mixer.intermediate_size // mixer.n_groups,
                                        eps=mixer.layer_norm_epsilon)


class HybridRunner:
    """Runs packed forward passes of a hybrid model for several sequences: pages from a KVCache
    handed out in shuffled order, one state slot each from a MambaPool whose unwritten
    states are NaN (a sequence's first step must not read its slot), all on the model's
    device."""

    def __init__(self, model, *, num_pages: int = 128, page_size: int = 4, num_slots: int = 8,
                 seed: int = 0):
        config, device = model.config, next(model.parameters()).device
        self.model = model
        self.cache = KVCache(config.kv_layout(dtype=model.dtype, page_size=page_size),
                             num_pages, device=device)
        pages = self.cache.allocator.allocate(num_pages)
        random.Random(seed).shuffle(pages)
        self.cache.allocator.free(pages)
        self.cache.pool.kv.fill_(float("nan"))
        self.states = MambaPool(config.mamba_layout(dtype=model.dtype), num_slots, device=device)
        self.states.conv.fill_(float("nan"))
        self.states.ssm.fill_(float("nan"))
        self.slots: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]], *, all_logits: bool = False) -> torch.Tensor:
        """One forward pass over the new tokens of each sequence (created on first sight)."""
        seq_ids = list(chunks)
        starts, ends = [], []
        for seq_id, tokens in chunks.items():
            if seq_id in self.slots:
                starts.append(self.cache.num_tokens(seq_id))
                self.cache.append(seq_id, len(tokens))
            else:
                starts.append(0)
                self.cache.add_sequence(seq_id, num_tokens=len(tokens))
                self.slots[seq_id] = self.states.allocate()
            ends.append(self.cache.num_tokens(seq_id))
        input_ids = [t for tokens in chunks.values() for t in tokens]
        states = StateBatch(self.states, torch.tensor([self.slots[s] for s in seq_ids],
                                                      device=self.cache.device))
        return self.model(packed_context(
            self.cache.pool, input_ids, starts, ends,
            [self.cache.slot_mapping(seq_ids, starts, ends)],
            [self.cache.page_tables(seq_ids)], all_logits=all_logits, states=states))

    def greedy(self, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
        """Prefill all prompts in one pass, then decode all together."""
        out: dict[str, list[int]] = {seq_id: [] for seq_id in prompts}
        chunks = prompts
        for _ in range(max_tokens):
            next_tokens = self.step(chunks).argmax(-1).tolist()
            for seq_id, token in zip(prompts, next_tokens, strict=True):
                out[seq_id].append(token)
            chunks = {seq_id: [tokens[-1]] for seq_id, tokens in out.items()}
        return out


def hybrid_cache(layout, num_pages, mamba_layout, num_slots, *, num_checkpoint_slots=0,
                 checkpoint_interval=64, track_interval=256, **options) -> KVCache:
    """A KVCache of one full-attention group of `layout` and a state group of `mamba_layout`."""
    spec = StateSpec(mamba_layout, num_slots, num_checkpoint_slots, checkpoint_interval,
                     track_interval)
    return KVCache(layout, num_pages, states=spec, **options)
