"""GPT-OSS (GptOssForCausalLM): Llama's attention with q/k/v/o biases and a learned sink logit
per head in each softmax, sliding-window and full layers alternating, YaRN without truncation,
and experts on every layer (a router with a bias, the softmax of the chosen experts' logits,
experts with biases and a clamped SwiGLU) stacked in the checkpoint as x @ W, gate and up
columns interleaved, split per expert at load; against transformers, through the engine, and
its config and checkpoint checks."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from kvpool.engine import SamplingParams
from kvpool.errors import CheckpointError, ConfigError
from kvpool.models.config import FULL, SLIDING, ModelConfig
from kvpool.models.layers import ACTIVATIONS
from kvpool.models.loader import load_model
from kvpool.models.moe import MoE
from models_util import (
    SMALL,
    assert_greedy_decode_matches,
    assert_prefill_logits_match,
    case_of,
    check_engine_with_preemption,
    check_engine_with_prefix_hits_and_chunks,
    hf_logits,
    make_hf_model,
    prompts,
    rewrite_weight,
    save_hf_model,
)
from test_models import MAX_TOKENS

EXPERTS = {**SMALL, "intermediate_size": 32, "num_local_experts": 8, "head_dim": 16}


def gpt_oss(sliding_window: int) -> transformers.GptOssConfig:
    """3 of 8 experts, a window of `sliding_window` tokens on the first layer, yarn 4x over
    64 positions."""
    return transformers.GptOssConfig(
        **EXPERTS, num_experts_per_tok=3, sliding_window=sliding_window,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                         "original_max_position_embeddings": 64})


CONFIGS = {
    "gpt-oss": lambda: gpt_oss(4),
    # 2 of 8 experts, three layers (window, full, window) of 8 tokens, transformers' default
    # rope (yarn 32x over 4,096 positions), the head tied
    "gpt-oss-default-rope": lambda: transformers.GptOssConfig(
        **{**EXPERTS, "num_hidden_layers": 3}, num_experts_per_tok=2, sliding_window=8,
        tie_word_embeddings=True),
}
GATE_SPREAD = 4.0  # the experts' gate/up weights times this: some of both pass the clamp


def make_gpt_oss(name: str) -> transformers.PreTrainedModel:
    """make_hf_model of CONFIGS[name], the experts' biases random too (transformers
    initialises them to 0) and their gate/up projections GATE_SPREAD times wider, so that the
    SwiGLU's clamps bite."""
    hf = make_hf_model(name, configs=CONFIGS)
    with torch.no_grad():
        for layer in hf.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.mul_(GATE_SPREAD)
            experts.gate_up_proj_bias.normal_(0.0, 0.5)
            experts.down_proj_bias.normal_(0.0, 0.2)
    return hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers model, the same checkpoint loaded by kvpool) for one case."""
    hf = make_gpt_oss(request.param)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf.to(device), load_model(folder, device=device).model


def test_packed_prefill_logits_match_transformers(pair):
    assert_prefill_logits_match(*pair)


def test_batched_greedy_decode_matches_transformers(pair):
    assert_greedy_decode_matches(*pair, MAX_TOKENS)


def test_each_expert_loads_its_interleaved_columns_of_the_stack_transposed(pair):
    hf, model = pair
    for ours, theirs in zip(model.model.layers, hf.model.layers, strict=True):
        assert isinstance(ours.mlp, MoE)
        assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks)
        router = theirs.mlp.router
        assert torch.equal(ours.mlp.gate.weight, router.weight)
        assert torch.equal(ours.mlp.gate.bias, router.bias)
        experts = theirs.mlp.experts
        for expert, mlp in enumerate(ours.mlp.experts):
            gate_up, bias = experts.gate_up_proj[expert], experts.gate_up_proj_bias[expert]
            assert torch.equal(mlp.gate_proj.weight, gate_up[:, 0::2].T)
            assert torch.equal(mlp.up_proj.weight, gate_up[:, 1::2].T)
            assert torch.equal(mlp.gate_proj.bias, bias[0::2])
            assert torch.equal(mlp.up_proj.bias, bias[1::2])
            assert torch.equal(mlp.down_proj.weight, experts.down_proj[expert].T)
            assert torch.equal(mlp.down_proj.bias, experts.down_proj_bias[expert])


def test_the_sinks_take_weight_from_every_row():
    # The sinks matter to these checkpoints: without them the logits move far past 1e-4.
    hf = make_gpt_oss("gpt-oss")
    prompt = prompts(hf.config.vocab_size)["seq3"]
    with_sinks = hf_logits(hf, prompt)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert (hf_logits(hf, prompt) - with_sinks).abs().max() > 0.1


def test_the_clamped_swiglu_is_transformers_and_bites_at_7():
    hf = make_gpt_oss("gpt-oss")
    experts = hf.model.layers[0].mlp.experts
    gate_up = torch.randn(50, 64, generator=torch.Generator().manual_seed(0)) * 8
    expected = experts._apply_gate(gate_up)
    ours = ACTIVATIONS["gpt_oss_swiglu"](gate_up[:, 0::2], gate_up[:, 1::2])
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    unclamped = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    assert (unclamped - expected).abs().max() > 1.0


# --- through the engine ---

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory, device):
    folder = tmp_path_factory.mktemp("gpt-oss-engine")
    return case_of(make_gpt_oss("gpt-oss"), folder, device, MAX_TOKENS)


def test_engine_greedy_outputs_with_prefix_hits_and_chunks_equal_transformers(case, device):
    check_engine_with_prefix_hits_and_chunks(case, device, GREEDY)


def test_engine_greedy_outputs_survive_preemption(case, device):
    check_engine_with_preemption(case, device, GREEDY)


# --- configs and checkpoints ---

BASE = {"architectures": ["GptOssForCausalLM"], **SMALL}


def test_a_config_that_leaves_its_settings_out_reads_them_as_transformers():
    config = ModelConfig.from_hf({**BASE, "num_hidden_layers": 4})
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 4, 96)
    assert moe.layers == (0, 1, 2, 3) and moe.norm_topk_prob and moe.scoring == "softmax"
    assert moe.router_bias and moe.expert_bias and moe.shared_intermediate_size == 0
    assert config.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert config.sliding_window == 128 and config.head_dim == 64
    assert config.qkv_bias and config.o_bias and config.attention_sinks
    assert config.rope_theta == 150000.0
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False,
                                   "original_max_position_embeddings": 4096}
    assert config.hidden_act == "gpt_oss_swiglu"


def test_a_config_without_architectures_is_read_by_its_model_type():
    assert ModelConfig.from_hf({"model_type": "gpt_oss", **SMALL}).architecture == \
        "GptOssForCausalLM"


@pytest.mark.parametrize(("key", "value"), [("swiglu_limit", 10.0), ("swiglu_alpha", 1.5)])
def test_another_swiglu_gain_or_clamp_is_refused_naming_both_values(key, value):
    default = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}[key]
    with pytest.raises(ConfigError, match=rf"{key} {value} is not supported .* {key} "
                                          rf"{default}"):
        ModelConfig.from_hf({**BASE, key: value})


def test_a_stack_whose_columns_do_not_split_in_two_is_refused_naming_its_shape(tmp_path):
    folder = save_hf_model(make_hf_model("gpt-oss", configs=CONFIGS), tmp_path)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    rewrite_weight(folder, name, lambda stack: stack[..., :-1])
    with pytest.raises(CheckpointError, match=re.escape(f"{name} has shape (8, 64, 63)")):
        load_model(folder, device="cpu")


def test_a_stack_of_another_width_is_refused_naming_the_experts_tensors(tmp_path):
    folder = save_hf_model(make_hf_model("gpt-oss", configs=CONFIGS), tmp_path)
    name = "model.layers.1.mlp.experts.down_proj"
    rewrite_weight(folder, name, lambda stack: stack[:, :-2])
    with pytest.raises(CheckpointError, match=re.escape(
            "model.layers.1.mlp.experts.0.down_proj.weight has shape (64, 30) in the "
            "checkpoint, the config needs (64, 32)")):
        load_model(folder, device="cpu")


@pytest.mark.parametrize(("name", "change", "shape"), [
    ("model.layers.0.mlp.experts.gate_up_proj", lambda t: t[:7], "(7, 64, 64)"),
    ("model.layers.0.mlp.experts.gate_up_proj", lambda t: t[0], "(64, 64)"),
    ("model.layers.0.mlp.experts.down_proj_bias", lambda t: t[:, None], "(8, 1, 64)"),
])
def test_a_stack_of_another_number_of_experts_or_dimensions_is_refused_naming_it(
        tmp_path, name, change, shape):
    folder = save_hf_model(make_hf_model("gpt-oss", configs=CONFIGS), tmp_path)
    rewrite_weight(folder, name, change)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{name} has shape {shape} in the checkpoint, the config needs 8 experts stacked")):
        load_model(folder, device="cpu")


def test_an_expert_weight_held_in_the_stack_and_apart_is_refused_naming_both(tmp_path):
    folder = save_hf_model(make_hf_model("gpt-oss", configs=CONFIGS), tmp_path)
    rewrite_weight(folder, "model.layers.0.mlp.experts.0.gate_proj.weight",
                   lambda _: torch.zeros(32, 64))
    with pytest.raises(CheckpointError, match=re.escape(
            "model.layers.0.mlp.experts.gate_up_proj holds "
            "model.layers.0.mlp.experts.0.gate_proj.weight, which the checkpoint holds too")):
        load_model(folder, device="cpu")


@pytest.mark.parametrize(("preset", "layers", "experts", "parameters"), [
    ("gpt-oss-20b", 24, 32, 20_914_757_184),  # "21B" (20.9B)
    ("gpt-oss-120b", 36, 128, 116_829_156_672),  # "117B" (116.8B): transformers' defaults
])
def test_the_presets_count_the_published_parameters_as_transformers_builds_them(
        preset, layers, experts, parameters):
    config = ModelConfig.from_hf(preset)
    published = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
    assert config == ModelConfig.from_hf(
        {**published.to_dict(), "architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16"})
    assert config.count_parameters() == parameters
    with torch.device("meta"):
        assert sum(p.numel() for p in transformers.GptOssForCausalLM(published).parameters()) \
            == parameters
