"""Qwen3-Next: Gated DeltaNet layers (state slots) and gated full attention layers, each
followed by Qwen2-MoE-like experts with a gated shared expert (or a dense MLP), every norm
zero-centred; against transformers, through the engine, and its config checks."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from hybrid_util import HybridRunner
from kvpool.engine import LLM, SamplingParams
from kvpool.errors import ConfigError
from kvpool.memory.state_pool import MambaLayout
from kvpool.models.config import ModelConfig
from kvpool.models.gated_deltanet import GatedDeltaNet
from kvpool.models.layers import MLP
from kvpool.models.loader import load_model
from kvpool.models.moe import MoE
from kvpool.models.qwen3_next import Qwen3NextForCausalLM
from models_util import (
    assert_logits_match,
    hf_greedy,
    prompts,
    relative_error,
    rewrite_weight,
    save_hf_model,
)

MAX_TOKENS = 32
SMALL = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
CONFIGS = {
    # an attention layer every second, two value heads per key head, experts on every layer
    "qwen3-next": lambda: transformers.Qwen3NextConfig(**SMALL, full_attention_interval=2),
    # the layer types listed, one value head per key head, q/k/v/o biases, half of each head
    # rotated, dense MLPs on the layers mlp_only_layers names, the head tied
    "qwen3-next-listed-dense-biased-tied": lambda: transformers.Qwen3NextConfig(
        **{**SMALL, "linear_num_value_heads": 2, "linear_conv_kernel_dim": 3},
        layer_types=["full_attention", "linear_attention", "linear_attention",
                     "full_attention"], mlp_only_layers=[1, 3], attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.5}, tie_word_embeddings=True),
}
# prompts of one to three of the delta rule's 64-token chunks
LONG = (3, 9, 17, 26, 70, 140)


def make_qwen3_next(name: str, seed: int = 0, **change) -> transformers.PreTrainedModel:
    """A small random float32 Qwen3-Next of CONFIGS[name] with the keys of `change`: the norms
    (zero-centred), dt_bias and A_log randomised too (transformers initialises them to
    constants)."""
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    for key, value in change.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.0, 0.2)
            elif param_name.endswith((".bias", ".dt_bias")):
                param.normal_(0.0, 0.5)
            elif param_name.endswith(".A_log"):
                param.uniform_(-1.0, 1.5)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers Qwen3-Next, the same checkpoint loaded by kvpool)."""
    hf = make_qwen3_next(request.param)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf.to(device), load_model(folder, device=device).model


def test_the_layers_are_where_the_config_puts_them(pair):
    hf, model = pair
    assert isinstance(model, Qwen3NextForCausalLM)
    for ours, theirs in zip(model.model.layers, hf.model.layers, strict=True):
        assert isinstance(getattr(ours, "linear_attn", None), GatedDeltaNet) == (
            theirs.block_type == "linear_attention")
        assert isinstance(ours.mlp, MoE if hasattr(theirs.mlp, "experts") else MLP)


@pytest.mark.parametrize("change", [
    {"num_experts": 0}, {"mlp_only_layers": [0, 1, 2, 3], "num_experts_per_tok": 8},
    {"use_sliding_window": True}], ids=["no-experts", "all-dense-top-k-unread", "window-unread"])
def test_configs_transformers_builds_dense_or_reads_no_window_of_load_and_match_it(
        tmp_path, device, change):
    hf = make_qwen3_next("qwen3-next", **change)
    model = load_model(save_hf_model(hf, tmp_path), device=device).model
    batch = prompts(160)
    assert_logits_match(hf.to(device), batch, HybridRunner(model).step(batch, all_logits=True))


def test_the_multi_token_prediction_weights_are_left_unread_as_transformers_leaves_them(
        tmp_path, device):
    hf = make_qwen3_next("qwen3-next")
    folder = save_hf_model(hf, tmp_path)
    rewrite_weight(folder, "mtp.fc.weight", lambda _: torch.ones(64, 128))
    hf, model = hf.to(device), load_model(folder, device=device).model
    batch = prompts(160)
    assert_logits_match(hf, batch, HybridRunner(model).step(batch, all_logits=True))


def test_packed_prefill_logits_match_transformers(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size, lengths=LONG)
    logits = HybridRunner(model, num_pages=256).step(batch, all_logits=True)
    assert_logits_match(hf, batch, logits)


def test_batched_greedy_decode_matches_transformers_generate(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    runner = HybridRunner(model)
    ours = runner.greedy(batch, MAX_TOKENS)
    assert ours == {seq_id: hf_greedy(hf, prompt, MAX_TOKENS) for seq_id, prompt in batch.items()}
    runner.cache.check()
    runner.states.check()


@pytest.mark.parametrize("split", [1, 5, 64, 70])
def test_prompt_prefilled_in_two_chunks_gives_transformers_two_chunk_logits(pair, split):
    """The split as transformers makes it (its cache carried between two calls). Either way
    the second chunk's logits differ from one pass's in float32, by up to 2.7e-5 for the
    first config: the chunked delta rule sums in another order."""
    hf, model = pair
    prompt = prompts(model.config.vocab_size, lengths=(90,))["seq0"]
    whole = HybridRunner(model).step({"a": prompt}, all_logits=True)
    runner = HybridRunner(model, seed=1)
    runner.step({"a": prompt[:split]})
    second = runner.step({"a": prompt[split:]}, all_logits=True)
    ids = torch.tensor([prompt], device=whole.device)
    with torch.no_grad():
        first = hf(ids[:, :split], use_cache=True)
        theirs = hf(ids[:, split:], past_key_values=first.past_key_values).logits[0]
    assert relative_error(second, theirs) < 1e-5
    assert relative_error(second, whole[split:]) < 1e-4


# --- through the engine ---

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory, device):
    """A checkpoint, prompts (three share a 66-token prefix: one checkpoint at the delta
    rule's chunk of 64) and transformers' greedy continuations of each."""
    hf = make_qwen3_next("qwen3-next")
    folder = save_hf_model(hf, tmp_path_factory.mktemp("qwen3-next-engine"))
    shared = prompts(160, lengths=(66,), seed=2)["seq0"]
    batch = list(prompts(160, lengths=(5, 13), seed=3).values())
    batch += [shared + tail for tail in prompts(160, lengths=(1, 6, 9), seed=4).values()]
    return folder, batch, [hf_greedy(hf.to(device), prompt, MAX_TOKENS) for prompt in batch]


def test_engine_greedy_outputs_with_prefix_hits_and_chunks_equal_transformers(case, device):
    folder, batch, expected = case
    llm = LLM(folder, num_pages=128, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              device=device)
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.cache.stats().prefix_hit_tokens >= 64  # from the checkpoint after 64 tokens
    llm.check()


def test_engine_greedy_outputs_survive_preemption(case, device):
    folder, batch, expected = case
    llm = LLM(folder, num_pages=32, page_size=4, device=device)  # the longest request needs 27
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    llm.check()


# --- configs ---

BASE = {"architectures": ["Qwen3NextForCausalLM"], **SMALL}


def test_the_state_slot_holds_the_conv_inputs_and_a_key_by_value_state_per_value_head():
    config = ModelConfig.from_hf({**BASE, "num_hidden_layers": 8})
    assert config.mamba.layers == (0, 1, 2, 4, 5, 6)  # an attention layer every 4th
    assert config.attention_layers == (3, 7)
    # conv over q, k, v: 2 x 2 x 8 + 4 x 12 channels; a state of 8 x 12 per value head
    assert config.mamba_layout(dtype=torch.bfloat16) == MambaLayout(
        6, 80, 4, 4, 8, 12, torch.bfloat16)


def test_transformers_defaults_where_the_config_leaves_keys_out():
    config = ModelConfig.from_hf({"architectures": ["Qwen3NextForCausalLM"],
                                  "vocab_size": 160, "hidden_size": 2048,
                                  "num_hidden_layers": 48, "num_attention_heads": 16})
    assert (config.head_dim, config.rotary_dim, config.qk_norm) == (256, 64, True)
    assert (config.num_kv_heads, config.intermediate_size) == (2, 5632)
    m = config.mamba
    assert (m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, m.conv_kernel) == (
        16, 32, 128, 128, 4)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size,
            moe.shared_gate, moe.norm_topk_prob) == (512, 10, 512, 512, True, True)


def test_full_attention_interval_is_read_only_without_layer_types_as_transformers_reads_it():
    types = ["linear_attention", "full_attention"] * 2
    config = ModelConfig.from_hf({**BASE, "layer_types": types, "full_attention_interval": 0})
    assert config.attention_layers == (1, 3)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameters_are_counted_as_transformers_builds_them(name):
    hf = make_qwen3_next(name)
    config = ModelConfig.from_hf({**hf.config.to_dict(), "architectures": ["Qwen3NextForCausalLM"]})
    assert config.count_parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_types": ["linear_attention"] * 4}, "layer_types leaves no attention layer of its 4"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types leaves no state layer of its 4"),
    ({"layer_types": None, "full_attention_interval": 1},
     "layer_types leaves no state layer of its 4"),
    ({"layer_types": ["linear_attention", "full_attention", "mamba", "full_attention"]},
     "'layer_types' must list linear_attention or full_attention for each of the 4 layers"),
    ({"layer_types": ["full_attention"] * 3}, "for each of the 4 layers"),
    ({"linear_num_key_heads": 3}, "linear_num_key_heads=3 does not divide "
                                  "linear_num_value_heads=4"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim=1 is not supported"),
    ({"linear_key_head_dim": 0}, "'linear_key_head_dim' must be a positive integer"),
    ({"full_attention_interval": 0}, "'full_attention_interval' must be a positive integer"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
])
def test_unsupported_configs_name_the_field_and_value(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf({**BASE, **change})


def test_tensor_parallelism_over_the_delta_net_layers_is_refused_naming_the_ranks():
    config = ModelConfig.from_hf(BASE)
    with pytest.raises(ConfigError, match="tensor parallelism over 2 ranks is not supported"):
        config.mamba_layout(tensor_parallel_size=2)
