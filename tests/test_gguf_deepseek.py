"""DeepSeek V2/V3 GGUF files (`deepseek2`): written here from random transformers models as
llama.cpp's converter writes them (the latent attention's kv_b_proj whole, as older converters
wrote it, or split into each head's transposed key rows and its value rows, as newer ones do;
the experts stacked, V3's router bias, YaRN's mscale as the log multiplier), against
transformers, through the engine, and the metadata kvpool refuses."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvpool.errors import CheckpointError, ConfigError
from kvpool.models import load_config, load_model
from kvpool.models.gguf import join_kv_b
from kvpool.models.gguf_vocab import build_tokenizer
from models_util import (
    assert_greedy_decode_matches,
    assert_prefill_logits_match,
    make_hf_model,
)
from test_deepseek import SMALL
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

gguf = pytest.importorskip("gguf")

# mscale equal to mscale_all_dim, as DeepSeek's configs have them: the file keeps the latter
# only (llama.cpp leaves cos/sin unscaled, as transformers does when the two agree)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.8, "mscale_all_dim": 0.8}
CONFIGS = {
    # V2-Lite's shape: no q bottleneck, softmax greedy routing, two shared experts
    "v2-lite-gguf": lambda: transformers.DeepseekV2Config(
        **SMALL, q_lora_rank=None, n_shared_experts=2, topk_method="greedy"),
    # V2's q bottleneck, scaled routing, yarn rope
    "v2-yarn-gguf": lambda: transformers.DeepseekV2Config(
        **SMALL, q_lora_rank=24, n_shared_experts=1, topk_method="greedy",
        routed_scaling_factor=2.0, rope_parameters=YARN),
    # V3's: sigmoid scores with the correction bias, grouped, normalised, scaled, yarn rope
    "v3-yarn-gguf": lambda: transformers.DeepseekV3Config(
        **SMALL, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=YARN),
}


def deepseek_gguf_of(hf: transformers.PreTrainedModel, path, split: bool = True,
                     gating: bool = True, more=None) -> None:
    """The file llama.cpp's converter writes for a transformers DeepSeek V2/V3: `deepseek2`
    with one KV head, the MLA sizes (with `split`, kv_b_proj split into `attn_k_b`, each head's
    key rows transposed, and `attn_v_b`, and the head sizes under the `_mla` keys beside the
    latent's; else kv_b_proj whole and the head sizes under the plain keys), the routing keys
    (the gating function only with `gating`: older files have none), the yarn keys with
    0.1 mscale_all_dim as the log multiplier; names from the gguf package's map, each layer's
    experts stacked, q/k rows in order; what `more(writer)` adds; float32, placeholder
    tokens."""
    config = hf.config
    rope, rank = config.qk_rope_head_dim, config.kv_lora_rank
    nope, v, heads = config.qk_nope_head_dim, config.v_head_dim, config.num_attention_heads
    writer = _writer(path, "deepseek2", config, head_count_kv=1)  # MLA: one KV head, the latent
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_vocab_size(config.vocab_size)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    if split:
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    else:
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    if config.n_group is not None:
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    v3 = isinstance(config, transformers.DeepseekV3Config)
    if gating:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3
                                      else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_rope_dimension_count(rope)
    scaling = config.rope_parameters
    if scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
    if more is not None:
        more(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config.num_hidden_layers)
    moe = range(config.first_k_dense_replace, config.num_hidden_layers)
    weights = _stacked(_hf_weights(hf, path), moe, config.n_routed_experts)
    for name in [n for n in weights if split and n.endswith("kv_b_proj.weight")]:
        k_b, v_b = weights.pop(name).view(heads, nope + v, rank).split([nope, v], dim=1)
        weights[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2).contiguous()
        weights[name.replace("kv_b_proj", "v_b_proj")] = v_b.contiguous()
    _add_tensors(writer, names, weights)
    _finish(writer, config.vocab_size)


CASES = [("v2-lite-gguf", False), ("v2-yarn-gguf", True), ("v3-yarn-gguf", True),
         ("v3-yarn-gguf", False)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{name}-{'split' if split else 'whole'}"
                                                   for name, split in CASES])
def deepseek(request, tmp_path_factory, device):
    """(transformers DeepSeek, its GGUF file loaded by kvpool) for each of CASES."""
    name, split = request.param
    hf = make_hf_model(name, configs=CONFIGS)
    return _gguf_pair(hf, tmp_path_factory.mktemp(name) / "deepseek.gguf", deepseek_gguf_of,
                      device, split=split, gating=name != "v2-lite-gguf")


def test_a_deepseek2_gguf_file_gives_transformers_logits(deepseek):
    hf, model = deepseek
    config, v3 = model.config, isinstance(hf.config, transformers.DeepseekV3Config)
    assert config.architecture == ("DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM")
    assert (config.mla.q_lora_rank, config.mla.qk_nope_head_dim, config.mla.v_head_dim) == \
        (hf.config.q_lora_rank, 16, 24)
    assert config.moe.layers == (1, 2)
    assert (config.moe.num_groups, config.moe.topk_groups) == ((4, 2) if v3 else (1, 1))
    assert config.moe.routed_scaling_factor == hf.config.routed_scaling_factor
    assert_prefill_logits_match(hf, model)


def test_a_deepseek2_gguf_file_decodes_transformers_greedy_tokens(deepseek):
    assert_greedy_decode_matches(*deepseek, MAX_TOKENS)


def test_yarns_log_multiplier_is_deepseeks_mscale_of_the_scores_alone(tmp_path):
    deepseek_gguf_of(make_hf_model("v3-yarn-gguf", configs=CONFIGS), tmp_path / "v3.gguf")
    scaling = load_config(tmp_path / "v3.gguf").rope_scaling
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 4.0
    assert scaling["mscale"] == scaling["mscale_all_dim"] == pytest.approx(0.8, rel=1e-6)
    assert (scaling["original_max_position_embeddings"], scaling["truncate"]) == (64, True)


def test_the_split_kv_b_joins_into_each_heads_key_rows_then_its_value_rows():
    kv_b = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2 * 5, 3)  # 2 heads, nope 2, v 3
    k_b, v_b = kv_b.view(2, 5, 3).split([2, 3], dim=1)
    assert torch.equal(join_kv_b(k_b.transpose(1, 2), v_b), kv_b)


def test_the_engine_gives_transformers_greedy_tokens_from_a_deepseek2_gguf_file(tmp_path,
                                                                                device):
    _check_engine_on_gguf(make_hf_model("v3-yarn-gguf", configs=CONFIGS), tmp_path / "v3.gguf",
                          deepseek_gguf_of, device, MAX_TOKENS)


def test_a_deepseek2_conversion_gives_transformers_logits_too(tmp_path, monkeypatch, device):
    hf = make_hf_model("v2-yarn-gguf", configs=CONFIGS)
    deepseek_gguf_of(hf, tmp_path / "v2.gguf")
    _assert_conversion_matches(hf, tmp_path / "v2.gguf", monkeypatch, device)


@pytest.mark.parametrize(("name", "more", "message"), [
    ("v2-lite-gguf", lambda w: w.add_expert_group_count(4),
     "deepseek2.expert_group_count 4 with softmax gating: llama.cpp picks groups by their best "
     "two experts, DeepSeek-V2 by its best one"),
    ("v2-lite-gguf", lambda w: w.add_uint32("deepseek2.expert_gating_func", 3),
     r"deepseek2.expert_gating_func 3 is not supported \(supported: 1, softmax; 2, sigmoid\)"),
    ("v3-yarn-gguf", lambda w: w.add_rope_scaling_attn_factors(1.5),
     "deepseek2.rope.scaling.attn_factor is 1.5; kvpool reads YaRN with 1.0 only"),
], ids=["softmax-groups", "gating-function", "yarn-attention-factor"])
def test_deepseek2_metadata_kvpool_would_read_wrong_is_refused_by_name(tmp_path, name, more,
                                                                       message):
    path = tmp_path / "deepseek.gguf"
    deepseek_gguf_of(make_hf_model(name, configs=CONFIGS), path, gating=name != "v2-lite-gguf",
                     more=more)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_yarn_without_deepseeks_log_multiplier_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_scaling_yarn_log_mul", lambda *_: None)
    path = tmp_path / "v3.gguf"
    deepseek_gguf_of(make_hf_model("v3-yarn-gguf", configs=CONFIGS), path)
    with pytest.raises(ConfigError, match="deepseek2 YaRN needs a positive deepseek2.rope."
                                          r"scaling.yarn_log_multiplier \(0.1 mscale_all_dim\), "
                                          "got None"):
        load_config(path)


def test_a_split_kv_b_of_other_heads_is_refused_naming_both_halves(tmp_path, monkeypatch,
                                                                    device):
    add_tensor = gguf.GGUFWriter.add_tensor

    def fewer_value_heads(writer, name, tensor, *args, **kwargs):
        if name.endswith("attn_v_b.weight"):
            tensor = tensor[1:]
        return add_tensor(writer, name, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", fewer_value_heads)
    path = tmp_path / "v3.gguf"
    deepseek_gguf_of(make_hf_model("v3-yarn-gguf", configs=CONFIGS), path)
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_k_b\.weight \(4, 32, 16\) and "
                                              r"blk\.0\.attn_v_b\.weight \(3, 24, 32\) are not "
                                              r"the halves of one kv_b_proj"):
        load_model(path, device=device)


def test_half_a_split_kv_b_is_refused_by_its_name(tmp_path, monkeypatch, device):
    add_tensor = gguf.GGUFWriter.add_tensor

    def without_layer_0s_values(writer, name, tensor, *args, **kwargs):
        if name != "blk.0.attn_v_b.weight":
            add_tensor(writer, name, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", without_layer_0s_values)
    path = tmp_path / "v3.gguf"
    deepseek_gguf_of(make_hf_model("v3-yarn-gguf", configs=CONFIGS), path)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.kv_b_proj\.weight"
                                              r"(.|\n)*unexpected weights: blk\.0\.attn_k_b"):
        load_model(path, device=device)


def test_deepseek_v3s_pre_tokenizer_splits_digits_then_ideographs_then_words():
    tokenizer = build_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre":
                                 "deepseek-v3", "tokenizer.ggml.tokens": ["a"],
                                 "tokenizer.ggml.merges": []})
    words = [w for w, _ in tokenizer.pre_tokenizer.pre_tokenize_str(
        "Hello 12345 世界, it's x\n\n(ab)")]
    # byte-level: Ġ a space, Ċ a newline, ä¸ĸçķĮ the six bytes of 世界
    assert words == ["Hello", "Ġ", "123", "45", "Ġ", "ä¸ĸçķĮ", ",", "Ġit", "'s", "Ġx", "ĊĊ",
                     "(ab", ")"]


@pytest.mark.parametrize("key, writes", [
    ("attention.kv_lora_rank", "add_kv_lora_rank"),
    ("expert_feed_forward_length", "add_expert_feed_forward_length"),
    ("leading_dense_block_count", "add_leading_dense_block_count"),
])
def test_a_file_without_a_key_llama_cpp_requires_is_refused_naming_it(
        tmp_path, monkeypatch, key, writes):
    monkeypatch.setattr(gguf.GGUFWriter, writes, lambda *_: None)
    path = tmp_path / "v3.gguf"
    deepseek_gguf_of(make_hf_model("v3-yarn-gguf", configs=CONFIGS), path)
    with pytest.raises(ConfigError, match=f"GGUF deepseek2 needs deepseek2.{key}"):
        load_config(path)


def test_deepseek_llms_pre_tokenizer_splits_breaks_words_punctuation_ideographs_and_digits():
    tokenizer = build_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre":
                                 "deepseek-llm", "tokenizer.ggml.tokens": ["a"],
                                 "tokenizer.ggml.merges": []})
    omega = "\u03a9\u03bc\u03ad\u03b3\u03b1"  # a Greek word: letters of the cased class
    text = f"Hello world, 12345 世界 {omega}\u00a9!\n\u00a9  "  # ©: in no class
    pieces = [text[a:b] for _, (a, b) in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    assert pieces == ["Hello", " world", ",", " ", "12345", " ", "世界", f" {omega}", "\u00a9",
                      "!", "\n", "\u00a9", "  "]
