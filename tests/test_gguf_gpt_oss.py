"""gpt-oss's GGUF files as llama.cpp's converter writes them (the experts' gate and up
projections split apart from transformers' interleaved stack, their biases beside them, a sink
per head, YaRN and the window in the metadata, the o200k pre-tokenizer), in float32 and with
MXFP4 experts: against transformers, through the engine, and the metadata kvpool refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tokenizers import pre_tokenizers

from kvpool.errors import ConfigError
from kvpool.models import load_config, load_model
from kvpool.models.gguf import GGUFCheckpoint
from kvpool.models.gguf_vocab import build_tokenizer
from models_util import (
    assert_greedy_decode_matches,
    assert_prefill_logits_match,
)
from test_gguf import (
    _assert_conversion_matches,
    _check_engine_on_gguf,
    _finish,
    _gguf_pair,
    _hf_weights,
    _writer,
)
from test_gpt_oss import CONFIGS, make_gpt_oss
from test_models import MAX_TOKENS

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
MXFP4_BLOCK = 32  # values per MXFP4 block: one shared power of two, 4 bits each
# OCP's E2M1 values of the codes 0-15 (the sign bit last): MXFP4's elements before scaling
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _mxfp4(values: torch.Tensor) -> np.ndarray:
    """`values` (rows of whole blocks) as the gguf package quantizes them to MXFP4."""
    return gguf.quants.quantize(values.contiguous().numpy(), T.MXFP4)


def round_to_mxfp4(hf: transformers.PreTrainedModel) -> None:
    """Round the experts' weights to the nearest MXFP4 values, in blocks along their inputs
    (the rows of llama.cpp's tensors), so that a file of MXFP4 experts holds them exactly."""
    with torch.no_grad():
        for layer in hf.model.layers:
            for stack in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                rows = stack.transpose(-1, -2)
                exact = gguf.quants.dequantize(_mxfp4(rows), T.MXFP4)
                stack.copy_(torch.from_numpy(exact).reshape(rows.shape).transpose(-1, -2))


def gpt_oss_gguf_of(hf: transformers.PreTrainedModel, path, experts=T.F32) -> None:
    """The file llama.cpp's converter writes for a transformers gpt-oss: names from the gguf
    package's own map (a sink's with `.weight`), each layer's gate/up stack transposed and
    split into its even (gate) and odd (up) rows, its biases likewise, the experts' matrices
    of type `experts` (F32 or MXFP4), the rest float32; YaRN, the window and the experts'
    width in the metadata."""
    config, rope = hf.config, hf.config.rope_parameters
    writer = _writer(path, "gpt-oss", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config.num_hidden_layers)

    def add(name: str, tensor: torch.Tensor, kind=T.F32) -> None:
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if kind == T.F32:
            writer.add_tensor(gguf_name, tensor.contiguous().numpy())
        else:
            writer.add_tensor(gguf_name, _mxfp4(tensor), raw_dtype=kind)

    weights = _hf_weights(hf, path)
    for name, tensor in weights.items():
        stack = name.partition("mlp.experts.")[2]
        prefix = name[:-len(stack)]
        if stack == "gate_up_proj":
            rows = tensor.transpose(-1, -2)
            add(f"{prefix}gate_proj.weight", rows[:, 0::2], experts)
            add(f"{prefix}up_proj.weight", rows[:, 1::2], experts)
        elif stack == "gate_up_proj_bias":
            add(f"{prefix}gate_proj.bias", tensor[:, 0::2])
            add(f"{prefix}up_proj.bias", tensor[:, 1::2])
        elif stack == "down_proj":
            add(f"{prefix}down_proj.weight", tensor.transpose(-1, -2), experts)
        elif stack == "down_proj_bias":
            add(f"{prefix}down_proj.bias", tensor)
        else:
            add(f"{name}.weight" if name.endswith("sinks") else name, tensor)
    _finish(writer, config.vocab_size, pre="gpt-4o")


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers gpt-oss, its GGUF file loaded by kvpool) for each of test_gpt_oss's
    configs: yarn 4x unrounded, a window of 4; transformers' default yarn, the head tied."""
    hf = make_gpt_oss(request.param)
    path = tmp_path_factory.mktemp(request.param) / "gpt-oss.gguf"
    return _gguf_pair(hf, path, gpt_oss_gguf_of, device)


def test_a_gpt_oss_gguf_file_gives_transformers_logits(pair):
    assert_prefill_logits_match(*pair)


def test_a_gpt_oss_gguf_file_decodes_transformers_greedy_tokens(pair):
    assert_greedy_decode_matches(*pair, MAX_TOKENS)


def test_a_gpt_oss_gguf_file_reads_as_its_config(tmp_path):
    hf = make_gpt_oss("gpt-oss")
    gpt_oss_gguf_of(hf, tmp_path / "gpt-oss.gguf")
    config = load_config(tmp_path / "gpt-oss.gguf")
    assert config.architecture == "GptOssForCausalLM"
    assert [config.layer_window(i) for i in range(2)] == [4, None]  # sliding first
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "truncate": False,
                                   "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                   "beta_slow": 1.0}
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 3, 32)
    assert config.attention_sinks and moe.router_bias and moe.expert_bias


def test_the_engine_gives_transformers_greedy_tokens_from_a_gpt_oss_gguf_file(tmp_path,
                                                                               device):
    _check_engine_on_gguf(make_gpt_oss("gpt-oss"), tmp_path / "gpt-oss.gguf", gpt_oss_gguf_of,
                          device, MAX_TOKENS)


def test_mxfp4_dequantizes_as_ggml_lays_a_block_out():
    # ggml's block: the shared exponent byte e (a scale of 2^(e - 127)), then 16 bytes whose
    # low nibbles are elements 0-15 and high nibbles elements 16-31
    codes = np.r_[np.arange(16), np.arange(15, -1, -1)].astype(np.uint8)  # halves differ
    block = np.concatenate([[np.uint8(129)], codes[:16] | (codes[16:] << 4)])
    values = gguf.quants.dequantize(block.astype(np.uint8)[None], T.MXFP4).reshape(-1)
    assert len(values) == MXFP4_BLOCK
    assert values.tolist() == [E2M1[c] * 4.0 for c in codes]


def test_mxfp4_experts_load_their_exact_values_and_give_transformers_logits(tmp_path,
                                                                           monkeypatch):
    hf = make_gpt_oss("gpt-oss")
    round_to_mxfp4(hf)
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    gpt_oss_gguf_of(hf, path, experts=T.MXFP4)
    kinds = {t.name: t.tensor_type for t in GGUFCheckpoint(path)._tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == kinds["blk.1.ffn_down_exps.weight"] == T.MXFP4
    model = load_model(path, device="cpu").model
    for ours, theirs in zip(model.model.layers, hf.model.layers, strict=True):
        gate_up, down = theirs.mlp.experts.gate_up_proj, theirs.mlp.experts.down_proj
        for expert, mlp in enumerate(ours.mlp.experts):
            assert torch.equal(mlp.gate_proj.weight, gate_up[expert][:, 0::2].T)
            assert torch.equal(mlp.up_proj.weight, gate_up[expert][:, 1::2].T)
            assert torch.equal(mlp.down_proj.weight, down[expert].T)
    assert_prefill_logits_match(hf, model)
    _assert_conversion_matches(hf, path, monkeypatch)  # its conversion, too


@pytest.mark.parametrize(("more", "message"), [
    # transformers' attention factor other than its default for 4x, 1 + 0.1 ln 4
    (lambda w: w.add_rope_scaling_yarn_attn_factor(1.5),
     r"gpt-oss.rope.scaling.yarn_attn_factor is 1.5; kvpool reads YaRN with 1.138629\d* only"),
    # llama.cpp's own multiplier of it (an older converter's key for the same factor)
    (lambda w: w.add_rope_scaling_attn_factors(1.25),
     "gpt-oss.rope.scaling.attn_factor is 1.25; kvpool reads YaRN with 1.0 only"),
    (lambda w: w.add_rope_scaling_yarn_log_mul(0.1),
     "gpt-oss.rope.scaling.yarn_log_multiplier is 0.1"),
    (lambda w: w.add_string("gpt-oss.rope.scaling.yarn_ext_factor", "1"),
     "gpt-oss.rope.scaling.yarn_ext_factor must be a number, got '1'"),
], ids=["yarn-attn-factor", "attn-factor", "log-multiplier", "ext-factor-as-text"])
def test_yarn_settings_transformers_has_no_counterpart_for_are_refused_by_name(
        tmp_path, more, message):
    path = _metadata(tmp_path, more)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_gpt_oss_file_without_its_window_or_experts_width_is_refused_naming_both(tmp_path):
    path = _metadata(tmp_path, window=False)
    with pytest.raises(ConfigError, match="gpt-oss.gguf: GGUF gpt-oss needs gpt-oss.expert_"
                                          "feed_forward_length and gpt-oss.attention.sliding"):
        load_config(path)


def test_a_yarn_factor_of_1_is_no_scaling_as_llama_cpp_reads_it(tmp_path):
    path = _metadata(tmp_path, lambda w: w.add_rope_scaling_factor(1.0))
    assert load_config(path).rope_scaling is None


def test_the_experts_are_as_wide_as_expert_feed_forward_length_says(tmp_path):
    # llama.cpp sizes gpt-oss's experts by it, whatever feed_forward_length says
    path = _metadata(tmp_path, lambda w: w.add_feed_forward_length(96))
    assert load_config(path).moe.intermediate_size == 32


def test_yarns_betas_come_from_the_metadata(tmp_path):
    def betas(writer):
        writer.add_rope_scaling_yarn_beta_fast(16.0)
        writer.add_rope_scaling_yarn_beta_slow(2.0)

    scaling = load_config(_metadata(tmp_path, betas)).rope_scaling
    assert (scaling["beta_fast"], scaling["beta_slow"]) == (16.0, 2.0)


def _metadata(tmp_path, more=None, window: bool = True):
    """A gpt-oss file of metadata alone (YaRN 4x over 64 positions, a window of 4 where
    `window`, with the experts' width) and what `more(writer)` adds or overrides."""
    path = tmp_path / "gpt-oss.gguf"
    writer = _writer(path, "gpt-oss", CONFIGS["gpt-oss"]())
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    if window:
        writer.add_sliding_window(4)
        writer.add_expert_feed_forward_length(32)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    writer.add_rope_scaling_orig_ctx_len(64)
    if more is not None:
        more(writer)
    _finish(writer, 160, pre="gpt-4o")
    return path


# --- the o200k pre-tokenizer ---

O200K_TEXTS = ["camelCase HTTPServer's isn't WE'LL", "x = 12345/67\n\n  y\r\n",
               "naïve café Ünïcode ÀB", "日本語のテキスト and 中文", "a//b ,, !?\t\tc"]


def test_the_o200k_pre_tokenizer_splits_as_tiktokens_pattern():
    # a word's capitals apart from the next word's, contractions kept on the word, digits in
    # threes, "/" kept after punctuation
    words = build_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o",
                             "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []})
    split = [w for w, _ in words.pre_tokenizer.pre_tokenize_str("camelCase isn't 12345//x")]
    assert split == ["camel", "Case", "Ġisn't", "Ġ", "123", "45", "//", "x"]


def test_an_o200k_vocabulary_tokenizes_as_transformers_gguf_tokenizer_does(tmp_path):
    # the 256 byte-level symbols and merges across the places the pattern splits or not
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["l C", "Ġ i", "Ġi s", "1 2", "12 3", "/ /", "' s", "r '", "Ġ Ġ", "Ċ Ċ"]
    tokens = [*symbols, *(m.replace(" ", "") for m in merges), "<|end|>"]
    path = tmp_path / "o200k.gguf"
    writer = gguf.GGUFWriter(path, "gpt-oss")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = build_tokenizer(GGUFCheckpoint(path).meta)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in O200K_TEXTS:
        assert ours.encode(text).ids == theirs.encode(text, add_special_tokens=False), text

