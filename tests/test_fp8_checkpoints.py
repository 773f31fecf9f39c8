"""Checkpoints of float8 weights with a scale per block (quantization_config `fp8` with
`weight_block_size`, as DeepSeek-V3 and Qwen3's FP8 releases are published): loaded
dequantized, they give the logits of transformers run on the dequantized weights; malformed
ones are refused naming what is wrong."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvpool.errors import CheckpointError, ConfigError
from kvpool.models import load_model
from kvpool.models.config import ModelConfig
from models_util import (
    CONFIGS,
    PagedRunner,
    assert_logits_match,
    make_hf_model,
    prompts,
    save_hf_model,
)
from test_deepseek import CONFIGS as DEEPSEEK

BLOCK = [32, 32]  # small enough that the test models' weights span several, some partial
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": BLOCK}
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def spread(scale: torch.Tensor, shape: torch.Size, block=BLOCK) -> torch.Tensor:
    """Each block's scale repeated over the block's elements of a weight of `shape`."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def quantize(weight: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale per block) with weight ~ float8 * scale, each block's
    largest magnitude mapped to e4m3's largest value."""
    rows, cols = weight.shape
    scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max() / E4M3_MAX
    return (weight / spread(scale, weight.shape, block)).to(torch.float8_e4m3fn), scale


def fp8_checkpoint(hf, folder: Path, *, drop_first_scale=False, block=BLOCK) -> Path:
    """Save `hf` into `folder` as an FP8 release is saved: every linear weight of the decoder
    layers float8 with its scale per `block` of (rows, columns) (embeddings, norms and head as
    they are); and into `folder / "dequantized"` the float32 checkpoint it stands for.
    Returns `folder`."""
    save_hf_model(hf, folder / "dequantized")
    for path in (folder / "dequantized").iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    weights = load_file(folder / "model.safetensors")
    dequantized = dict(weights)
    names = [n for n in weights if ".layers." in n and n.endswith("proj.weight")]
    for name in names:
        weights[name], scale = quantize(weights[name], block)
        dequantized[name] = weights[name].float() * spread(scale, weights[name].shape, block)
        if not (drop_first_scale and name == names[0]):
            weights[name + "_scale_inv"] = scale
    save_file(weights, folder / "model.safetensors")
    save_file(dequantized, folder / "dequantized" / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {
        **FP8, "weight_block_size": block}}))
    return folder


@pytest.mark.parametrize(("name", "configs"), [
    ("qwen3", CONFIGS), ("llama-rope-llama3-biases", CONFIGS),
    ("v3-yarn", DEEPSEEK),  # MLA projections and MoE experts, as DeepSeek-V3 is published
], ids=["qwen3", "llama-biases", "deepseek-v3"])
def test_fp8_block_weights_load_dequantized_and_give_transformers_logits(name, configs,
                                                                          tmp_path, device):
    folder = fp8_checkpoint(make_hf_model(name, configs=configs), tmp_path)
    loaded = load_model(folder, device=device)
    assert loaded.config.fp8_weight_block == tuple(BLOCK)
    reference = load_model(folder / "dequantized", device=device).model.state_dict()
    for param, value in loaded.model.state_dict().items():
        assert torch.equal(value, reference[param]), param
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "dequantized").to(device)
    hf.eval()
    batch = prompts(hf.config.vocab_size)
    assert_logits_match(hf, batch, PagedRunner(loaded.model).step(batch, all_logits=True))


def test_blocks_of_other_rows_than_columns_scale_each_block_by_its_own_scale(tmp_path):
    # down_proj [64, 96]: 4 x 3 blocks of 16 rows and 32 columns
    folder = fp8_checkpoint(make_hf_model("qwen3"), tmp_path, block=[16, 32])
    loaded = load_model(folder, device="cpu")
    assert loaded.config.fp8_weight_block == (16, 32)
    reference = load_model(folder / "dequantized", device="cpu").model.state_dict()
    for param, value in loaded.model.state_dict().items():
        assert torch.equal(value, reference[param]), param


def test_a_scale_of_no_weight_is_a_checkpoint_error(tmp_path):
    folder = fp8_checkpoint(make_hf_model("qwen3"), tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.mlp.extra_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"has scales of no weight: "
                                              r"model\.layers\.0\.mlp\.extra_proj\.weight_scale_inv"):
        load_model(folder, device="cpu")


def test_a_float8_weight_without_its_scale_is_a_checkpoint_error(tmp_path):
    folder = fp8_checkpoint(make_hf_model("qwen3"), tmp_path, drop_first_scale=True)
    with pytest.raises(CheckpointError, match=r"weight model\.layers\.0\.\S+ in "
                                              r"model\.safetensors is float8 with no "):
        load_model(folder, device="cpu")


def test_scales_without_quantization_config_are_unexpected_weights(tmp_path):
    folder = fp8_checkpoint(make_hf_model("qwen3"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unexpected weights: .*_scale_inv"):
        load_model(folder, device="cpu")


def test_a_scale_of_the_wrong_shape_names_the_shapes(tmp_path):
    folder = fp8_checkpoint(make_hf_model("qwen3"), tmp_path)
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 96]: 2 x 3 blocks of 32
    weights[name + "_scale_inv"] = weights[name + "_scale_inv"][:, :2].contiguous()
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"weight {name} in model.safetensors is "
                                              r"torch.float8_e4m3fn of shape \(64, 96\) with "
                                              r"a scale of shape \(2, 2\); .* \(2, 3\)"):
        load_model(folder, device="cpu")


@pytest.mark.parametrize(("quant", "message"), [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8"}, "quant_method 'fp8' without weight_block_size is not supported"),
    ({**FP8, "weight_block_size": [128]}, r"weight_block_size must be two ints .* \[128\]"),
    ({**FP8, "weight_block_size": [0, 128]}, "weight_block_size must be two ints"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ({**FP8, "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ("fp8", "'quantization_config' must be an object"),
], ids=["awq", "no-block", "one-number", "zero", "static", "e5m2", "not-an-object"])
def test_unsupported_quantization_configs_name_the_field(quant, message):
    config = make_hf_model("qwen3").config.to_dict() | {"quantization_config": quant}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(config)
