"""GPT-OSS checkpoints whose experts are MXFP4, as gpt-oss-20b and -120b are published (each
layer's `mlp.experts.gate_up_proj` and `down_proj` as `_blocks` of e2m1 codes and `_scales`
of e8m0 exponents, `quantization_config` `mxfp4`): loaded dequantized, each expert holds
exactly the values its blocks stand for, and the model gives the logits and greedy tokens of
transformers loading the same checkpoint dequantized; malformed ones are refused naming what
is wrong, and the plan counts the dequantized weights the engine holds."""

from __future__ import annotations

import copy
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvpool.engine import SamplingParams
from kvpool.errors import CheckpointError, ConfigError
from kvpool.models.config import PRESETS, ModelConfig
from kvpool.models.loader import load_config, load_model
from kvpool.models.parallel import TensorParallel
from kvpool.planning.planner import plan_memory
from models_util import (
    assert_greedy_decode_matches,
    assert_prefill_logits_match,
    case_of,
    check_engine_with_prefix_hits_and_chunks,
    make_hf_model,
    rewrite_weight,
    save_hf_model,
)
from test_cli import plan_table
from test_gpt_oss import CONFIGS, make_gpt_oss
from test_models import MAX_TOKENS

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # by code; code | 8: negated
STACKS = ("gate_up_proj", "down_proj")
# gpt-oss-20b's: every module but the experts stored unquantized
PUBLISHED = {"quant_method": "mxfp4",
             "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                        "model.embed_tokens", "lm_head"]}
# gpt-oss-20b's config.json as published (no dtype stated; its unquantized weights bf16)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": PUBLISHED, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
    "use_cache": True, "vocab_size": 201088,
}


def quantized(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, scales, values): a stack [experts, in, out] (x @ W) in MXFP4 as published,
    blocks [experts, out, in / 32, 16] (two codes a byte, the first in the low nibble) and
    scales [experts, out, in / 32] (the exponent + 127); each block of 32 values along `in`
    scaled by the power of two that brings its largest magnitude into [4, 8), each value
    rounded to the nearest code (6 at most). `values` [experts, in, out]: what they stand
    for."""
    groups = stack.mT.unflatten(-1, (-1, 32))
    exponents = groups.abs().amax(-1).log2().floor() - 2
    scaled = groups / exponents.exp2().unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    values = torch.where(scaled < 0, -E2M1[codes], E2M1[codes]) * exponents.exp2().unsqueeze(-1)
    codes |= (scaled < 0).long() << 3
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return blocks, (exponents + 127).to(torch.uint8), values.flatten(-2).mT


def mxfp4_checkpoint(hf: transformers.PreTrainedModel, folder: Path, kept=()) -> Path:
    """Save `hf` into `folder` as gpt-oss releases are: its experts' stacks MXFP4 (but those
    of the layers `kept`, which modules_to_not_convert names), first set to the values the
    blocks stand for, so that `hf` is the model the checkpoint holds. Returns `folder`."""
    quantized_stacks = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for name in STACKS if i not in kept else ():
                stack = getattr(layer.mlp.experts, name)
                blocks, scales, values = quantized(stack)
                stack.copy_(values)
                quantized_stacks[f"model.layers.{i}.mlp.experts.{name}"] = blocks, scales
    hf.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    for name, (blocks, scales) in quantized_stacks.items():
        del weights[name]
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
    save_file(weights, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    kept_modules = [f"model.layers.{i}.mlp.experts" for i in kept]
    config["quantization_config"] = {
        **PUBLISHED, "modules_to_not_convert": PUBLISHED["modules_to_not_convert"] + kept_modules}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def dequantized_by_transformers(folder: Path, dtype=None) -> transformers.PreTrainedModel:
    """transformers' model of an MXFP4 checkpoint, its experts dequantized at load."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the transformers model a published-form MXFP4 checkpoint holds, its folder)."""
    hf = make_gpt_oss("gpt-oss")
    return hf, mxfp4_checkpoint(hf, tmp_path_factory.mktemp("gpt-oss-mxfp4"))


def assert_experts_equal(ours, hf: transformers.PreTrainedModel) -> None:
    """Each expert of `ours` holds its columns of `hf`'s stacks (in its dtype and device)."""
    for mine, theirs in zip(ours.model.layers, hf.model.layers, strict=True):
        experts = theirs.mlp.experts
        for expert, mlp in enumerate(mine.mlp.experts):
            gate_up = experts.gate_up_proj[expert].to(mlp.gate_proj.weight)
            assert torch.equal(mlp.gate_proj.weight, gate_up[:, 0::2].T)
            assert torch.equal(mlp.up_proj.weight, gate_up[:, 1::2].T)
            assert torch.equal(mlp.down_proj.weight,
                               experts.down_proj[expert].T.to(mlp.down_proj.weight))


def test_the_published_config_reads_as_mxfp4_experts_in_bfloat16():
    config = ModelConfig.from_hf(GPT_OSS_20B)
    assert config.mxfp4_experts and config.fp8_weight_block is None
    assert config.dtype == torch.bfloat16
    assert config == replace(ModelConfig.from_hf("gpt-oss-20b"), mxfp4_experts=True,
                             eos_token_ids=(200002,))


def test_a_stated_dtype_is_kept(checkpoint):
    config = load_config(checkpoint[1])
    assert config.mxfp4_experts and config.dtype == torch.float32


def test_a_checkpoint_that_states_no_dtype_loads_its_experts_in_bfloat16(checkpoint, tmp_path):
    hf, folder = checkpoint
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["dtype"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path, device="cpu").model
    assert model.config.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.experts[0].gate_proj.weight.dtype == torch.bfloat16
    assert_experts_equal(model, hf)


def test_each_expert_loads_exactly_the_values_its_blocks_stand_for(checkpoint, device):
    hf, folder = checkpoint
    assert_experts_equal(load_model(folder, device=device).model, hf)


def test_transformers_reads_the_blocks_as_the_same_values(checkpoint):
    hf, folder = checkpoint
    theirs = dequantized_by_transformers(folder)
    for mine, layer in zip(hf.model.layers, theirs.model.layers, strict=True):
        for name in STACKS:
            assert torch.equal(getattr(mine.mlp.experts, name), getattr(layer.mlp.experts, name))


def test_in_bfloat16_the_experts_are_transformers_dequantized_values_exactly(checkpoint):
    folder = checkpoint[1]
    ours = load_model(folder, dtype=torch.bfloat16, device="cpu").model
    theirs = dequantized_by_transformers(folder, torch.bfloat16)
    assert theirs.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert_experts_equal(ours, theirs)
    assert_experts_equal(ours, checkpoint[0])  # the values are exact in bfloat16


@pytest.fixture(scope="module")
def pair(checkpoint, device):
    """(transformers loading the MXFP4 checkpoint dequantized, kvpool loading it)."""
    folder = checkpoint[1]
    return dequantized_by_transformers(folder).to(device), load_model(folder, device=device).model


def test_prefill_logits_match_transformers_dequantized(pair):
    assert_prefill_logits_match(*pair)


def test_greedy_decode_matches_transformers_dequantized(pair):
    assert_greedy_decode_matches(*pair, MAX_TOKENS)


def test_engine_greedy_outputs_with_prefix_hits_and_chunks_equal_transformers(
        checkpoint, tmp_path, device):
    hf, folder = checkpoint
    # transformers' tokens on the values the blocks stand for (a copy: case_of moves it)
    case = case_of(copy.deepcopy(hf), tmp_path, device, MAX_TOKENS)._replace(folder=folder)
    check_engine_with_prefix_hits_and_chunks(
        case, device, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))


def test_a_layer_modules_to_not_convert_names_loads_its_unquantized_experts(tmp_path):
    hf = make_gpt_oss("gpt-oss")
    kept = hf.model.layers[1].mlp.experts.gate_up_proj.clone()
    folder = mxfp4_checkpoint(hf, tmp_path, kept=(1,))
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(folder / "model.safetensors")
    model = load_model(folder, device="cpu").model
    assert_experts_equal(model, hf)
    assert torch.equal(hf.model.layers[1].mlp.experts.gate_up_proj, kept)  # left as it was


def test_scales_in_another_shard_than_their_blocks_are_read_there(checkpoint, tmp_path):
    hf, folder = checkpoint
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    scales = {name: weights.pop(name) for name in list(weights) if name.endswith("_scales")}
    save_file(weights, tmp_path / "model-1.safetensors")
    save_file(scales, tmp_path / "model-2.safetensors")
    weight_map = {name: "model-1.safetensors" for name in weights} | \
        {name: "model-2.safetensors" for name in scales}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_experts_equal(load_model(tmp_path, device="cpu").model, hf)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_loads_its_part_of_the_dequantized_experts(
        checkpoint, tmp_path, rank):
    hf, folder = checkpoint  # gate and up: each rank's rows; down: its columns
    unquantized = save_hf_model(hf, tmp_path)
    tp = TensorParallel(rank, 2)
    ours = load_model(folder, device="cpu", tp=tp).model.state_dict()
    reference = load_model(unquantized, device="cpu", tp=tp).model.state_dict()
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(ours[name], value), name


# --- refusals ---

BLOCKS = "model.layers.0.mlp.experts.gate_up_proj_blocks"  # [8, 64, 2, 16]
SCALES = "model.layers.0.mlp.experts.gate_up_proj_scales"  # [8, 64, 2]


def fresh_checkpoint(folder: Path) -> Path:
    return mxfp4_checkpoint(make_hf_model("gpt-oss", configs=CONFIGS), folder)


def test_mxfp4_on_another_family_is_refused_naming_it():
    config = make_hf_model("llama").config.to_dict() | {"quantization_config": PUBLISHED}
    with pytest.raises(ConfigError, match="quant_method 'mxfp4' is supported on "
                                          "GptOssForCausalLM only .* not on LlamaForCausalLM"):
        ModelConfig.from_hf(config)


def test_modules_to_not_convert_other_than_a_list_of_names_is_refused_naming_it():
    config = {**PRESETS["gpt-oss-20b"],
              "quantization_config": {**PUBLISHED, "modules_to_not_convert": "lm_head"}}
    with pytest.raises(ConfigError, match="modules_to_not_convert must be a list of module "
                                          "names, got 'lm_head'"):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize(("name", "change", "shapes"), [
    (BLOCKS, lambda t: t[..., :15], "(8, 64, 2, 15) and model.layers.0.mlp.experts."
                                    "gate_up_proj_scales (8, 64, 2)"),
    (SCALES, lambda t: t[:, :, :1], "(8, 64, 2, 16) and model.layers.0.mlp.experts."
                                    "gate_up_proj_scales (8, 64, 1)"),
    (BLOCKS, lambda t: t.flatten(-2), "(8, 64, 32) and model.layers.0.mlp.experts."
                                      "gate_up_proj_scales (8, 64, 2)"),
], ids=["bytes-per-block", "scales-per-row", "3-d"])
def test_blocks_and_scales_of_other_shapes_are_refused_naming_both(tmp_path, name, change,
                                                                   shapes):
    folder = fresh_checkpoint(tmp_path)
    rewrite_weight(folder, name, change)
    with pytest.raises(CheckpointError, match=re.escape(f"{BLOCKS} has shape {shapes} in the "
                                                        f"checkpoint; MXFP4 needs")):
        load_model(folder, device="cpu")


def test_blocks_without_their_scales_are_refused_naming_them(tmp_path):
    folder = fresh_checkpoint(tmp_path)
    weights = load_file(folder / "model.safetensors")
    del weights[SCALES]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape(f"{BLOCKS} has no {SCALES}")):
        load_model(folder, device="cpu")


def test_a_stack_held_unquantized_and_as_blocks_is_refused_naming_it(tmp_path):
    folder = fresh_checkpoint(tmp_path)
    rewrite_weight(folder, "model.layers.0.mlp.experts.gate_up_proj",
                   lambda _: torch.zeros(8, 64, 64))
    with pytest.raises(CheckpointError, match="holds model.layers.0.mlp.experts.gate_up_proj "
                                              "and its MXFP4 blocks too"):
        load_model(folder, device="cpu")


def test_blocks_of_another_number_of_experts_are_refused_naming_the_stack(tmp_path):
    folder = fresh_checkpoint(tmp_path)
    rewrite_weight(folder, BLOCKS, lambda t: t[:7])
    rewrite_weight(folder, SCALES, lambda t: t[:7])
    with pytest.raises(CheckpointError, match=re.escape(
            "model.layers.0.mlp.experts.gate_up_proj has shape (7, 64, 64) in the checkpoint, "
            "the config needs 8 experts")):
        load_model(folder, device="cpu")


def test_blocks_of_another_dtype_are_refused_naming_it(tmp_path):
    folder = fresh_checkpoint(tmp_path)
    rewrite_weight(folder, SCALES, lambda t: t.float())
    with pytest.raises(CheckpointError, match="gate_up_proj_blocks in model.safetensors is "
                                              "torch.uint8 and model.layers.0.mlp.experts."
                                              "gate_up_proj_scales in model.safetensors "
                                              "torch.float32; MXFP4 needs torch.uint8"):
        load_model(folder, device="cpu")


def test_the_nan_exponent_is_refused_naming_the_weight(tmp_path):
    folder = fresh_checkpoint(tmp_path)
    rewrite_weight(folder, SCALES, lambda t: t.index_fill(1, torch.tensor([0]), 255))
    with pytest.raises(CheckpointError, match=r"weight model\.layers\.0\.mlp\.experts\.0\."
                                              r"gate_proj\.weight .* NaN or infinite"):
        load_model(folder, device="cpu")


def test_blocks_of_another_weight_than_the_experts_are_unexpected_weights(tmp_path):
    folder = fresh_checkpoint(tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    rewrite_weight(folder, name + "_blocks", lambda _: torch.zeros(64, 2, 16, dtype=torch.uint8))
    rewrite_weight(folder, name + "_scales", lambda _: torch.zeros(64, 2, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match=re.escape(
            f"unexpected weights: {name}_blocks, {name}_scales")):
        load_model(folder, device="cpu")


def test_blocks_without_the_mxfp4_config_are_unexpected_weights(tmp_path):
    folder = fresh_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unexpected weights: .*_blocks"):
        load_model(folder, device="cpu")


# --- the plan ---

def test_the_plan_counts_the_dequantized_weights_the_model_holds(checkpoint):
    config = load_config(checkpoint[1])
    model = load_model(checkpoint[1], device="cpu").model
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan_memory(config, device_memory=2**30).weight_bytes == held


def test_plan_of_gpt_oss_20b_as_published_counts_its_experts_in_bfloat16(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    table = plan_table(capsys, str(tmp_path), "--device-memory", "80GiB")
    assert table["parameters"] == "20.91 B (20,914,757,184)"
    assert table["weights"] == "38.96 GiB"  # 41,829,514,368 bytes: 2 a parameter
