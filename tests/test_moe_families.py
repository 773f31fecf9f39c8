"""Mixture-of-experts families that are new cases of the MoE kvpool runs, against transformers
on small random checkpoints, directly and through the engine, and how their configs are read:
GLM-4.5 (GLM's partial rotary attention with q/k norms in Llama's layers, DeepSeek-V3's
routing and shared experts after its dense first layers) and Ernie 4.5's mixture of experts
(Ernie 4.5's attention, softmax routing whose choice a bias steers, shared experts, on the
layers its config names)."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvpool.engine import SamplingParams
from kvpool.errors import CheckpointError, ConfigError
from kvpool.models.config import ModelConfig
from kvpool.models.loader import load_model, model_class
from kvpool.models.moe import MoE
from kvpool.planning.planner import plan_memory
from models_util import (
    assert_greedy_decode_matches,
    assert_prefill_logits_match,
    check_engine_with_preemption,
    check_engine_with_prefix_hits_and_chunks,
    engine_case,
    loaded_pair,
    make_hf_model,
    rewrite_weight,
    save_hf_model,
)
from test_deepseek import V2_LITE, V3, with_an_extra_layer

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SMALL = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts_per_tok=3, max_position_embeddings=256, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
ERNIE = {**{key: value for key, value in SMALL.items() if key != "num_experts_per_tok"},
         "moe_num_experts": 8, "moe_k": 3}
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
    # Ernie 4.5's: a dense first layer (by default), one shared expert, the head tied (by
    # default)
    "ernie4_5-moe": lambda: transformers.Ernie4_5_MoeConfig(**ERNIE, moe_num_shared_experts=1),
    # experts on every second layer, no shared ones, and the chosen weights divided by 1
    # (moe_norm_min), more than their sum: left unnormalised
    "ernie4_5-moe-every-second": lambda: transformers.Ernie4_5_MoeConfig(
        **{**ERNIE, "num_hidden_layers": 4}, moe_layer_start_index=0, moe_layer_interval=2,
        moe_num_shared_experts=0, moe_norm_min=1.0),
    # experts up to the third of four layers, two shared experts, the head untied
    "ernie4_5-moe-end-index": lambda: transformers.Ernie4_5_MoeConfig(
        **{**ERNIE, "num_hidden_layers": 4}, moe_layer_start_index=0, moe_layer_end_index=2,
        tie_word_embeddings=False),
}
# the layers with experts in each case
MOE_LAYERS = {"glm4-moe": (1, 2), "glm4-moe-no-dense": (0, 1, 2), "ernie4_5-moe": (1, 2),
              "ernie4_5-moe-every-second": (1, 3), "ernie4_5-moe-end-index": (0, 1, 2)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers model, the same checkpoint loaded by kvpool) for one case."""
    return loaded_pair(request.param, CONFIGS, tmp_path_factory.mktemp(request.param), device)


def test_packed_prefill_logits_match_transformers(pair):
    assert_prefill_logits_match(*pair)


def test_batched_greedy_decode_matches_transformers_generate(pair):
    assert_greedy_decode_matches(*pair, MAX_TOKENS)


def test_the_layers_with_experts_are_transformers_and_hold_its_shared_experts(pair, request):
    hf, model = pair
    ours = tuple(i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoE))
    assert ours == MOE_LAYERS[request.node.callspec.params["pair"]]
    assert ours == tuple(i for i, layer in enumerate(hf.model.layers)
                         if hasattr(layer.mlp, "experts"))
    for i in ours:
        shared, theirs = model.model.layers[i].mlp.shared_experts, \
            hf.model.layers[i].mlp.shared_experts
        assert (shared is None) == (theirs is None)
        if shared is not None:
            assert shared.up_proj.weight.shape == theirs.up_proj.weight.shape


@pytest.fixture(scope="module", params=["glm4-moe", "ernie4_5-moe"])
def case(request, tmp_path_factory, device):
    return engine_case(request.param, CONFIGS, tmp_path_factory.mktemp(request.param), device,
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


def test_glm4_moe_refuses_tensors_of_a_layer_past_its_multi_token_prediction_layer(tmp_path,
                                                                                  device):
    hf = make_hf_model("glm4-moe", configs=CONFIGS)
    with pytest.raises(CheckpointError, match=r"unexpected weights: model\.layers\.4\.eh_proj"):
        load_model(with_an_extra_layer(save_hf_model(hf, tmp_path), layer=4), device=device)


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
    assert (moe.choice_bias_shape, moe.router_in_float32, moe.weights_in_float32) == \
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


# --- Ernie 4.5's configs and checkpoints ---

ERNIE_MOE = {"architectures": ["Ernie4_5_MoeForCausalLM"], **ERNIE}


def test_ernie_moe_loads_without_its_multi_token_prediction_modules(tmp_path, device):
    hf = make_hf_model("ernie4_5-moe", configs=CONFIGS)
    folder = save_hf_model(hf, tmp_path)
    for name in ("model.mtp_block.0.input_layernorm.weight", "model.mtp_emb_norm.0.weight"):
        rewrite_weight(folder, name, lambda _: torch.ones(64))
    model = load_model(folder, device=device).model
    assert len(model.model.layers) == 3


def test_ernie_moe_reads_transformers_defaults():
    config = ModelConfig.from_hf(ERNIE_MOE)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (False,) * 3
    assert (config.tie_word_embeddings, config.rope_theta, config.rope_interleave) == \
        (True, 5e5, True)
    assert config.head_dim == 16  # given; hidden_size / num_attention_heads where left out
    assert ModelConfig.from_hf({**ERNIE_MOE, "head_dim": None}).head_dim == 16
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 3, 32)  # ERNIE's
    assert (moe.shared_intermediate_size, moe.layers) == (64, (1, 2))  # 2 shared, from 1
    assert (moe.scoring, moe.topk_method, moe.norm_topk_prob, moe.norm_min) == \
        ("softmax", "greedy", True, 1e-12)
    assert (moe.choice_bias_shape, moe.router_in_float32, moe.weights_in_float32) == \
        ((1, 8), True, False)
    default = ModelConfig.from_hf({key: value for key, value in ERNIE_MOE.items()
                                   if key not in ("moe_num_experts", "moe_k")}).moe
    assert (default.num_experts, default.top_k) == (64, 6)


@pytest.mark.parametrize("base, names, values", [
    (ERNIE_MOE, {"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_k"}, (8, 2)),
    (GLM4_MOE, {"num_local_experts": "n_routed_experts"}, (8,)),
    (V2_LITE, {"num_experts": "n_routed_experts"}, (32,)),
    (V3, {"num_local_experts": "n_routed_experts"}, (128,)),
])
def test_the_keys_transformers_reads_under_another_name_are_read_so(base, names, values):
    """A config may name a setting as transformers' attribute_map does (transformers 5 saves
    some that way): read as the setting, and refused where the two names disagree."""
    cfg = {key: value for key, value in base.items() if key not in names.values()}
    moe = ModelConfig.from_hf({**cfg, **dict(zip(names, values, strict=True))}).moe
    assert (moe.num_experts, moe.top_k)[:len(values)] == values
    alias, name = next(iter(names.items()))
    with pytest.raises(ConfigError, match=rf"{alias}=9 and {name}=8 disagree"):
        ModelConfig.from_hf({**cfg, alias: 9, name: 8})


def test_ernie_moe_layers_are_every_interval_th_from_the_start_to_the_end_index():
    def layers(**change):
        moe = ModelConfig.from_hf({**ERNIE_MOE, "num_hidden_layers": 8, **change}).moe
        return None if moe is None else moe.layers

    assert layers() == (1, 2, 3, 4, 5, 6, 7)
    assert layers(moe_layer_start_index=2, moe_layer_interval=3) == (2, 5)
    assert layers(moe_layer_start_index=0, moe_layer_end_index=4, moe_layer_interval=2) == \
        (1, 3)
    assert layers(moe_layer_end_index=20) == (1, 2, 3, 4, 5, 6, 7)
    assert layers(moe_layer_start_index=5, moe_layer_end_index=4) is None


@pytest.mark.parametrize(("change", "message"), [
    ({"moe_num_experts": [8, 8]}, r"'moe_num_experts' is \[8, 8\], a value per modality"),
    ({"moe_layer_start_index": [1, 1]}, "'moe_layer_start_index' is .* a value per modality"),
    ({"moe_k": 9}, "moe_k=9 exceeds moe_num_experts=8"),
    ({"moe_layer_end_index": -2}, "'moe_layer_end_index' must be an integer >= -1"),
    ({"moe_layer_interval": 0}, "'moe_layer_interval' must be a positive integer"),
    ({"moe_num_experts": 2**17, "moe_k": 2**17},
     "'moe_num_experts' must be a positive integer at most 65536"),
    ({"moe_num_shared_experts": 2**11}, "'moe_num_shared_experts' must be at most 1024"),
    ({"moe_norm_min": -1.0}, "'moe_norm_min' must be a positive finite number"),
    ({"use_bias": True}, "use_bias=true is not supported for Ernie4_5_MoeForCausalLM"),
])
def test_ernie_moe_configs_kvpool_cannot_run_are_refused_naming_the_numbers(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**ERNIE_MOE, **change})


@pytest.fixture(scope="module")
def ernie_bf16(tmp_path_factory, device):
    """(transformers model, kvpool model) of one Ernie 4.5 MoE checkpoint, each loaded in
    bfloat16 (the router's weight and bias kept in float32)."""
    folder = save_hf_model(make_hf_model("ernie4_5-moe", configs=CONFIGS),
                           tmp_path_factory.mktemp("ernie4_5-moe-bf16"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model = load_model(folder, device=device, dtype=torch.bfloat16).model
    return hf.to(device), model


def test_a_bf16_ernie_router_scores_in_float32_and_weighs_in_bf16_as_transformers(
        ernie_bf16, device):
    hf, model = ernie_bf16
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(device,
                                                                          torch.bfloat16)
    weights, ids = model.model.layers[1].mlp.gate(x)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.model.layers[1].mlp.gate(x)
    assert hf.model.layers[1].mlp.gate.weight.dtype == torch.float32
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert weights.dtype == hf_weights.dtype == torch.bfloat16
    assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))


@pytest.mark.parametrize(("hf_config", "expected"), [
    # transformers' defaults, GLM-4.5-Air's shape (46 layers, 8 of 128 experts), with a
    # head_dim of 128 and q/k norms and biases on
    (lambda: transformers.Glm4MoeConfig(head_dim=128, use_qk_norm=True, attention_bias=True),
     106_852_263_040),
    # transformers' defaults, ERNIE-4.5-21B-A3B's shape (28 layers, 6 of 64 experts)
    (transformers.Ernie4_5_MoeConfig, 21_825_437_888),
])
def test_parameters_are_counted_exactly_as_transformers_builds_them(hf_config, expected):
    config = hf_config()
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    # GLM-4.5's correction biases are buffers in transformers, tensors of the checkpoint
    biases = sum(b.numel() for name, b in hf.named_buffers() if "e_score_correction" in name)
    assert sum(p.numel() for p in hf.parameters()) + biases == expected
    ours = ModelConfig.from_hf({**config.to_dict(),
                                "architectures": [type(hf).__name__]}).count_parameters()
    assert ours == expected


@pytest.mark.parametrize("source", [
    GLM4_MOE, ERNIE_MOE, {**V3, "num_hidden_layers": 5}, V2_LITE, "gpt-oss-20b",
    "Qwen3-30B-A3B",
], ids=["glm4-moe", "ernie4_5-moe", "deepseek-v3", "deepseek-v2-lite", "gpt-oss", "qwen3-moe"])
def test_the_plan_counts_the_bytes_a_bf16_model_holds_its_float32_routers_and_sinks_included(
        source):
    config = ModelConfig.from_hf(source)
    model = model_class(config)(config, dtype=torch.bfloat16, device="meta")
    tensors = [*model.parameters(), *(buffer for name, buffer in model.named_buffers()
                                      if name.endswith("e_score_correction_bias"))]
    held = sum(t.numel() * t.element_size() for t in tensors)
    plan = plan_memory(config, device_memory=2**50, dtype=torch.bfloat16)
    assert plan.weight_bytes == held
