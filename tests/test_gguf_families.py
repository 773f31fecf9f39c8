"""GGUF files of the families llama.cpp's converter writes under another family's
architecture or with settings beyond the common ones: OLMo 3 (`olmo2` with a window, its
sliding layers flagged per layer, yarn on the full ones), EXAONE 4 (windowed only at 64
layers, as llama.cpp runs it, Llama 3.1's scaling as `rope_freqs`) and GLM-4 (its four norms,
the fused gate/up, half of each head rotated); written here from random transformers models as
the converter writes them, against transformers, and the metadata kvpool refuses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import transformers

from kvpool.errors import ConfigError
from kvpool.models import load_config
from kvpool.models.gguf_vocab import build_tokenizer
from models_util import (
    SMALL,
    assert_greedy_decode_matches,
    assert_prefill_logits_match,
    make_hf_model,
)
from test_gguf import (
    _add_tensors,
    _assert_conversion_matches,
    _finish,
    _gguf_pair,
    _hf_weights,
    _llama31_rope_freqs,
    _writer,
)
from test_models import MAX_TOKENS

gguf = pytest.importorskip("gguf")

# OLMo 3 as its releases are (no biases, which llama.cpp has no tensors for): three sliding
# layers of 8 tokens and a full one, the full one with yarn 4x
OLMO3 = {"olmo3-gguf": lambda: transformers.Olmo3Config(
    **dict(SMALL, num_hidden_layers=4), sliding_window=8,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})}


def olmo3_gguf_of(hf: transformers.PreTrainedModel, path) -> None:
    """The file llama.cpp's converter writes for a transformers OLMo 3: `olmo2`, names from
    the gguf package's own map, q/k rows in order, the window and a sliding flag per layer,
    the full layers' yarn (its attention factor transformers' default, as published configs
    state it); float32, placeholder tokens."""
    config = hf.config
    full = config.rope_parameters["full_attention"]
    writer = _writer(path, "olmo2", config)
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_attn_factor(0.1 * math.log(full["factor"]) + 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.OLMO2, config.num_hidden_layers)
    _add_tensors(writer, names, _hf_weights(hf, path))
    _finish(writer, config.vocab_size)


@pytest.fixture(scope="module")
def olmo3(tmp_path_factory, device):
    """(transformers OLMo 3, its GGUF file loaded by kvpool)."""
    hf = make_hf_model("olmo3-gguf", configs=OLMO3)
    return _gguf_pair(hf, tmp_path_factory.mktemp("olmo3") / "olmo3.gguf", olmo3_gguf_of, device)


def test_an_olmo3_gguf_file_gives_transformers_logits(olmo3):
    hf, model = olmo3
    assert model.config.architecture == "Olmo3ForCausalLM"
    assert [model.config.layer_window(i) for i in range(4)] == [8, 8, 8, None]
    assert_prefill_logits_match(hf, model)


def test_an_olmo3_gguf_file_decodes_transformers_greedy_tokens(olmo3):
    assert_greedy_decode_matches(*olmo3, MAX_TOKENS)


def _olmo3_metadata(tmp_path, more=None):
    """An `olmo2` file of metadata alone, 4 layers with a window of 8, and what `more(writer)`
    adds."""
    path = tmp_path / "olmo3.gguf"
    writer = _writer(path, "olmo2", transformers.Olmo3Config(**dict(SMALL, num_hidden_layers=4)))
    writer.add_sliding_window(8)
    if more is not None:
        more(writer)
    _finish(writer, 160)
    return path


@pytest.mark.parametrize(("pattern", "types"), [
    (None, "SSSF"),  # llama.cpp's default period, 4: every 4th layer full
    (2, "SFSF"), (0, "SSSS"),  # a period; 0 slides every layer, as llama.cpp reads it
    ([True, False, False, True], "SFFS"),  # a flag per layer, as the converter writes them
])
def test_olmo3s_sliding_layers_are_those_the_pattern_marks(tmp_path, pattern, types):
    path = _olmo3_metadata(tmp_path, None if pattern is None
                           else lambda w: w.add_sliding_window_pattern(pattern))
    config = load_config(path)
    assert "".join("S" if config.layer_window(i) == 8 else "F" for i in range(4)) == types


@pytest.mark.parametrize(("more", "message"), [
    (lambda w: w.add_sliding_window_pattern([True, False]),
     r"sliding_window_pattern must be a flag for each of the 4 layers or a period, got "
     r"\[True, False\]"),
    (lambda w: w.add_rope_freq_base_swa(1000.0),
     "olmo2.rope.freq_base_swa 1000.0 differs from rope.freq_base 10000.0"),
], ids=["flags-of-other-layers", "sliding-rope-base"])
def test_olmo3_metadata_kvpool_would_read_wrong_is_refused_by_name(tmp_path, more, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_olmo3_metadata(tmp_path, more))


def test_a_sliding_rope_base_equal_to_the_default_base_is_the_same_base(tmp_path):
    # rope.freq_base left out is 10,000, as llama.cpp and the config read it
    path = _olmo3_metadata(tmp_path, lambda w: w.add_rope_freq_base_swa(10000.0))
    assert load_config(path).rope_theta == 10000.0


# EXAONE 4 as llama.cpp runs it: 64 layers (the 32B's count, the only one llama.cpp windows) of
# which three in four slide over 8 tokens, the full ones without RoPE, Llama 3.1's scaling;
# and 4 layers without a window, every one rotated
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
EXAONE4 = {
    "exaone4-gguf": lambda: transformers.Exaone4Config(
        **dict(SMALL, num_hidden_layers=64, hidden_size=32, intermediate_size=32),
        sliding_window=8, rope_scaling=LLAMA3_ROPE),
    "exaone4-no-window-gguf": lambda: transformers.Exaone4Config(
        **dict(SMALL, num_hidden_layers=4), sliding_window=None,
        layer_types=["full_attention"] * 4, rope_scaling=LLAMA3_ROPE),
}


def exaone4_gguf_of(hf: transformers.PreTrainedModel, path) -> None:
    """The file llama.cpp's converter writes for a transformers EXAONE 4: names from the gguf
    package's own map, q/k rows in order, the window and a sliding flag per layer where the
    model has one, Llama 3.1's scaling as the `rope_freqs` divisors; float32, placeholder
    tokens."""
    config, rope = hf.config, hf.config.rope_parameters
    writer = _writer(path, "exaone4", config)
    writer.add_rope_freq_base(rope["rope_theta"])
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_tensor("rope_freqs.weight", _llama31_rope_freqs(
        head_dim, rope["rope_theta"], rope).astype(np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.EXAONE4, config.num_hidden_layers)
    _add_tensors(writer, names, _hf_weights(hf, path))
    _finish(writer, config.vocab_size)


@pytest.fixture(scope="module", params=list(EXAONE4))
def exaone4(request, tmp_path_factory, device):
    """(transformers EXAONE 4, its GGUF file loaded by kvpool) for each of EXAONE4."""
    hf = make_hf_model(request.param, configs=EXAONE4)
    path = tmp_path_factory.mktemp(request.param) / "exaone4.gguf"
    return _gguf_pair(hf, path, exaone4_gguf_of, device)


def test_an_exaone4_gguf_file_gives_transformers_logits(exaone4):
    hf, model = exaone4
    config = model.config
    windowed = hf.config.sliding_window is not None
    assert [config.layer_window(i) for i in range(4)] == ([8, 8, 8, None] if windowed
                                                          else [None] * 4)
    assert config.no_rope_layers == (tuple(range(3, 64, 4)) if windowed else ())
    assert config.rope_scaling["rope_type"] == "frequency_factors"
    assert_prefill_logits_match(hf, model)


def test_an_exaone4_gguf_file_decodes_transformers_greedy_tokens(exaone4):
    assert_greedy_decode_matches(*exaone4, 8)  # 64 layers: a few tokens suffice


def _exaone4_metadata(tmp_path, layers: int, window: int | None):
    path = tmp_path / "exaone4.gguf"
    writer = _writer(path, "exaone4", transformers.Exaone4Config(
        **dict(SMALL, num_hidden_layers=layers)))
    if window is not None:
        writer.add_sliding_window(window)
    _finish(writer, 160)
    return path


def test_a_64_layer_exaone4_file_without_a_window_slides_over_4096_tokens_as_llama_cpp(tmp_path):
    config = load_config(_exaone4_metadata(tmp_path, 64, None))
    assert config.sliding_window == 4096
    assert config.layer_types[:4] == ("sliding_attention",) * 3 + ("full_attention",)


def test_a_window_llama_cpp_ignores_is_refused_naming_the_layers(tmp_path):
    with pytest.raises(ConfigError, match="exaone4.attention.sliding_window is 8 in a model of "
                                          "4 layers, which llama.cpp runs without a window"):
        load_config(_exaone4_metadata(tmp_path, 4, 8))


def test_exaone4s_pre_tokenizer_splits_as_gpt2s_as_llama_cpp_splits_it():
    def words(pre: str) -> list[str]:
        tokenizer = build_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                     "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []})
        return [w for w, _ in tokenizer.pre_tokenizer.pre_tokenize_str("It's 2026, x")]

    assert words("exaone4") == words("gpt2") == ["It", "'s", "Ġ2026", ",", "Ġx"]


# GLM-4 (0414): q/k/v biases (or none), half of each head rotated in adjacent pairs
GLM4 = {"glm4-gguf": lambda: transformers.Glm4Config(**SMALL, head_dim=16),
        "glm4-no-biases-gguf": lambda: transformers.Glm4Config(**SMALL, head_dim=16,
                                                               attention_bias=False)}


def glm4_gguf_of(hf: transformers.PreTrainedModel, path) -> None:
    """The file llama.cpp's converter writes for a transformers GLM-4: names from the gguf
    package's own map (the fused gate/up kept as `ffn_up`), q/k rows in order, the rotated
    share of each head as `rope.dimension_count`; float32, placeholder tokens."""
    config, rope = hf.config, hf.config.rope_parameters
    writer = _writer(path, "glm4", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(config.head_dim * rope["partial_rotary_factor"]))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4, config.num_hidden_layers)
    _add_tensors(writer, names, _hf_weights(hf, path))
    _finish(writer, config.vocab_size)


@pytest.fixture(scope="module", params=list(GLM4))
def glm4(request, tmp_path_factory, device):
    """(transformers GLM-4, its GGUF file loaded by kvpool) for each of GLM4."""
    hf = make_hf_model(request.param, configs=GLM4)
    return _gguf_pair(hf, tmp_path_factory.mktemp(request.param) / "glm4.gguf", glm4_gguf_of,
                      device)


def test_a_glm4_gguf_file_gives_transformers_logits(glm4):
    hf, model = glm4
    assert model.config.rotary_dim == 8 and model.config.qkv_bias == hf.config.attention_bias
    assert_prefill_logits_match(hf, model)


def test_a_glm4_gguf_file_decodes_transformers_greedy_tokens(glm4):
    assert_greedy_decode_matches(*glm4, MAX_TOKENS)


def test_a_glm4_file_without_a_rotary_count_rotates_whole_heads_as_llama_cpp(tmp_path):
    path = tmp_path / "glm4.gguf"
    writer = _writer(path, "glm4", transformers.Glm4Config(**SMALL))
    writer.add_key_length(16)
    _finish(writer, 160)
    assert load_config(path).rotary_dim == 16


def test_glm4s_pre_tokenizer_splits_as_llama_3s_but_keeps_every_merge_as_llama_cpp():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "c", "abc", "ab"],
            "tokenizer.ggml.merges": ["a b"]}  # no merge makes "abc"

    def split(pre: str) -> list[str]:
        tokenizer = build_tokenizer({**meta, "tokenizer.ggml.pre": pre})
        return [w for w, _ in tokenizer.pre_tokenizer.pre_tokenize_str("It's 2026, x")]

    assert split("glm4") == split("llama-bpe") == ["It", "'s", "Ġ", "202", "6", ",", "Ġx"]
    assert build_tokenizer({**meta, "tokenizer.ggml.pre": "glm4"}).encode("abc").ids == [4, 2]


@pytest.mark.parametrize(("name", "configs", "write"), [
    ("olmo3-gguf", OLMO3, olmo3_gguf_of),
    ("exaone4-no-window-gguf", EXAONE4, exaone4_gguf_of),
    ("glm4-gguf", GLM4, glm4_gguf_of),
])
def test_a_familys_conversion_gives_transformers_logits_too(tmp_path, monkeypatch, name,
                                                             configs, write):
    hf = make_hf_model(name, configs=configs)
    write(hf, tmp_path / f"{name}.gguf")
    _assert_conversion_matches(hf, tmp_path / f"{name}.gguf", monkeypatch)
