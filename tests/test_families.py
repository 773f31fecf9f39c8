"""Dense decoder families that are variations of ones kvpool runs, against transformers on
small random checkpoints, directly and through the engine, and how their configs are read:
OLMo 3 (OLMo 2 with sliding-window layers), Seed-OSS (Llama with its own biases), Arcee (Llama
with an ungated MLP), Ernie 4.5 (Llama rotating adjacent pairs), Apertus (Llama with q/k norms
and an ungated xIELU MLP), GLM-4 (post-norms, interleaved partial rotary, fused gate/up), the
first GLM-4 (GLM: the same without the post-norms) and EXAONE 4 (OLMo 2's layers with windows,
its full layers without RoPE)."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvpool.engine import SamplingParams
from kvpool.errors import ConfigError
from kvpool.models.config import FULL, SLIDING, ModelConfig
from kvpool.models.exaone4 import Exaone4DecoderLayer
from kvpool.models.layers import XIELU
from models_util import (
    SMALL,
    assert_greedy_decode_matches,
    assert_prefill_logits_match,
    check_engine_with_preemption,
    check_engine_with_prefix_hits_and_chunks,
    engine_case,
    loaded_pair,
)

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
WINDOW = 8  # shorter than every prompt but the first, and than every continuation
FOUR = dict(SMALL, num_hidden_layers=4)
CONFIGS = {
    # three sliding layers and a full one (the default pattern), the full one with yarn, the
    # sliding ones with plain RoPE; q/k/v/o biases
    "olmo3": lambda: transformers.Olmo3Config(
        **FOUR, sliding_window=WINDOW, attention_bias=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 64}),
    # Llama's layers with q/k/v biases (by default), an o bias of its own switch, MLP biases
    # and a head_dim other than hidden / heads
    "seed-oss": lambda: transformers.SeedOssConfig(**SMALL, head_dim=32, attention_out_bias=True,
                                                   mlp_bias=True),
    # Llama's attention with an ungated relu(x)^2 MLP, biases on q, k, v, o and the MLP
    "arcee": lambda: transformers.ArceeConfig(**SMALL, attention_bias=True, mlp_bias=True),
    # Llama's layers rotating adjacent pairs of q/k channels, every projection biased, the
    # head tied (by default)
    "ernie4_5": lambda: transformers.Ernie4_5Config(**SMALL, head_dim=16, use_bias=True),
    # q/k normed per head, an ungated xIELU MLP, norms under their own names, Llama 3.1's rope
    # scaling (by default); q/k/v/o biases
    "apertus": lambda: transformers.ApertusConfig(**SMALL, attention_bias=True),
    # norms after attention and the MLP too, the first half of each head rotated in adjacent
    # pairs, fused gate/up, q/k/v biases (by default)
    "glm4": lambda: transformers.Glm4Config(**SMALL, head_dim=16),
    # the first GLM-4: Llama's layers with GLM-4's attention and fused gate/up
    "glm": lambda: transformers.GlmConfig(**SMALL, head_dim=16),
    # OLMo 2's post-norms, q/k normed per head, three sliding layers rotated and a full one
    # without RoPE
    "exaone4": lambda: transformers.Exaone4Config(**FOUR, sliding_window=WINDOW),
    # ... without a window: every layer full and rotated
    "exaone4-no-window": lambda: transformers.Exaone4Config(
        **SMALL, sliding_window=None, layer_types=[FULL, FULL]),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers model, the same checkpoint loaded by kvpool) for one family's case."""
    return loaded_pair(request.param, CONFIGS, tmp_path_factory.mktemp(request.param), device)


def test_packed_prefill_logits_match_transformers(pair):
    assert_prefill_logits_match(*pair)


def test_batched_greedy_decode_matches_transformers_generate(pair):
    assert_greedy_decode_matches(*pair, MAX_TOKENS)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory, device):
    folder = tmp_path_factory.mktemp(f"{request.param}-engine")
    return engine_case(request.param, CONFIGS, folder, device, MAX_TOKENS)


def test_engine_greedy_outputs_with_prefix_hits_and_chunks_equal_transformers(case, device):
    check_engine_with_prefix_hits_and_chunks(case, device, GREEDY)


def test_engine_greedy_outputs_under_preemption_equal_transformers(case, device):
    check_engine_with_preemption(case, device, GREEDY)


# --- OLMo 3 ---

def olmo3(**options) -> dict:
    return {"architectures": ["Olmo3ForCausalLM"], **SMALL, **options}


def test_olmo3_windows_three_layers_in_four_and_rotates_them_by_plain_rope():
    config = ModelConfig.from_hf(olmo3(num_hidden_layers=8, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}))
    assert config.layer_types == (SLIDING, SLIDING, SLIDING, FULL) * 2
    assert (config.sliding_window, config.rope_theta, config.rms_norm_eps) == (4096, 5e5, 1e-5)
    assert config.rope_scaling["rope_type"] == "yarn"
    assert config.sliding_rope == (5e5, None)


@pytest.mark.parametrize("pair", ["olmo3"], indirect=True)
def test_olmo3_layers_each_get_the_window_and_rope_transformers_gives_them(pair):
    hf, model = pair
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows == [WINDOW if t == SLIDING else None for t in hf.config.layer_types]
    rotary = hf.model.rotary_emb
    assert (model.rotary_emb.inv_freq.cpu() == rotary.full_attention_inv_freq.cpu()).all()
    assert (model.local_rotary_emb.inv_freq.cpu()
            == rotary.sliding_attention_inv_freq.cpu()).all()


def test_olmo3_sliding_layers_without_a_window_are_refused():
    with pytest.raises(ConfigError, match="4 sliding_attention layer.*sliding_window is null"):
        ModelConfig.from_hf(olmo3(num_hidden_layers=5, sliding_window=None,
                                  layer_types=[SLIDING] * 4 + [FULL]))


# --- Seed-OSS ---

def test_seed_oss_biases_q_k_v_by_default_and_o_only_with_attention_out_bias():
    base = {"architectures": ["SeedOssForCausalLM"], **SMALL}
    config = ModelConfig.from_hf(base)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias, config.head_dim) == (
        True, False, False, 128)
    config = ModelConfig.from_hf({**base, "attention_bias": False, "attention_out_bias": True,
                                  "mlp_bias": True})
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (False, True, True)


# --- Arcee ---

def test_arcee_defaults_to_relu2_and_refuses_a_gated_activation():
    base = {"architectures": ["ArceeForCausalLM"], **SMALL}
    assert ModelConfig.from_hf(base).hidden_act == "relu2"
    with pytest.raises(ConfigError, match="hidden_act 'silu' for ArceeForCausalLM.*relu2"):
        ModelConfig.from_hf({**base, "hidden_act": "silu"})
    with pytest.raises(ConfigError, match="hidden_act 'relu2' for LlamaForCausalLM"):
        ModelConfig.from_hf({**base, "architectures": ["LlamaForCausalLM"],
                             "hidden_act": "relu2"})


# --- Ernie 4.5 ---

def test_ernie_biases_every_projection_by_use_bias_and_ties_its_head_by_default():
    base = {"architectures": ["Ernie4_5ForCausalLM"], **SMALL}
    config = ModelConfig.from_hf(base)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (False,) * 3
    assert (config.tie_word_embeddings, config.head_dim, config.rope_theta) == (True, 128, 5e5)
    config = ModelConfig.from_hf({**base, "use_bias": True, "tie_word_embeddings": False})
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (True,) * 3
    assert not config.tie_word_embeddings


@pytest.mark.parametrize("pair", ["ernie4_5"], indirect=True)
def test_ernie_reads_each_heads_even_then_odd_q_k_rows(pair):
    hf, model = pair
    attention, theirs = model.model.layers[0].self_attn, hf.model.layers[0].self_attn
    order = [h * 16 + i for h in range(4) for i in [*range(0, 16, 2), *range(1, 16, 2)]]
    assert (attention.q_proj.weight.cpu() == theirs.q_proj.weight.cpu()[order]).all()
    assert (attention.q_proj.bias.cpu() == theirs.q_proj.bias.cpu()[order]).all()
    assert (attention.v_proj.weight.cpu() == theirs.v_proj.weight.cpu()).all()


# --- Apertus ---

def test_apertus_defaults_to_xielu_and_llama3_rope_scaling():
    config = ModelConfig.from_hf({"architectures": ["ApertusForCausalLM"], **SMALL})
    assert (config.hidden_act, config.qk_norm, config.rope_theta) == ("xielu", True, 12e6)
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0,
                                   "original_max_position_embeddings": 8192,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    with pytest.raises(ConfigError, match="hidden_act 'silu' for ApertusForCausalLM"):
        ModelConfig.from_hf({"architectures": ["ApertusForCausalLM"], **SMALL,
                             "hidden_act": "silu"})


def test_xielu_equals_transformers_on_both_sides_of_zero():
    from transformers.activations import XIELUActivation

    theirs = XIELUActivation(alpha_p_init=1.3, alpha_n_init=0.9, beta=0.4, eps=-1e-3,
                             dtype=torch.float32)
    ours = XIELU(torch.float32)
    ours.load_state_dict(theirs.state_dict())
    x = torch.cat([torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3,
                   torch.tensor([0.0, -1e-4, 1e-4, -1e-3])])
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


# --- GLM-4 ---

def test_glm4_biases_q_k_v_not_o_and_rotates_half_of_each_head_by_default():
    config = ModelConfig.from_hf({"architectures": ["Glm4ForCausalLM"], **SMALL})
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (True, False, False)
    assert (config.head_dim, config.rotary_dim, config.rope_interleave) == (128, 64, True)


@pytest.mark.parametrize("pair", ["glm4"], indirect=True)
def test_glm4_reads_each_heads_rotary_rows_in_pairs_and_the_rest_as_they_are(pair):
    hf, model = pair
    attention, theirs = model.model.layers[0].self_attn, hf.model.layers[0].self_attn
    order = [h * 16 + i for h in range(2) for i in [0, 2, 4, 6, 1, 3, 5, 7, *range(8, 16)]]
    assert (attention.k_proj.weight.cpu() == theirs.k_proj.weight.cpu()[order]).all()
    assert (attention.k_proj.bias.cpu() == theirs.k_proj.bias.cpu()[order]).all()


# --- EXAONE 4 ---

def exaone4(**options) -> dict:
    return {"architectures": ["Exaone4ForCausalLM"], **SMALL, **options}


def test_exaone4_windows_three_layers_in_four_and_rotates_only_those():
    config = ModelConfig.from_hf(exaone4(num_hidden_layers=8))
    assert config.layer_types == (SLIDING, SLIDING, SLIDING, FULL) * 2
    assert (config.sliding_window, config.no_rope_layers, config.qk_norm) == (4096, (3, 7), True)
    config = ModelConfig.from_hf(exaone4(sliding_window=None, layer_types=[FULL, FULL]))
    assert (config.sliding_window, config.no_rope_layers) == (None, ())


@pytest.mark.parametrize(("options", "match"), [
    ({"sliding_window": None}, "sliding_window null needs 'layer_types'"),
    ({"sliding_window_pattern": "LLLG"}, "sliding_window_pattern"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
])
def test_exaone4_layer_types_transformers_cannot_derive_are_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(exaone4(**options))


def test_exaone4_takes_a_pattern_string_where_layer_types_are_given():
    config = ModelConfig.from_hf(exaone4(sliding_window=8, sliding_window_pattern="LLLG",
                                         layer_types=[SLIDING, FULL]))
    assert (config.layer_types, config.no_rope_layers) == ((SLIDING, FULL), (1,))


def test_exaone4_norms_round_to_bf16_before_their_scale_as_transformers():
    from transformers.models.exaone4.modeling_exaone4 import Exaone4RMSNorm

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=generator).to(torch.bfloat16)
    theirs = Exaone4RMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.2, generator=generator)
    ours = Exaone4DecoderLayer.norm(64, 1e-5, torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
