"""Granite MoE (GraniteMoeForCausalLM) and GraniteMoeShared: Granite's multipliers with a
mixture of experts on every layer, whose experts the checkpoint stacks in one tensor per
layer (`block_sparse_moe.input_linear` holding each expert's gate and up rows,
`output_linear` its down projection), split per expert at load; against transformers,
through the engine, and their config and checkpoint checks."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from kvpool.engine import SamplingParams
from kvpool.errors import CheckpointError, ConfigError
from kvpool.models.config import ModelConfig
from kvpool.models.loader import check_splits, load_model
from kvpool.models.moe import MoE
from models_util import (
    SMALL,
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
from test_models import MAX_TOKENS

EXPERTS = {**SMALL, "intermediate_size": 32, "num_local_experts": 8}
MULTIPLIERS = dict(embedding_multiplier=2.5, residual_multiplier=0.6, attention_multiplier=0.3,
                   logits_scaling=3.0)
CONFIGS = {
    # 3 of 8 experts, Granite's four multipliers, biases on q, k, v and o
    "granitemoe": lambda: transformers.GraniteMoeConfig(
        **EXPERTS, num_experts_per_tok=3, attention_bias=True, **MULTIPLIERS),
    # 2 of 8 experts and a shared MLP 48 wide added to them, GELU in both, the head tied
    "granitemoe-shared": lambda: transformers.GraniteMoeSharedConfig(
        **EXPERTS, num_experts_per_tok=2, shared_intermediate_size=48, hidden_act="gelu",
        tie_word_embeddings=True, **MULTIPLIERS),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers model, the same checkpoint loaded by kvpool) for one case."""
    return loaded_pair(request.param, CONFIGS, tmp_path_factory.mktemp(request.param), device)


def test_packed_prefill_logits_match_transformers(pair):
    assert_prefill_logits_match(*pair)


def test_batched_greedy_decode_matches_transformers(pair):
    assert_greedy_decode_matches(*pair, MAX_TOKENS)


def test_each_expert_loads_its_gate_and_up_rows_and_its_down_projection_from_the_stack(pair):
    hf, model = pair
    for ours, theirs in zip(model.model.layers, hf.model.layers, strict=True):
        assert isinstance(ours.mlp, MoE)
        moe = theirs.block_sparse_moe
        assert torch.equal(ours.mlp.gate.weight, moe.router.weight)
        gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
        for expert, mlp in enumerate(ours.mlp.experts):
            assert torch.equal(mlp.gate_proj.weight, gate_up[expert, :32])
            assert torch.equal(mlp.up_proj.weight, gate_up[expert, 32:])
            assert torch.equal(mlp.down_proj.weight, down[expert])
        shared = getattr(theirs, "shared_mlp", None)
        assert (ours.mlp.shared_experts is None) == (shared is None)
        assert ours.mlp.shared_expert_gate is None  # GraniteMoeShared's is not gated
        if shared is not None:
            assert torch.equal(ours.mlp.shared_experts.gate_proj.weight,
                               shared.input_linear.weight[:48])
            assert torch.equal(ours.mlp.shared_experts.up_proj.weight,
                               shared.input_linear.weight[48:])
            assert torch.equal(ours.mlp.shared_experts.down_proj.weight,
                               shared.output_linear.weight)


# --- through the engine ---

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory, device):
    folder = tmp_path_factory.mktemp("granitemoe-shared-engine")
    return engine_case("granitemoe-shared", CONFIGS, folder, device, MAX_TOKENS)


def test_engine_greedy_outputs_with_prefix_hits_and_chunks_equal_transformers(case, device):
    check_engine_with_prefix_hits_and_chunks(case, device, GREEDY)


def test_engine_greedy_outputs_survive_preemption(case, device):
    check_engine_with_preemption(case, device, GREEDY)


# --- configs and checkpoints ---

BASE = {"architectures": ["GraniteMoeForCausalLM"], **SMALL}


def test_a_config_that_leaves_the_experts_out_routes_to_2_of_8_as_transformers():
    config = ModelConfig.from_hf(BASE)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 96)
    assert moe.layers == (0, 1) and moe.norm_topk_prob and moe.scoring == "softmax"
    assert (moe.shared_intermediate_size, moe.shared_gate) == (0, False)
    assert config.multipliers.attention == 1.0  # transformers' default: scores unscaled


def test_only_granite_moe_shared_reads_a_shared_mlp_width():
    def width(config: dict) -> int:
        return ModelConfig.from_hf(config).moe.shared_intermediate_size

    shared = {**BASE, "architectures": ["GraniteMoeSharedForCausalLM"]}
    assert width({**BASE, "shared_intermediate_size": 48}) == 0  # GraniteMoe has none
    assert width({**shared, "shared_intermediate_size": 48}) == 48
    assert width(shared) == 0  # transformers' default


@pytest.mark.parametrize(("model_type", "architecture"), [
    ("granitemoe", "GraniteMoeForCausalLM"), ("granitemoeshared", "GraniteMoeSharedForCausalLM")])
def test_a_config_without_architectures_is_read_by_its_model_type(model_type, architecture):
    assert ModelConfig.from_hf({"model_type": model_type, **SMALL}).architecture == architecture


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ({"num_local_experts": 0}, "'num_local_experts' must be a positive integer"),
    ({"shared_intermediate_size": -1}, "'shared_intermediate_size' must be an integer >= 0"),
    ({"shared_intermediate_size": 2**23},
     "'shared_intermediate_size' must be at most 4194304"),
    ({"residual_multiplier": 0}, "'residual_multiplier' must be a positive finite number"),
])
def test_unsupported_granite_moe_configs_name_the_field_and_value(change, message):
    config = {**BASE, "architectures": ["GraniteMoeSharedForCausalLM"], **change}
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf(config)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved GraniteMoeShared checkpoint folder; tests copy it before breaking it."""
    return save_hf_model(make_hf_model("granitemoe-shared", configs=CONFIGS),
                         tmp_path_factory.mktemp("granitemoe-shared"))


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("model.layers.1.block_sparse_moe.input_linear.weight", (7, 64, 64),
     "model.layers.1.block_sparse_moe.input_linear.weight has shape (7, 64, 64) in the "
     "checkpoint, the config needs 8 experts stacked along its first dimension"),
    ("model.layers.0.block_sparse_moe.input_linear.weight", (8, 60, 64),
     "model.layers.0.block_sparse_moe.input_linear.weight has 60 rows in the checkpoint, the "
     "config needs 64 (32 + 32)"),
    ("model.layers.0.block_sparse_moe.output_linear.weight", (8, 64),
     "model.layers.0.block_sparse_moe.output_linear.weight has shape (8, 64) in the "
     "checkpoint, the config needs 8 experts"),
    ("model.layers.0.shared_mlp.input_linear.weight", (100, 64),
     "model.layers.0.shared_mlp.input_linear.weight has 100 rows in the checkpoint, the "
     "config needs 96 (48 + 48)"),
    ("model.layers.0.shared_mlp.input_linear.weight", (),
     "model.layers.0.shared_mlp.input_linear.weight has shape () in the checkpoint, the "
     "config needs a matrix of 96 rows"),
])
def test_stacked_experts_of_the_wrong_shape_are_refused_naming_the_tensor(
        checkpoint, tmp_path, device, name, shape, message):
    for path in checkpoint.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    rewrite_weight(tmp_path, name, lambda _: torch.zeros(shape))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(tmp_path, device=device)


def test_a_shared_mlp_width_that_does_not_split_across_the_ranks_is_named_as_such():
    config = ModelConfig.from_hf({**BASE, "architectures": ["GraniteMoeSharedForCausalLM"],
                                  "intermediate_size": 32, "shared_intermediate_size": 17})
    with pytest.raises(ConfigError, match="the shared experts' intermediate size 17 does not "
                                          "split across 2 tensor-parallel ranks"):
        check_splits(config, 2)
