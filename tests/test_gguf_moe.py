"""GGUF files of GLM-4.5 (`glm4moe`: its multi-token-prediction layer after the model's,
skipped) and Ernie 4.5 (`ernie4_5`, `ernie4_5-moe`): written here from random transformers
models as llama.cpp's converter writes them, against transformers, through the engine, and
the metadata kvpool refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from kvpool.errors import ConfigError
from kvpool.models import load_config, load_model
from models_util import SMALL as SMALL_DENSE
from models_util import (
    assert_greedy_decode_matches,
    assert_prefill_logits_match,
    make_hf_model,
)
from test_gguf import (
    _add_tensors,
    _assert_conversion_matches,
    _check_engine_on_gguf,
    _finish,
    _gguf_pair,
    _hf_weights,
    _stacked,
    _writer,
)
from test_models import MAX_TOKENS
from test_moe_families import CONFIGS as MOE_CONFIGS
from test_moe_families import ERNIE as MOE_ERNIE
from test_moe_families import MOE_LAYERS, SMALL

gguf = pytest.importorskip("gguf")

# --- GLM-4.5 (glm4moe) ---

def glm4moe_gguf_of(hf: transformers.PreTrainedModel, path, nextn: int = 1, more=None) -> None:
    """The file llama.cpp's converter writes for a transformers GLM-4.5: `glm4moe` with
    `nextn` multi-token-prediction layers after the model's (counted in block_count: a copy
    of the last layer with the nextn tensors, random), the rotated share of each head as
    `rope.dimension_count`, the routing keys and sigmoid gating; names from the gguf
    package's map, each layer's experts stacked, q/k rows in order; what `more(writer)` adds;
    float32, placeholder tokens."""
    config = hf.config
    layers, hidden = config.num_hidden_layers, config.hidden_size
    writer = _writer(path, "glm4moe", config, block_count=layers + nextn)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(config.head_dim * rope["partial_rotary_factor"]))
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    if more is not None:
        more(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, layers + nextn)
    weights = _hf_weights(hf, path)
    last, rng = f"model.layers.{layers - 1}.", np.random.default_rng(0)
    for n in range(layers, layers + nextn):  # the MTP layer: a full layer and its own tensors
        weights.update({name.replace(last, f"model.layers.{n}."): tensor.clone()
                        for name, tensor in weights.items() if name.startswith(last)})
        for own, shape in (("eh_proj.weight", (hidden, 2 * hidden)), ("enorm.weight", (hidden,)),
                           ("hnorm.weight", (hidden,)), ("shared_head.norm.weight", (hidden,))):
            weights[f"model.layers.{n}.{own}"] = torch.from_numpy(
                rng.standard_normal(shape).astype(np.float32))
    moe = range(config.first_k_dense_replace, layers + nextn)
    _add_tensors(writer, names, _stacked(weights, moe, config.n_routed_experts))
    _finish(writer, config.vocab_size)


GLM4MOE_CASES = ["glm4-moe", "glm4-moe-no-dense"]


@pytest.fixture(scope="module", params=GLM4MOE_CASES)
def glm4moe(request, tmp_path_factory, device):
    """(transformers GLM-4.5, its GGUF file loaded by kvpool) for each of GLM4MOE_CASES."""
    hf = make_hf_model(request.param, configs=MOE_CONFIGS)
    path = tmp_path_factory.mktemp(request.param) / "glm4moe.gguf"
    return _gguf_pair(hf, path, glm4moe_gguf_of, device)


def test_a_glm4moe_gguf_file_gives_transformers_logits(glm4moe):
    hf, model = glm4moe
    config, name = model.config, hf.config
    assert config.architecture == "Glm4MoeForCausalLM" and config.num_layers == 3
    assert config.moe.layers == MOE_LAYERS["glm4-moe" if name.first_k_dense_replace
                                           else "glm4-moe-no-dense"]
    assert (config.moe.num_groups, config.moe.topk_groups) == (name.n_group, name.topk_group)
    assert (config.moe.norm_topk_prob, config.moe.routed_scaling_factor) == \
        (name.norm_topk_prob, name.routed_scaling_factor)
    assert config.moe.shared_intermediate_size == 32 * name.n_shared_experts
    assert (config.qkv_bias, config.qk_norm) == (name.attention_bias, name.use_qk_norm)
    assert config.rotary_dim == 8
    assert_prefill_logits_match(hf, model)


def test_a_glm4moe_gguf_file_decodes_transformers_greedy_tokens(glm4moe):
    assert_greedy_decode_matches(*glm4moe, MAX_TOKENS)


def test_a_glm4moe_gguf_file_rotates_the_share_of_each_head_its_rotary_count_says(tmp_path):
    configs = {"glm4-moe-quarter": lambda: transformers.Glm4MoeConfig(
        **SMALL, n_routed_experts=8, rope_parameters={"rope_type": "default",
                                                      "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.25})}
    hf = make_hf_model("glm4-moe-quarter", configs=configs)
    glm4moe_gguf_of(hf, tmp_path / "glm4moe.gguf")
    model = load_model(tmp_path / "glm4moe.gguf", device="cpu").model
    assert model.config.rotary_dim == 4
    assert_prefill_logits_match(hf, model)


def test_the_engine_gives_transformers_greedy_tokens_from_a_glm4moe_gguf_file(tmp_path, device):
    _check_engine_on_gguf(make_hf_model("glm4-moe", configs=MOE_CONFIGS),
                          tmp_path / "glm4moe.gguf", glm4moe_gguf_of, device, MAX_TOKENS)


def test_a_glm4moe_conversion_leaves_the_prediction_layer_out(tmp_path, monkeypatch):
    hf = make_hf_model("glm4-moe-no-dense", configs=MOE_CONFIGS)
    glm4moe_gguf_of(hf, tmp_path / "glm4moe.gguf")
    conversion = _assert_conversion_matches(hf, tmp_path / "glm4moe.gguf", monkeypatch)
    names = load_file(conversion / "model.safetensors")
    assert not [name for name in names if name.startswith("model.layers.3.")]


@pytest.mark.parametrize(("nextn", "more", "message"), [
    (0, lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX),
     r"glm4moe.expert_gating_func 1 is not supported \(supported: 2, sigmoid"),
    (0, lambda w: w.add_uint32("glm4moe.nextn_predict_layers", 3),
     "glm4moe.nextn_predict_layers must be an integer below glm4moe.block_count 3, got 3"),
], ids=["softmax-gating", "nextn-of-every-layer"])
def test_glm4moe_metadata_kvpool_would_read_wrong_is_refused_by_name(tmp_path, nextn, more,
                                                                     message):
    path = tmp_path / "glm4moe.gguf"
    glm4moe_gguf_of(make_hf_model("glm4-moe", configs=MOE_CONFIGS), path, nextn=nextn,
                    more=more)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


@pytest.mark.parametrize("key", ["expert_shared_count", "expert_feed_forward_length"])
def test_a_glm4moe_file_without_a_key_llama_cpp_requires_is_refused_naming_it(
        tmp_path, monkeypatch, key):
    monkeypatch.setattr(gguf.GGUFWriter, f"add_{key}", lambda *_: None)
    path = tmp_path / "glm4moe.gguf"
    glm4moe_gguf_of(make_hf_model("glm4-moe", configs=MOE_CONFIGS), path)
    with pytest.raises(ConfigError, match=f"GGUF glm4moe needs glm4moe.{key}"):
        load_config(path)


@pytest.mark.parametrize("rotary", [0, 17, 64])
def test_a_glm4moe_file_rotating_none_or_more_than_a_head_is_refused_naming_both(
        tmp_path, monkeypatch, rotary):
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count",
                        lambda w, _: w.add_uint32("glm4moe.rope.dimension_count", rotary))
    path = tmp_path / "glm4moe.gguf"
    glm4moe_gguf_of(make_hf_model("glm4-moe", configs=MOE_CONFIGS), path)
    with pytest.raises(ConfigError, match=rf"glm4moe.rope.dimension_count {rotary} must rotate "
                                          rf"between 1 and the head's 16 channels"):
        load_config(path)


# --- Ernie 4.5 (ernie4_5, ernie4_5-moe) ---

# The shared experts' width as the converter writes it (intermediate_size / KV heads) is that
# of moe_num_shared_experts experts here, as in Ernie 4.5's releases (12,288 / 4 = 2 x 1,536)
ERNIE = {
    # Ernie 4.5 0.3B's shape: the head tied
    "ernie4_5-gguf": lambda: transformers.Ernie4_5Config(**SMALL_DENSE, head_dim=16),
    # 21B-A3B's: a dense first layer, the head tied; one shared expert (64 / 2 = 32)
    "ernie4_5-moe-gguf": lambda: transformers.Ernie4_5_MoeConfig(
        **{**MOE_ERNIE, "intermediate_size": 64}, moe_num_shared_experts=1),
    # experts on every second layer from the third, two shared experts (128 / 2 = 2 x 32), the
    # head untied
    "ernie4_5-moe-every-second-gguf": lambda: transformers.Ernie4_5_MoeConfig(
        **{**MOE_ERNIE, "num_hidden_layers": 6, "intermediate_size": 128},
        moe_layer_start_index=2, moe_layer_interval=2, moe_num_shared_experts=2,
        tie_word_embeddings=False),
}
# the layers with experts, by the number of layers of the case
ERNIE_MOE_LAYERS = {3: (1, 2), 6: (3, 5)}


def ernie_gguf_of(hf: transformers.PreTrainedModel, path, more=None) -> None:
    """The file llama.cpp's converter writes for a transformers Ernie 4.5 (`ernie4_5`), or its
    mixture of experts (`ernie4_5-moe`: the experts' keys, the shared experts' width as the
    converter computes it, intermediate_size / KV heads, where there are shared experts),
    names from the gguf package's map, each layer's experts stacked, the router bias a
    vector, q/k rows in order; what `more(writer)` adds; float32, placeholder tokens."""
    config = hf.config
    moe = isinstance(config, transformers.Ernie4_5_MoeConfig)
    arch = gguf.MODEL_ARCH.ERNIE4_5_MOE if moe else gguf.MODEL_ARCH.ERNIE4_5
    writer = _writer(path, gguf.MODEL_ARCH_NAMES[arch], config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if moe:
        writer.add_expert_count(config.moe_num_experts)
        writer.add_expert_used_count(config.moe_k)
        writer.add_interleave_moe_layer_step(config.moe_layer_interval)
        writer.add_leading_dense_block_count(config.moe_layer_start_index)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.moe_num_shared_experts)
        if config.moe_num_shared_experts:
            writer.add_expert_shared_feed_forward_length(
                config.intermediate_size // config.num_key_value_heads)
    if more is not None:
        more(writer)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    weights = _hf_weights(hf, path)
    if moe:
        layers = [i for i in range(config.num_hidden_layers)
                  if f"model.layers.{i}.mlp.gate.weight" in weights]
        weights = _stacked(weights, layers, config.moe_num_experts)
    _add_tensors(writer, names, weights)
    _finish(writer, config.vocab_size)


@pytest.fixture(scope="module", params=list(ERNIE))
def ernie(request, tmp_path_factory, device):
    """(transformers Ernie 4.5, its GGUF file loaded by kvpool) for each of ERNIE."""
    hf = make_hf_model(request.param, configs=ERNIE)
    path = tmp_path_factory.mktemp(request.param) / "ernie.gguf"
    return _gguf_pair(hf, path, ernie_gguf_of, device)


def test_an_ernie_gguf_file_gives_transformers_logits(ernie):
    hf, model = ernie
    config = model.config
    assert config.architecture == hf.config.architectures[0] and config.rope_interleave
    assert (model.lm_head is None) == hf.config.tie_word_embeddings
    if config.moe is not None:
        assert config.moe.layers == ERNIE_MOE_LAYERS[config.num_layers]
        assert config.moe.shared_intermediate_size == 32 * hf.config.moe_num_shared_experts
    assert_prefill_logits_match(hf, model)


def test_an_ernie_gguf_file_decodes_transformers_greedy_tokens(ernie):
    assert_greedy_decode_matches(*ernie, MAX_TOKENS)


def test_an_ernie_file_without_a_head_size_has_heads_of_hidden_over_heads(tmp_path):
    path = tmp_path / "ernie.gguf"
    _finish(_writer(path, "ernie4_5", transformers.Ernie4_5Config(**SMALL_DENSE)), 160)
    assert load_config(path).head_dim == 16  # 64 / 4, not the config's default of 128


def test_the_engine_gives_transformers_greedy_tokens_from_an_ernie_moe_gguf_file(tmp_path,
                                                                                 device):
    _check_engine_on_gguf(make_hf_model("ernie4_5-moe-gguf", configs=ERNIE),
                          tmp_path / "ernie.gguf", ernie_gguf_of, device, MAX_TOKENS)


def test_an_ernie_moe_conversion_gives_transformers_logits_too(tmp_path, monkeypatch):
    hf = make_hf_model("ernie4_5-moe-every-second-gguf", configs=ERNIE)
    ernie_gguf_of(hf, tmp_path / "ernie.gguf")
    _assert_conversion_matches(hf, tmp_path / "ernie.gguf", monkeypatch)


def test_shared_experts_of_no_whole_number_of_experts_are_refused_naming_the_widths(tmp_path):
    path = tmp_path / "ernie.gguf"  # 96 / 2 = 48 wide, experts 32 wide
    ernie_gguf_of(make_hf_model("ernie4_5-moe", configs=MOE_CONFIGS), path)
    with pytest.raises(ConfigError, match="ernie4_5-moe.expert_shared_feed_forward_length 48 is "
                                          "not a multiple of expert_feed_forward_length 32"):
        load_config(path)


def test_an_ernie_moe_file_without_its_layer_step_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf.GGUFWriter, "add_interleave_moe_layer_step", lambda *_: None)
    path = tmp_path / "ernie.gguf"
    ernie_gguf_of(make_hf_model("ernie4_5-moe-gguf", configs=ERNIE), path)
    with pytest.raises(ConfigError, match="GGUF ernie4_5-moe needs "
                                          "ernie4_5-moe.interleave_moe_layer_step"):
        load_config(path)


def test_an_ernie_moe_layer_step_of_0_is_refused(tmp_path, monkeypatch):
    add = gguf.GGUFWriter.add_interleave_moe_layer_step
    monkeypatch.setattr(gguf.GGUFWriter, "add_interleave_moe_layer_step",
                        lambda writer, _: add(writer, 0))
    path = tmp_path / "ernie.gguf"
    ernie_gguf_of(make_hf_model("ernie4_5-moe-gguf", configs=ERNIE), path)
    with pytest.raises(ConfigError, match="interleave_moe_layer_step must be at least 1, got 0"):
        load_config(path)
