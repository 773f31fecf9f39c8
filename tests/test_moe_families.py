"""Mixture-of-experts families that are new cases of the MoE kvpool runs, against transformers
on small random checkpoints, directly and through the engine, and how their configs are read:
GLM-4.5 (GLM's partial rotary attention with q/k norms in Llama's layers, DeepSeek-V3's
routing and shared experts after its dense first layers)."""

from __future__ import annotations

import pytest
import transformers

from kvpool.engine import SamplingParams
from kvpool.errors import ConfigError
from kvpool.models.config import ModelConfig
from kvpool.models.loader import load_model
from kvpool.models.moe import MoE
from models_util import (
    assert_greedy_decode_matches,
    assert_prefill_logits_match,
    check_engine_with_preemption,
    check_engine_with_prefix_hits_and_chunks,
    engine_case,
    loaded_pair,
    make_hf_model,
    save_hf_model,
)
from test_deepseek import with_an_extra_layer

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SMALL = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts_per_tok=3, max_position_embeddings=256, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
CONFIGS = {
    # GLM-4.5's shape: a dense first layer, q/k/v biases, q/k normed per head, the choice
    # limited to 2 of 4 groups, the weights normalised and scaled, one shared expert
    "glm4-moe": lambda: transformers.Glm4MoeConfig(
        **SMALL, n_routed_experts=8, first_k_dense_replace=1, attention_bias=True,
        use_qk_norm=True, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    # GLM-4.5-Air's: experts on every layer, one group, no biases or q/k norms; here two
    # shared experts and the weights left unnormalised
    "glm4-moe-no-dense": lambda: transformers.Glm4MoeConfig(
        **SMALL, n_routed_experts=8, first_k_dense_replace=0, n_shared_experts=2,
        norm_topk_prob=False),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers model, the same checkpoint loaded by kvpool) for one case."""
    return loaded_pair(request.param, CONFIGS, tmp_path_factory.mktemp(request.param), device)


def test_packed_prefill_logits_match_transformers(pair):
    assert_prefill_logits_match(*pair)


def test_batched_greedy_decode_matches_transformers_generate(pair):
    assert_greedy_decode_matches(*pair, MAX_TOKENS)


def test_the_layers_with_experts_are_transformers_and_hold_its_shared_experts(pair):
    hf, model = pair
    ours = [isinstance(layer.mlp, MoE) for layer in model.model.layers]
    assert ours == [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert ours in ([False, True, True], [True, True, True])
    for layer, theirs in zip(model.model.layers, hf.model.layers, strict=True):
        if isinstance(layer.mlp, MoE):
            assert layer.mlp.shared_experts.up_proj.weight.shape == \
                theirs.mlp.shared_experts.up_proj.weight.shape


@pytest.fixture(scope="module")
def case(tmp_path_factory, device):
    return engine_case("glm4-moe", CONFIGS, tmp_path_factory.mktemp("glm4-moe-engine"), device,
                       MAX_TOKENS)


def test_engine_greedy_outputs_with_prefix_hits_and_chunks_equal_transformers(case, device):
    check_engine_with_prefix_hits_and_chunks(case, device, GREEDY)


def test_engine_greedy_outputs_survive_preemption(case, device):
    check_engine_with_preemption(case, device, GREEDY)


# --- GLM-4.5's configs and checkpoints ---

GLM4_MOE = {"architectures": ["Glm4MoeForCausalLM"], **SMALL}


def test_glm4_moe_loads_without_its_multi_token_prediction_layer(tmp_path, device):
    hf = make_hf_model("glm4-moe", configs=CONFIGS)
    model = load_model(with_an_extra_layer(save_hf_model(hf, tmp_path)), device=device).model
    assert len(model.model.layers) == 3


def test_glm4_moe_reads_transformers_defaults():
    config = ModelConfig.from_hf(GLM4_MOE)
    # no biases, no q/k norms; half of each head rotated as rotate-half, not in pairs
    assert (config.qkv_bias, config.o_bias, config.mlp_bias, config.qk_norm) == (False,) * 4
    assert (config.rotary_dim, config.rope_interleave) == (8, False)
    assert config.rms_norm_eps == 1e-5
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 3, 32)  # 3, 32: SMALL
    assert (moe.shared_intermediate_size, moe.layers) == (32, (1, 2))
    assert (moe.scoring, moe.topk_method, moe.num_groups, moe.topk_groups) == \
        ("sigmoid", "noaux_tc", 1, 1)
    assert (moe.norm_topk_prob, moe.routed_scaling_factor) == (True, 1.0)
    assert (moe.choice_bias, moe.router_in_float32, moe.weights_in_float32) == \
        ((128,), True, True)
    config = ModelConfig.from_hf({**GLM4_MOE, "attention_bias": True, "use_qk_norm": True})
    assert (config.qkv_bias, config.o_bias, config.qk_norm) == (True, False, True)


@pytest.mark.parametrize(("change", "message"), [
    ({"n_routed_experts": 8, "n_group": 3}, "n_routed_experts=8 is not a multiple of n_group=3"),
    ({"n_routed_experts": 8, "n_group": 2, "topk_group": 3}, "topk_group=3 exceeds n_group=2"),
    ({"n_routed_experts": 8, "n_group": 4, "topk_group": 1},
     "num_experts_per_tok=3 exceeds the 2 experts of the topk_group=1 eligible groups"),
    ({"n_routed_experts": 8, "n_group": 8, "topk_group": 4},
     "scores a group by its best two experts; a group holds 1"),
    ({"use_qk_norm": "yes"}, "'use_qk_norm' must be true or false"),
    ({"partial_rotary_factor": 0.25, "head_dim": 4}, r"rotates int\(4 \* 0.25\) = 1 channels"),
])
def test_glm4_moe_configs_kvpool_cannot_run_are_refused_naming_the_numbers(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**GLM4_MOE, **change})
