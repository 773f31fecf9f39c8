"""GraniteMoeHybrid (Granite 4.0's hybrids): Bamba's Mamba2 and attention layers, each
followed by Granite MoE's experts and shared MLP (or, without experts, the shared MLP alone),
with Granite's multipliers, its attention without RoPE unless the config asks for it; against
transformers, through the engine, and its config checks."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from hybrid_util import HybridRunner, make_bamba
from kvpool.engine import SamplingParams
from kvpool.errors import CheckpointError, ConfigError
from kvpool.models.config import ModelConfig
from kvpool.models.granite_hybrid import GraniteHybridForCausalLM
from kvpool.models.layers import MLP
from kvpool.models.loader import check_splits, load_model
from kvpool.models.moe import MoE
from models_util import (
    assert_logits_match,
    case_of,
    check_engine_with_preemption,
    check_engine_with_prefix_hits_and_chunks,
    hf_greedy,
    prompts,  # lengths 3, 9, 17, 26: one to four chunks of the mixer's 8,
    rewrite_weight,
    save_hf_model,
)

MAX_TOKENS = 32
SMALL_HYBRID = dict(
    vocab_size=160, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8,
    num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48,
    embedding_multiplier=2.5, residual_multiplier=0.6, attention_multiplier=0.3,
    logits_scaling=3.0, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,
)
CONFIGS = {
    # Granite 4.0's shape: no RoPE, the Mamba mixers' B and C in 2 groups
    "granite-hybrid": lambda: transformers.GraniteMoeHybridConfig(
        **SMALL_HYBRID, layer_types=["mamba", "attention", "mamba", "mamba"]),
    # RoPE, two attention layers, biases on q/k/v/o and the mixers' projections, 1 group,
    # the head tied
    "granite-hybrid-rope-biases-tied": lambda: transformers.GraniteMoeHybridConfig(
        **{**SMALL_HYBRID, "mamba_n_groups": 1}, position_embedding_type="rope",
        layer_types=["attention", "mamba", "mamba", "attention"], attention_bias=True,
        mamba_proj_bias=True, tie_word_embeddings=True),
    # no experts, as Granite 4.0 H Micro: the shared MLP (48 wide, not intermediate_size's
    # 32) is each layer's only MLP
    "granite-hybrid-dense": lambda: transformers.GraniteMoeHybridConfig(
        **{**SMALL_HYBRID, "num_local_experts": 0},
        layer_types=["mamba", "attention", "mamba", "attention"]),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers GraniteMoeHybrid, the same checkpoint loaded by kvpool)."""
    hf = make_bamba(request.param, configs=CONFIGS)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf.to(device), load_model(folder, device=device).model


def test_the_mixers_are_where_the_layer_types_say_and_the_mlps_as_transformers_has_them(pair):
    hf, model = pair
    assert isinstance(model, GraniteHybridForCausalLM)
    assert [hasattr(layer, "mamba") for layer in model.model.layers] == [
        layer.mamba is not None for layer in hf.model.layers]
    for ours, theirs in zip(model.model.layers, hf.model.layers, strict=True):
        shared = theirs.shared_mlp.input_linear.weight.chunk(2)  # gate rows, then up rows
        if theirs.block_sparse_moe is None:  # the shared MLP is the layer's MLP
            assert isinstance(ours.mlp, MLP)
            mlp = ours.mlp
        else:
            assert isinstance(ours.mlp, MoE)
            mlp = ours.mlp.shared_experts
        assert torch.equal(mlp.gate_proj.weight, shared[0])
        assert torch.equal(mlp.up_proj.weight, shared[1])
        assert torch.equal(mlp.down_proj.weight, theirs.shared_mlp.output_linear.weight)


def test_packed_prefill_logits_match_transformers(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    assert_logits_match(hf, batch, HybridRunner(model).step(batch, all_logits=True))


def test_batched_greedy_decode_matches_transformers_generate(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    runner = HybridRunner(model)
    ours = runner.greedy(batch, MAX_TOKENS)
    assert ours == {seq_id: hf_greedy(hf, prompt, MAX_TOKENS) for seq_id, prompt in batch.items()}
    runner.cache.check()
    runner.states.check()


# --- through the engine ---

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["granite-hybrid", "granite-hybrid-dense"])
def case(request, tmp_path_factory, device):
    return case_of(make_bamba(request.param, configs=CONFIGS),
                   tmp_path_factory.mktemp(f"{request.param}-engine"), device, MAX_TOKENS)


def test_engine_greedy_outputs_with_prefix_hits_and_chunks_equal_transformers(case, device):
    check_engine_with_prefix_hits_and_chunks(case, device, GREEDY)


def test_engine_greedy_outputs_survive_preemption(case, device):
    check_engine_with_preemption(case, device, GREEDY)


# --- configs ---

BASE = {"architectures": ["GraniteMoeHybridForCausalLM"], **SMALL_HYBRID}


@pytest.mark.parametrize("key", ["layer_types", "layers_block_type"])
@pytest.mark.parametrize(("types", "mamba"), [
    (["mamba", "attention", "mamba", "mamba"], (0, 2, 3)),
    (["linear_attention", "full_attention", "full_attention", "linear_attention"], (0, 3)),
])
def test_the_mamba_layers_are_read_under_either_key_and_either_names(key, types, mamba):
    config = ModelConfig.from_hf({**BASE, key: types})
    assert config.mamba.layers == mamba
    assert config.attention_layers == tuple(i for i in range(4) if i not in mamba)


@pytest.mark.parametrize(("kind", "unrotated"), [(None, (0, 1, 2, 3)), ("nope", (0, 1, 2, 3)),
                                                 ("rope", ())])
def test_attention_rotates_only_with_rope_position_embeddings(kind, unrotated):
    config = {**BASE, "layer_types": ["mamba", "attention"] * 2, "position_embedding_type": kind}
    assert ModelConfig.from_hf(config).no_rope_layers == unrotated


def test_the_shared_mlp_is_1024_wide_where_the_config_leaves_it_out_as_in_transformers():
    config = {key: value for key, value in BASE.items() if key != "shared_intermediate_size"}
    moe = ModelConfig.from_hf({**config, "layer_types": ["mamba", "attention"] * 2}).moe
    assert (moe.shared_intermediate_size, moe.shared_gate, moe.top_k) == (1024, False, 2)


@pytest.mark.parametrize(("shared", "width"), [({"shared_intermediate_size": 48}, 48),
                                               ({}, 1024)])  # transformers' default
def test_without_experts_the_shared_mlp_is_the_dense_mlp_of_every_layer(shared, width):
    config = {key: value for key, value in BASE.items() if key != "shared_intermediate_size"}
    ours = ModelConfig.from_hf({**config, **shared, "num_local_experts": 0,
                                "layer_types": ["mamba", "attention"] * 2})
    assert (ours.moe, ours.intermediate_size, ours.mlp_bias) == (None, width, False)
    assert not any(ours.is_moe_layer(i) for i in range(4))


def test_without_experts_a_shared_mlp_that_does_not_split_is_named_as_the_shared_mlp():
    config = ModelConfig.from_hf({**BASE, "num_local_experts": 0, "shared_intermediate_size": 50,
                                  "layer_types": ["mamba", "attention"] * 2})
    with pytest.raises(ConfigError, match=re.escape(
            "shared_intermediate_size 50 does not split across 4 tensor-parallel ranks")):
        check_splits(config, 4)


def test_a_shared_mlp_beside_the_mlp_it_would_load_as_is_refused_naming_both(tmp_path):
    folder = save_hf_model(make_bamba("granite-hybrid-dense", configs=CONFIGS), tmp_path)
    rewrite_weight(folder, "model.layers.2.mlp.up_proj.weight", lambda _: torch.zeros(48, 64))
    with pytest.raises(CheckpointError, match=re.escape(
            "model.layers.2.shared_mlp.input_linear.weight holds "
            "model.layers.2.mlp.up_proj.weight, which the checkpoint holds too")):
        load_model(folder, device="cpu")


HYBRID = ["mamba", "attention", "mamba", "attention"]


@pytest.mark.parametrize(("change", "message"), [
    ({}, "layer_types leaves no attention layer of its 4"),  # transformers' default: all Mamba
    ({"layer_types": ["attention"] * 4}, "layer_types leaves no state layer of its 4"),
    ({"layer_types": ["mamba", "attention", "mlp", "mamba"]},
     "'layer_types' must list one of linear_attention, mamba, full_attention, attention "
     "for each of the 4 layers"),
    ({"layer_types": ["mamba", "attention"]}, "for each of the 4 layers"),
    ({"layer_types": HYBRID, "num_local_experts": -1},
     "config 'num_local_experts' must be an integer >= 0 or null, got -1"),
    ({"layer_types": HYBRID, "num_local_experts": 0, "shared_intermediate_size": 0},
     "'shared_intermediate_size' must be a positive integer"),
    ({"layer_types": HYBRID, "position_embedding_type": "alibi"},
     "unsupported position_embedding_type 'alibi'"),
    ({"layer_types": HYBRID, "hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"layer_types": HYBRID, "shared_intermediate_size": 0},
     "'shared_intermediate_size' must be a positive integer"),
])
def test_unsupported_granite_hybrid_configs_name_the_field_and_value(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf({**BASE, **change})
