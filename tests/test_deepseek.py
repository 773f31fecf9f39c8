"""DeepSeek-V2/V3 (MLA latent pages, dense and MoE layers, yarn rope) against transformers, the
config checks, and absorbed against expanded attention."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvpool.attention import AttentionMetadata, write_latent
from kvpool.cli.main import main
from kvpool.engine import SamplingParams
from kvpool.errors import CheckpointError, ConfigError
from kvpool.forward_context import HostLengths
from kvpool.models.config import ModelConfig
from kvpool.models.loader import load_model
from kvpool.models.mla import softmax_scale
from kvpool.models.rotary import attention_factor, inv_frequencies
from kvpool.planning.planner import plan_memory
from models_util import (
    PagedRunner,
    assert_logits_match,
    check_engine_with_preemption,
    check_engine_with_prefix_hits_and_chunks,
    engine_case,
    hf_greedy,
    make_hf_model,
    prompts,
    save_hf_model,
)
from test_models import MAX_TOKENS

SMALL = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3,
    num_key_value_heads=4, first_k_dense_replace=1, max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}
CONFIGS = {
    # V2-Lite's shape: no q_lora, softmax greedy routing, two shared experts
    "v2-lite": lambda: transformers.DeepseekV2Config(
        **SMALL, q_lora_rank=None, n_shared_experts=2, topk_method="greedy"),
    "v2-lite-biases": lambda: transformers.DeepseekV2Config(
        **SMALL, q_lora_rank=None, n_shared_experts=2, attention_bias=True, mlp_bias=True),
    # V2's: q_lora, group-limited routing scaled, yarn rope with mscale
    "v2-grouped-yarn": lambda: transformers.DeepseekV2Config(
        **SMALL, q_lora_rank=24, n_shared_experts=1, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=2.0, rope_parameters=YARN),
    # V3's: sigmoid scores with the correction bias, grouped, normalised, scaled, yarn rope
    "v3-yarn": lambda: transformers.DeepseekV3Config(
        **SMALL, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=YARN),
    "v3-rope-not-interleaved": lambda: transformers.DeepseekV3Config(
        **SMALL, q_lora_rank=24, n_shared_experts=1, n_group=2, topk_group=1,
        rope_interleave=False),
    # biases on the q_lora projection too, and a large epsilon for the decoder's norms that
    # the latent norms (q_a_layernorm, kv_a_layernorm: transformers' default) do not take
    "v3-biases-norm-eps": lambda: transformers.DeepseekV3Config(
        **SMALL, q_lora_rank=24, n_shared_experts=1, n_group=2, topk_group=1,
        attention_bias=True, rms_norm_eps=0.5),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers model, the same checkpoint loaded by kvpool) for one DeepSeek case."""
    hf = make_hf_model(request.param, configs=CONFIGS)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf.to(device), load_model(folder, device=device).model


def test_packed_prefill_logits_match_transformers(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    assert_logits_match(hf, batch, PagedRunner(model).step(batch, all_logits=True))


def test_batched_greedy_decode_on_scattered_latent_pages_matches_transformers(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    runner = PagedRunner(model)
    assert runner.cache.pool.kv.shape[1] == 1  # one latent plane, no V
    ours = runner.greedy(batch, MAX_TOKENS)
    for seq_id, prompt in batch.items():
        assert ours[seq_id] == hf_greedy(hf, prompt, MAX_TOKENS)
    runner.cache.check()


def with_an_extra_layer(folder, layer: int = 3):
    """Add tensors of layer `layer`, past the 3 of num_hidden_layers (as V3's
    multi-token-prediction module ships, in layer 3), to the checkpoint in `folder`."""
    weights = load_file(folder / "model.safetensors")
    weights[f"model.layers.{layer}.eh_proj.weight"] = torch.zeros(64, 128)
    weights[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(64)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def with_config(folder, **keys):
    """Set `keys` in the config.json of the checkpoint in `folder` (None: leave it out)."""
    config = {**json.loads((folder / "config.json").read_text()), **keys}
    config = {key: value for key, value in config.items() if value is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_v3_loads_without_its_multi_token_prediction_layers(tmp_path, device):
    hf = make_hf_model("v3-rope-not-interleaved", configs=CONFIGS)
    model = load_model(with_an_extra_layer(save_hf_model(hf, tmp_path)), device=device).model
    assert len(model.model.layers) == 3


def test_v3_refuses_tensors_of_a_layer_past_its_multi_token_prediction_layer(tmp_path, device):
    hf = make_hf_model("v3-rope-not-interleaved", configs=CONFIGS)
    with pytest.raises(CheckpointError, match=r"unexpected weights: model\.layers\.4\.eh_proj"):
        load_model(with_an_extra_layer(save_hf_model(hf, tmp_path), layer=4), device=device)


@pytest.mark.parametrize("keys", [{"num_nextn_predict_layers": 0},
                                  {"num_nextn_predict_layers": None, "num_mtp_layers": 0}])
def test_v3_of_no_multi_token_prediction_layers_refuses_a_layer_past_its_own(tmp_path, device,
                                                                             keys):
    folder = with_config(save_hf_model(make_hf_model("v3-rope-not-interleaved",
                                                     configs=CONFIGS), tmp_path), **keys)
    with pytest.raises(CheckpointError, match=r"unexpected weights: model\.layers\.3\.eh_proj"):
        load_model(with_an_extra_layer(folder), device=device)


def test_v3_skips_as_many_multi_token_prediction_layers_as_its_config_names(tmp_path, device):
    folder = with_config(save_hf_model(make_hf_model("v3-rope-not-interleaved",
                                                     configs=CONFIGS), tmp_path),
                         num_nextn_predict_layers=2)
    model = load_model(with_an_extra_layer(with_an_extra_layer(folder), layer=4),
                       device=device).model
    assert len(model.model.layers) == 3


def test_v2_refuses_tensors_of_a_layer_it_does_not_have(tmp_path, device):
    hf = make_hf_model("v2-lite", configs=CONFIGS)
    with pytest.raises(CheckpointError, match=r"unexpected weights: model\.layers\.3\.eh_proj"):
        load_model(with_an_extra_layer(save_hf_model(hf, tmp_path)), device=device)


# --- through the engine ---

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory, device):
    return engine_case("v3-yarn", CONFIGS, tmp_path_factory.mktemp("v3-engine"), device, MAX_TOKENS)


def test_engine_greedy_outputs_with_prefix_hits_and_chunks_equal_transformers(case, device):
    check_engine_with_prefix_hits_and_chunks(case, device, GREEDY)


def test_engine_greedy_outputs_survive_preemption(case, device):
    check_engine_with_preemption(case, device, GREEDY)


# --- latent pages ---

def test_write_latent_puts_each_token_at_its_slot_and_nothing_else(device):
    cache = torch.zeros(3, 4, 1, 8, device=device)
    latent = torch.arange(16, dtype=torch.float32, device=device).view(2, 1, 8) + 1
    write_latent(cache, torch.tensor([5, 11], device=device), latent)
    assert torch.equal(cache[1, 1], latent[0]) and torch.equal(cache[2, 3], latent[1])
    assert torch.count_nonzero(cache) == 16


# Slots are checked on the CPU only: on CUDA reading them back would synchronise.
def test_write_latent_refuses_a_slot_outside_the_pages_and_writes_nothing():
    cache = torch.zeros(3, 4, 1, 8)
    with pytest.raises(IndexError, match=r"write_latent: slot 12 \(token 1\) is outside"):
        write_latent(cache, torch.tensor([0, 12]), torch.ones(2, 1, 8))
    assert torch.count_nonzero(cache) == 0


def test_write_latent_refuses_a_latent_of_the_wrong_shape(device):
    with pytest.raises(ValueError, match=r"expects latent \[n, 1, 8\]"):
        write_latent(torch.zeros(3, 4, 1, 8, device=device), torch.tensor([0], device=device),
                     torch.ones(1, 1, 6, device=device))


# --- absorbed and expanded attention ---

def mixed_batch(layer, cache_pages: int = 24, page_size: int = 4):
    """A batch of a decode row, a whole prompt and a chunk over a prefix, on shuffled pages
    of random latents (seq_lens 13, 6 and 11 tokens; 1, 6 and 3 new)."""
    mla, heads = layer.mla, layer.num_heads
    device = next(layer.parameters()).device
    torch.manual_seed(0)
    cache = torch.randn(cache_pages, page_size, 1, mla.latent_dim).to(device)
    q_lens, seq_lens = [1, 6, 3], [13, 6, 11]
    host = HostLengths([0, 1, 7, 10], seq_lens, 13, 6)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
        page_tables=torch.randperm(cache_pages)[:12].view(3, 4).int().to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, 1, 7, 10], dtype=torch.int32, device=device),
    )
    q_nope = torch.randn(sum(q_lens), heads, mla.qk_nope_head_dim).to(device)
    q_pe = torch.randn(sum(q_lens), heads, mla.qk_rope_head_dim).to(device)
    return q_nope, q_pe, meta, host, cache


@pytest.fixture(scope="module")
def v2_lite(tmp_path_factory, device):
    hf = make_hf_model("v2-lite", configs=CONFIGS)
    return load_model(save_hf_model(hf, tmp_path_factory.mktemp("v2-lite")), device=device).model


def test_absorbed_and_expanded_attention_agree_on_every_kind_of_row(v2_lite):
    layer = v2_lite.model.layers[0].self_attn
    q_nope, q_pe, meta, host, cache = mixed_batch(layer)
    absorbed = layer.attend_absorbed(q_nope, q_pe, meta, cache)
    expanded = layer.attend_expanded(q_nope, q_pe, meta, host, cache)
    assert absorbed.shape == (10, 4, 24)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)


def test_a_mixed_batch_runs_each_row_as_its_own_batch_would(v2_lite):
    layer = v2_lite.model.layers[0].self_attn
    q_nope, q_pe, meta, host, cache = mixed_batch(layer)
    mixed = layer.attend(q_nope, q_pe, meta, host, cache)
    torch.testing.assert_close(mixed, layer.attend_expanded(q_nope, q_pe, meta, host, cache),
                               rtol=1e-5, atol=1e-5)


def test_decode_and_prefill_in_one_step_match_separate_steps(v2_lite):
    batch = prompts(v2_lite.config.vocab_size, lengths=(9, 14))
    apart = PagedRunner(v2_lite)
    apart.step({"a": batch["seq0"]})
    decode_alone = apart.step({"a": [5]})
    prefill_alone = apart.step({"b": batch["seq1"]})
    together = PagedRunner(v2_lite, seed=1)
    together.step({"a": batch["seq0"]})
    both = together.step({"a": [5], "b": batch["seq1"]})
    torch.testing.assert_close(both, torch.cat([decode_alone, prefill_alone]),
                               rtol=1e-5, atol=1e-5)


# --- routing ---

@pytest.fixture(scope="module")
def v3_routers(tmp_path_factory, device):
    """The first MoE layer's router of a float32 DeepSeek-V3 checkpoint loaded in bfloat16,
    and transformers' router of that layer, whose weight a bfloat16 load keeps in float32."""
    hf = make_hf_model("v3-yarn", configs=CONFIGS)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("v3-routers"))
    model = load_model(folder, device=device, dtype=torch.bfloat16).model
    return model.model.layers[1].mlp.gate, hf.model.layers[1].mlp.gate.to(device)


def routes(gate, hf_gate, device):
    """Both routers' (weights, expert ids) of 64 random bf16 tokens, each token's experts
    in ascending order."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(device,
                                                                          torch.bfloat16)
    weights, ids = gate(x)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_gate(x)
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    return ((weights.gather(1, order), ids.gather(1, order)),
            (hf_weights.gather(1, hf_order), hf_ids.gather(1, hf_order)))


def test_a_bf16_v3_router_keeps_its_weight_and_scores_in_float32_as_transformers(v3_routers,
                                                                                 device):
    gate, hf_gate = v3_routers
    assert gate.weight.dtype == torch.float32
    assert torch.equal(gate.weight, hf_gate.weight)  # the checkpoint's, unrounded
    (weights, ids), (hf_weights, hf_ids) = routes(gate, hf_gate, device)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights.float(), hf_weights)  # never rounded to bf16 on the way
    assert weights.dtype == torch.float32


def test_v3_routes_within_the_chosen_groups_even_when_every_biased_score_is_negative(
        v3_routers, device):
    # sigmoid scores lie in (0, 1): a bias of -2 puts every expert's biased score below the
    # 0 that masks softmax scores, so the experts of the other groups must rank lower still
    gate, hf_gate = (copy.deepcopy(router) for router in v3_routers)
    for router in (gate, hf_gate):
        router.e_score_correction_bias.fill_(-2.0)
    (_, ids), (_, hf_ids) = routes(gate, hf_gate, device)
    assert torch.equal(ids, hf_ids)
    moe = gate.moe
    groups = ids // (moe.num_experts // moe.num_groups)
    assert all(len(set(chosen)) <= moe.topk_groups for chosen in groups.tolist())


# --- configs and planning ---

# The published config.json files, trimmed of fields nothing reads (auto_map, quantization).
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "attention_bias": False, "bos_token_id": 100000, "eos_token_id": 100001,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 1.0,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "scoring_func": "softmax", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "greedy", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400,
}
V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}


@pytest.mark.parametrize(("config", "hf_class"), [(V2_LITE, transformers.DeepseekV2Config),
                                                   (V3, transformers.DeepseekV3Config)],
                         ids=["v2-lite", "v3"])
def test_without_first_k_dense_replace_the_experts_start_where_transformers_starts_them(
        config, hf_class):
    dense = hf_class().first_k_dense_replace
    ours = ModelConfig.from_hf({k: v for k, v in config.items() if k != "first_k_dense_replace"})
    assert ours.moe.layers == tuple(range(dense, config["num_hidden_layers"]))


def test_v2_lite_stores_one_latent_of_576_values_per_token_and_layer():
    layout = ModelConfig.from_hf(V2_LITE).kv_layout()
    assert (layout.kind, layout.num_kv_heads, layout.head_dim) == ("mla", 1, 512 + 64)
    assert layout.bytes_per_token == 27 * 576 * 2  # bf16: 31,104 bytes


@pytest.mark.parametrize(("config", "hf_class", "expected"), [
    (V2_LITE, transformers.DeepseekV2Config, 15_706_484_224),  # "15.7B total"
    (V3, transformers.DeepseekV3Config, 671_026_419_200),  # "671B", the MTP module left out
])
def test_parameters_are_counted_exactly_as_the_checkpoint_stores_them(
        config, hf_class, expected):
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_class.from_dict(config))
    router_biases = sum(b.numel() for name, b in hf.named_buffers()
                        if name.endswith("e_score_correction_bias"))  # V3: 58 layers x 256
    assert ModelConfig.from_hf(config).count_parameters() == expected
    assert expected == hf.num_parameters() + router_biases


def test_plan_holds_the_latent_tokens_the_budget_allows():
    plan = plan_memory(ModelConfig.from_hf(V2_LITE), 80 * 2**30, activation_bytes=0)
    assert plan.layout.bytes_per_token == 31_104
    # its 26 MoE layers' routers (64 experts x 2,048) in float32, every other weight in bf16
    routers = 26 * 64 * 2048
    weights = (15_706_484_224 - routers) * 2 + routers * 4
    assert plan.num_pages == (int(80 * 2**30 * 0.9) - weights) // (16 * 31_104) - 1


def test_kvpool_plan_shows_the_mla_layout_of_a_v2_lite_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(V2_LITE))
    assert main(["plan", str(tmp_path), "--device-memory", "80GiB"]) == 0
    table = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    table = {label.strip(): value.strip() for label, value in table.items()}
    assert table["KV layout"] == "MLA latent, 576 values (kv_lora_rank 512 + rope 64), 27 layers"
    assert table["KV bytes per token"] == "31,104 (30.38 KiB)"
    assert table["tokens"] == "1,465,136"  # 91,571 pages of 16 (and the reserved one)


def test_kvpool_plan_shows_fp8_latent_pages_of_a_v2_lite_config_at_half_the_bytes(
        tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(V2_LITE))
    assert main(["plan", str(tmp_path), "--device-memory", "80GiB",
                 "--kv-cache-dtype", "fp8_e4m3"]) == 0
    table = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    table = {label.strip(): value.strip() for label, value in table.items()}
    assert table["KV dtype"] == "float8_e4m3fn"
    assert table["KV bytes per token"] == "15,552 (15.19 KiB)"  # 27 layers x 576 x 1 byte
    assert table["tokens"] == "2,930,304"  # 183,144 pages of 16: the bf16 budget, twice the pages


@pytest.mark.parametrize(("change", "message"), [
    ({"moe_layer_freq": 2}, "unsupported moe_layer_freq 2"),
    ({"scoring_func": "sigmoid"}, "unsupported scoring_func 'sigmoid'"),
    ({"topk_method": "noaux_tc"}, "unsupported topk_method 'noaux_tc'"),
    ({"norm_topk_prob": True}, "norm_topk_prob=true is not supported"),
    ({"topk_method": "group_limited_greedy", "n_group": 5},
     "n_routed_experts=64 is not a multiple of n_group=5"),
    ({"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 1,
      "num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds the 8 experts"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim must be even"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope_type 'dynamic'"),
])
def test_unsupported_deepseek_configs_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(V2_LITE | change)


@pytest.mark.parametrize(("config", "hf_class"), [(V2_LITE, transformers.DeepseekV2Config),
                                                  (V3, transformers.DeepseekV3Config)])
def test_yarn_frequencies_factor_and_softmax_scale_equal_transformers(config, hf_class):
    hf_config = hf_class.from_dict(config)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    ours = ModelConfig.from_hf(config)
    assert torch.equal(inv_frequencies(ours, device="cpu"), hf_inv_freq)
    assert attention_factor(ours) == hf_factor
    hf_module = transformers.models.deepseek_v3.modeling_deepseek_v3
    assert softmax_scale(ours) == hf_module.yarn_apply_mscale(hf_config.rope_parameters,
                                                              192 ** -0.5)
