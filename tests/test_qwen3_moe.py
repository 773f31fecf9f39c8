"""Qwen3-MoE (Qwen3 attention with q/k norms, a mixture of experts on the layers its config
names) against transformers, through the engine, its config checks, and the exact parameter
counts of the published models; and Mixtral, the same experts on every layer under other
checkpoint names."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvpool.engine import SamplingParams
from kvpool.errors import ConfigError
from kvpool.models.config import PRESETS, ModelConfig
from kvpool.models.loader import load_model
from kvpool.models.moe import MoE
from kvpool.planning.planner import plan_memory
from models_util import (
    PagedRunner,
    assert_greedy_decode_matches,
    assert_logits_match,
    assert_prefill_logits_match,
    check_engine_with_preemption,
    check_engine_with_prefix_hits_and_chunks,
    engine_case,
    hf_greedy,
    loaded_pair,
    make_hf_model,
    prompts,
    save_hf_model,
)
from test_models import MAX_TOKENS

SMALL = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=3, max_position_embeddings=256, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
CONFIGS = {
    # the published models' shape: renormalised top-k, experts on every layer but one dense
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, norm_topk_prob=True, mlp_only_layers=[1]),
    # experts on every second layer, weights not renormalised, attention biases
    "qwen3-moe-sparse-step-biases": lambda: transformers.Qwen3MoeConfig(
        **SMALL, norm_topk_prob=False, decoder_sparse_step=2, attention_bias=True),
    # Qwen2-MoE: Qwen2's attention (q/k/v biases, no q/k norms) and a shared expert whose
    # output a sigmoid gate scales, beside the routed ones
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **SMALL, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
}


# Mistral's attention windowed to 8 tokens, 2 of 8 experts on every layer, renormalised
MIXTRAL = {"mixtral-window-8": lambda: transformers.MixtralConfig(
    **{**SMALL, "intermediate_size": 32, "num_experts_per_tok": 2}, num_local_experts=8,
    sliding_window=8)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers model, the same checkpoint loaded by kvpool) for one Qwen3-MoE case."""
    return loaded_pair(request.param, CONFIGS, tmp_path_factory.mktemp(request.param), device)


def test_packed_prefill_logits_match_transformers(pair):
    assert_prefill_logits_match(*pair)


def test_batched_greedy_decode_matches_transformers(pair):
    assert_greedy_decode_matches(*pair, MAX_TOKENS)


def test_the_layers_the_config_names_hold_experts_and_the_others_a_dense_mlp(pair):
    hf, model = pair
    ours = [isinstance(layer.mlp, MoE) for layer in model.model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert ours == theirs
    assert ours in ([True, False, True], [False, True, False])
    # a shared expert (and its gate) only where transformers has one: Qwen2-MoE's
    assert [layer.mlp.shared_expert_gate is not None for layer in model.model.layers
            if isinstance(layer.mlp, MoE)] == [
        hasattr(layer.mlp, "shared_expert_gate") for layer in hf.model.layers
        if hasattr(layer.mlp, "experts")]
    assert all((layer.mlp.shared_experts is None) == (layer.mlp.shared_expert_gate is None)
               for layer in model.model.layers if isinstance(layer.mlp, MoE))


def test_mixtral_loads_its_renamed_experts_and_gives_transformers_logits_and_tokens(
        tmp_path, device):
    hf = make_hf_model("mixtral-window-8", configs=MIXTRAL).to(device)
    model = load_model(save_hf_model(hf, tmp_path), device=device).model
    assert all(isinstance(layer.mlp, MoE) for layer in model.model.layers)
    batch = prompts(model.config.vocab_size)  # up to 26 tokens: past the window
    assert_logits_match(hf, batch, PagedRunner(model).step(batch, all_logits=True))
    ours = PagedRunner(model).greedy(batch, MAX_TOKENS)
    assert ours == {seq_id: hf_greedy(hf, prompt, MAX_TOKENS) for seq_id, prompt in batch.items()}


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory, device):
    """(transformers model, kvpool model) of one checkpoint, both in bfloat16."""
    hf = make_hf_model("qwen3-moe", configs=CONFIGS)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("qwen3-moe-bf16"))
    model = load_model(folder, device=device, dtype=torch.bfloat16).model
    return hf.to(device=device, dtype=torch.bfloat16), model


def test_the_bf16_router_scores_in_bf16_and_takes_the_softmax_in_float32_as_transformers(
        bf16_pair, device):
    hf, model = bf16_pair
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(device,
                                                                          torch.bfloat16)
    weights, ids = model.model.layers[0].mlp.gate(x)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.model.layers[0].mlp.gate(x)
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert weights.dtype == torch.bfloat16
    assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_a_bf16_moe_block_equals_transformers_in_prefill_and_decode(bf16_pair, device):
    hf, model = bf16_pair
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).to(device,
                                                                          torch.bfloat16)
    moe = model.model.layers[0].mlp
    with torch.no_grad():
        expected = hf.model.layers[0].mlp(x[None])[0]
    for static in (False, True):  # each expert on its tokens; every expert on every token
        torch.testing.assert_close(moe(x, static), expected)


def test_a_float16_decode_step_stays_finite_where_an_expert_no_token_chose_overflows(
        tmp_path, device):
    # Expert 7 of the last layer is never chosen: its router logit is 0, and of each pair of
    # experts (0, 1), (2, 3), (4, 5) one scores above 0 (their logits are opposite). Its
    # weights are finite but its float16 output overflows, which transformers never
    # computes; a decode step runs every expert on every token.
    hf = make_hf_model("qwen3-moe", configs=CONFIGS)
    with torch.no_grad():
        moe = hf.model.layers[2].mlp
        moe.gate.weight[1:6:2] = -moe.gate.weight[0:6:2]
        moe.gate.weight[7] = 0.0
        moe.experts.gate_up_proj[7] *= 30.0
        moe.experts.down_proj[7] *= 300.0
    model = load_model(save_hf_model(hf, tmp_path), device=device, dtype=torch.float16).model
    hf = hf.to(device=device, dtype=torch.float16)
    batch = prompts(model.config.vocab_size, lengths=(12,))
    assert PagedRunner(model).greedy(batch, 4) == {
        seq_id: hf_greedy(hf, prompt, 4) for seq_id, prompt in batch.items()}


# --- through the engine ---

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory, device):
    folder = tmp_path_factory.mktemp("qwen3-moe-engine")
    return engine_case("qwen3-moe", CONFIGS, folder, device, MAX_TOKENS)


def test_engine_greedy_outputs_with_prefix_hits_and_chunks_equal_transformers(case, device):
    check_engine_with_prefix_hits_and_chunks(case, device, GREEDY)


def test_engine_greedy_outputs_survive_preemption(case, device):
    check_engine_with_preemption(case, device, GREEDY)


# --- configs and planning ---

# The published config.json of Qwen3-30B-A3B (kvpool's preset trims it to what kvpool reads)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_the_preset_is_the_published_config():
    assert ModelConfig.from_hf("Qwen3-30B-A3B") == ModelConfig.from_hf(QWEN3_30B_A3B)


@pytest.mark.parametrize(("name", "expected"), [
    ("Qwen3-30B-A3B", 30_532_122_624),  # "30.5B"
    ("Qwen3-235B-A22B", 235_093_634_560),  # "235B"
])
def test_parameters_are_counted_exactly_as_transformers_builds_them(name, expected):
    config = transformers.Qwen3MoeConfig.from_dict(PRESETS[name])
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(config)
    assert ModelConfig.from_hf(name).count_parameters() == expected
    assert expected == sum(p.numel() for p in hf.parameters())


def test_plan_holds_what_the_budget_leaves_after_the_experts_weights():
    plan = plan_memory(ModelConfig.from_hf("Qwen3-30B-A3B"), 80 * 2**30, activation_bytes=0)
    assert plan.weight_bytes == 30_532_122_624 * 2  # bf16: every expert is resident
    assert plan.layout.bytes_per_token == 98_304  # 48 layers x K and V x 4 heads x 128 x 2 bytes
    assert plan.num_pages == (int(80 * 2**30 * 0.9) - 30_532_122_624 * 2) // (16 * 98_304) - 1


def test_a_published_config_routes_to_8_of_128_experts_on_every_layer():
    moe = ModelConfig.from_hf(QWEN3_30B_A3B).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 8, 768)
    assert moe.layers == tuple(range(48)) and moe.norm_topk_prob
    assert moe.shared_intermediate_size == 0 and not moe.router_in_float32


def test_qwen2_moe_has_q_k_v_biases_unless_its_config_says_otherwise_as_transformers():
    config = {"architectures": ["Qwen2MoeForCausalLM"], **SMALL}
    assert ModelConfig.from_hf(config).qkv_bias
    assert not ModelConfig.from_hf({**config, "qkv_bias": False}).qkv_bias
    moe = ModelConfig.from_hf(config).moe  # transformers' defaults: 5,632 wide, gated
    assert (moe.shared_intermediate_size, moe.shared_gate) == (5632, True)


def test_qwen2_moes_shared_expert_takes_the_configs_activation_as_transformers(tmp_path, device):
    configs = {"qwen2-moe-gelu": lambda: transformers.Qwen2MoeConfig(
        **SMALL, shared_expert_intermediate_size=48, hidden_act="gelu")}
    hf = make_hf_model("qwen2-moe-gelu", configs=configs).to(device)
    model = load_model(save_hf_model(hf, tmp_path), device=device).model
    batch = prompts(model.config.vocab_size)
    assert_logits_match(hf, batch, PagedRunner(model).step(batch, all_logits=True))


def test_the_kv_layout_is_qwen3s_4_kv_heads_of_128():
    layout = ModelConfig.from_hf(QWEN3_30B_A3B).kv_layout()
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (48, 4, 128)
    assert layout.bytes_per_token == 48 * 2 * 4 * 128 * 2  # bf16: 96 KiB


def test_the_expert_count_is_read_under_either_name():
    renamed = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    moe = ModelConfig.from_hf(renamed | {"num_local_experts": 64}).moe
    assert moe.num_experts == 64


def test_experts_on_every_second_layer_but_the_listed_dense_ones():
    config = QWEN3_30B_A3B | {"num_hidden_layers": 8, "decoder_sparse_step": 2,
                              "mlp_only_layers": [3, 4]}
    assert ModelConfig.from_hf(config).moe.layers == (1, 5, 7)


def test_a_config_whose_layers_are_all_dense_has_no_experts():
    config = QWEN3_30B_A3B | {"num_hidden_layers": 2, "mlp_only_layers": [0, 1]}
    assert ModelConfig.from_hf(config).moe is None
    # transformers builds every layer dense without experts, whatever the top-k
    assert ModelConfig.from_hf(QWEN3_30B_A3B | {"num_experts": 0}).moe is None


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": 129}, "num_experts_per_tok=129 exceeds num_experts=128"),
    ({"num_local_experts": 64}, "num_experts=128 and num_local_experts=64 disagree"),
    ({"num_experts": -1}, "'num_experts' must be an integer >= 0"),
    ({"num_experts": 2**17}, "'num_experts' must be at most 65536"),
    ({"moe_intermediate_size": -1}, "'moe_intermediate_size' must be a positive integer"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be a positive integer"),
    ({"mlp_only_layers": [48]}, r"'mlp_only_layers' must list layer indices in \[0, 48\)"),
    ({"mlp_only_layers": "all"}, "'mlp_only_layers' must list layer indices"),
    ({"norm_topk_prob": "yes"}, "'norm_topk_prob' must be true or false"),
    ({"use_sliding_window": True, "sliding_window": 4096},
     "use_sliding_window=true is not supported"),
    ({"hidden_act": "tanh"}, "unsupported hidden_act 'tanh'"),
])
def test_unsupported_qwen3_moe_configs_name_the_field_and_value(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(QWEN3_30B_A3B | change)
