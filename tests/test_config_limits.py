"""Absurd configs and options are refused up front: config sizes are bounded (int64 and a sane
architectural limit named in the error), nothing is allocated by a context the pool can never
hold, and the CLI reports each case in one line with exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from kvpool.cache import KVCache
from kvpool.cache.state import StateSpec
from kvpool.cli.main import main
from kvpool.engine import LLM
from kvpool.engine.config import EngineConfig
from kvpool.errors import ConfigError, OutOfMemory
from kvpool.memory.layout import KVLayout
from kvpool.memory.state_pool import MambaLayout
from kvpool.models import config as config_module
from kvpool.models.config import PRESETS, SIZE_LIMITS, ModelConfig
from kvpool.models.hybrid_config import SIZE_LIMITS as MAMBA_SIZE_LIMITS


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size", "intermediate_size",
                                   "num_attention_heads", "vocab_size",
                                   "max_position_embeddings"])
def test_a_config_size_past_its_architectural_limit_is_refused_naming_the_limit(field):
    limit = SIZE_LIMITS[field]
    with pytest.raises(ConfigError, match=f"config '{field}' must be a positive integer at "
                                          f"most {limit} .*got {limit + 1}"):
        ModelConfig.from_hf({**PRESETS["tiny"], field: limit + 1})


def test_a_config_size_past_int64_is_refused():
    with pytest.raises(ConfigError, match="config 'sliding_window' must be in int64, got "
                                          "9223372036854775808"):
        ModelConfig.from_hf({**PRESETS["Mistral-7B"], "sliding_window": 2**63})


@pytest.mark.parametrize("field", ["n_routed_experts", "kv_lora_rank"])
def test_deepseek_sizes_are_bounded(field):
    config = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 1000,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, field: 10**19}
    with pytest.raises(ConfigError, match=f"config '{field}' must be a positive integer at "
                                          f"most {SIZE_LIMITS[field]}"):
        ModelConfig.from_hf(config)


def test_mamba_sizes_are_bounded():
    limit = MAMBA_SIZE_LIMITS["mamba_d_state"]
    with pytest.raises(ConfigError, match=f"'mamba_d_state' must be a positive integer at "
                                          f"most {limit}"):
        ModelConfig.from_hf({**PRESETS["Bamba-9B"], "mamba_d_state": 10**19})


def test_the_workspace_is_sized_by_the_pool_not_by_max_position_embeddings(monkeypatch):
    # 2**30 positions would size full-context page tables of 64 sequences at 32 GiB.
    monkeypatch.setitem(config_module.PRESETS, "tiny",
                        {**PRESETS["tiny"], "max_position_embeddings": 2**30})
    llm = LLM("tiny", num_pages=32, device="cpu")
    assert llm.max_model_len == 2**30
    assert llm.workspace.nbytes < 2**22
    output = llm.generate([[1, 2, 3]], use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 16


def _folder(tmp_path, text: str):
    (tmp_path / "config.json").write_text(text)
    return str(tmp_path)


def _one_line_error(capsys, command: str, message: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith(f"kvpool {command}: error: ") and message in err, err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("argv", [["plan"], ["generate", "hi", "--model"],
                                  ["serve", "--model"]])
def test_a_deeply_nested_config_is_one_line_with_exit_2(capsys, tmp_path, argv):
    folder = _folder(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert main([*argv, folder]) == 2
    _one_line_error(capsys, argv[0], "config.json is nested too deeply to be a model config")


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_serve_with_a_port_out_of_range_is_one_line_with_exit_2(capsys, port):
    assert main(["serve", "--port", port]) == 2
    _one_line_error(capsys, "serve", f"--port must be in [0, 65535], got {port}")


def test_serve_with_max_position_embeddings_past_int64_is_one_line_with_exit_2(capsys,
                                                                                 tmp_path):
    config = {**PRESETS["tiny"], "max_position_embeddings": 10**19}
    folder = _folder(tmp_path, json.dumps(config))
    assert main(["serve", "--model", folder, "--num-pages", "16"]) == 2
    _one_line_error(capsys, "serve", f"'max_position_embeddings' must be a positive integer "
                                     f"at most {2**31 - 1}")


def test_plan_of_10_to_the_19_layers_is_one_line_with_exit_2(capsys, tmp_path):
    folder = _folder(tmp_path, json.dumps({**PRESETS["tiny"], "num_hidden_layers": 10**19}))
    assert main(["plan", folder]) == 2
    _one_line_error(capsys, "plan", "'num_hidden_layers' must be a positive integer at most "
                                    "4096 (a sane architectural limit), got 10000000000000000000")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("rope_theta", 1e39, "config 'rope_theta' must be finite as a float32"),
    ("rope_theta", 10**400, "config 'rope_theta' must be finite as a float32"),
    ("rms_norm_eps", 1e-46, "config 'rms_norm_eps' must be a normal float32"),
], ids=["rope-theta-1e39", "rope-theta-10**400", "rms-norm-eps-1e-46"])
def test_a_config_number_float32_cannot_hold_is_refused(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**PRESETS["tiny"], field: value})


@pytest.mark.parametrize("option", ["page_size", "max_num_seqs", "max_num_batched_tokens",
                                    "num_pages", "max_model_len", "kv_cache_memory"])
def test_an_engine_option_past_int64_is_refused_naming_it(option):
    with pytest.raises(ValueError, match=f"{option} must be in \\[1, {2**63 - 1}\\], "
                                         f"got {10**20}"):
        LLM("tiny", device="cpu", **{option: 10**20})


@pytest.mark.parametrize(("options", "message"), [
    ({"memory_fraction": 0}, r"memory_fraction must be in \(0, 1\], got 0"),
    ({"overlap": True, "tensor_parallel_size": 2}, "overlap=True needs tensor_parallel_size 1"),
])
def test_an_engine_option_outside_what_it_allows_is_refused_naming_it(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_max_model_len_may_be_the_models_limit_but_not_past_it():
    model = ModelConfig.from_hf("tiny")
    limit = model.max_position_embeddings
    assert EngineConfig(max_model_len=limit).resolve_max_model_len(model) == limit
    with pytest.raises(ValueError, match=f"max_model_len {limit + 1} exceeds"):
        EngineConfig(max_model_len=limit + 1).resolve_max_model_len(model)


def test_a_part_page_of_context_takes_a_whole_page_table_column_of_the_workspace():
    model, config = ModelConfig.from_hf("tiny"), EngineConfig(page_size=16)
    layout = config.kv_layout(model)
    column = len(layout.groups) * config.max_num_seqs * 8  # an int64 page id per sequence
    assert config.workspace_bytes(model, layout, 17) == (
        config.workspace_bytes(model, layout, 16) + column)
    assert config.workspace_bytes(model, layout, 32) == config.workspace_bytes(model, layout, 17)


def test_a_windowed_pool_sizes_its_workspace_by_max_model_len_not_by_its_pages():
    # a windowed layer gives its pages back as a sequence grows: the pool's tokens bound nothing
    full = KVLayout(2, 1, 8, torch.float32, 16)
    windowed = KVLayout(2, 1, 8, torch.float32, 16, layer_windows=(64, 64))
    assert EngineConfig.longest_sequence(full, 4096, 10) == 160
    assert EngineConfig.longest_sequence(windowed, 4096, 10) == 4096


@pytest.mark.parametrize("option", ["max_num_seqs", "max_num_batched_tokens"])
def test_a_step_no_memory_can_hold_is_out_of_memory_naming_the_workspace(option):
    with pytest.raises(OutOfMemory, match="a workspace of [0-9,]+ bytes on cpu cannot be "
                                          "allocated"):
        LLM("tiny", device="cpu", num_pages=64, **{option: 2**62})


@pytest.mark.parametrize("make", [
    lambda n: StateSpec(MambaLayout(1, 4, 4, 1, 1, 1), num_slots=n),
    lambda n: StateSpec(MambaLayout(1, 4, 4, 1, 1, 1), num_slots=4, track_interval=n),
    lambda n: KVCache(KVLayout(1, 1, 8, torch.float32, 4), 8, device="cpu",
                      max_tokens_per_seq=n),
    lambda n: KVCache(KVLayout(1, 1, 8, torch.float32, 4, layer_windows=(8,)), 8,
                      device="cpu", max_tokens_per_step=n),
    lambda n: ModelConfig.from_hf(PRESETS["tiny"]).estimate_activation_bytes(
        torch.float32, max_num_batched_tokens=n, max_num_seqs=1),
], ids=["state-slots", "track-interval", "max-tokens-per-seq", "max-tokens-per-step",
        "batched-tokens"])
def test_cache_and_activation_sizes_past_int64_are_refused_by_name(make):
    with pytest.raises(ValueError, match=f"must be in \\[1, {2**63 - 1}\\], got {2**63}"):
        make(2**63)


def test_a_state_spec_needs_a_mamba_layout():
    with pytest.raises(TypeError, match="layout must be a MambaLayout, got str"):
        StateSpec("x", 4)
