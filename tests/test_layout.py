"""KVLayout geometry, parameter counts of published models, and memory planning."""

import dataclasses
import json

import pytest
import torch

from kvpool import layout as layout_module
from kvpool.config import PRESETS, ModelConfig
from kvpool.errors import ConfigError
from kvpool.layout import (
    KVLayout,
    count_parameters,
    estimate_activation_bytes,
    format_bytes,
    parse_bytes,
    plan_memory,
)

GiB = 2**30
SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
PUBLISHED_PARAMETERS = {
    "Llama-3-8B": 8_030_261_248,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen3-8B": 8_190_735_360,
    "Mistral-7B": 7_241_732_096,
}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def hf_parameter_count(config) -> int:
    """Parameters of the transformers model built from `config`, on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def transformers_style_before_v5(config: dict) -> dict:
    """`config` as transformers 4 wrote it: `torch_dtype` and a top-level `rope_theta`."""
    old = {k: v for k, v in config.items() if k not in ("dtype", "rope_parameters")}
    old["torch_dtype"] = config["dtype"]
    old["rope_theta"] = config["rope_parameters"]["rope_theta"]
    old["rope_scaling"] = None
    return old


# KVLayout


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    assert KVLayout(32, 8, 128, torch.bfloat16).bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_bytes_per_page_is_page_size_tokens():
    assert KVLayout(32, 8, 128, torch.bfloat16, page_size=32).bytes_per_page == 32 * 131_072


def test_layout_defaults_to_float16_and_16_token_pages():
    layout = KVLayout(2, 2, 64)
    assert (layout.dtype, layout.page_size) == (torch.float16, 16)


def test_layout_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KVLayout(2, 2, 64).page_size = 32


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize("value", [0, -1])
def test_layout_rejects_sizes_below_one(field, value):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16) | {field: value}
    with pytest.raises(ValueError, match=f"{field} must be a positive int, got {value}"):
        KVLayout(**args)


@pytest.mark.parametrize("value", [True, 16.0, "16"])
def test_layout_rejects_sizes_that_are_not_ints(value):
    with pytest.raises(TypeError, match="page_size must be a positive int"):
        KVLayout(2, 2, 64, page_size=value)


@pytest.mark.parametrize("dtype", ["float16", torch.int32])
def test_layout_rejects_a_dtype_that_is_not_a_floating_torch_dtype(dtype):
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        KVLayout(2, 2, 64, dtype)


@pytest.mark.parametrize(("num_tokens", "num_pages"), [(0, 0), (1, 1), (16, 1), (17, 2)])
def test_num_pages_for_rounds_up_to_whole_pages(num_tokens, num_pages):
    assert KVLayout(2, 2, 64).num_pages_for(num_tokens) == num_pages


# KVLayout.from_hf_config


def test_from_hf_config_of_a_preset_takes_geometry_and_dtype_from_the_config():
    assert KVLayout.from_hf_config("Llama-3-8B") == KVLayout(32, 8, 128, torch.bfloat16, 16)


def test_from_hf_config_dtype_and_page_size_arguments_override_the_config():
    layout = KVLayout.from_hf_config("Llama-3-8B", dtype=torch.float32, page_size=32)
    assert (layout.dtype, layout.page_size) == (torch.float32, 32)


def test_from_hf_config_defaults_to_float32_when_the_config_states_no_dtype():
    config = {k: v for k, v in PRESETS["Llama-3-8B"].items() if k != "torch_dtype"}
    assert KVLayout.from_hf_config(config).dtype == torch.float32


def test_from_hf_config_accepts_a_model_config():
    model = ModelConfig.from_hf("Qwen3-8B")
    assert KVLayout.from_hf_config(model) == KVLayout.from_hf_config("Qwen3-8B")


@pytest.mark.parametrize(("name", "bytes_per_token"), [
    ("Llama-3-8B", 131_072), ("Qwen2.5-7B", 57_344), ("Qwen3-8B", 147_456),
    ("Mistral-7B", 131_072),
])
def test_kv_bytes_per_token_of_published_models_in_bf16(name, bytes_per_token):
    assert KVLayout.from_hf_config(name).bytes_per_token == bytes_per_token


@pytest.mark.parametrize(("config_class", "head_dim"), [
    ("LlamaConfig", 16), ("Qwen2Config", 16), ("Qwen3Config", 128), ("MistralConfig", 16),
])  # hidden_size 64 / 4 heads, except Qwen3, whose config always states head_dim (default 128)
def test_from_hf_config_reads_a_checkpoint_folder_written_by_transformers(
    transformers, tmp_path, config_class, head_dim
):
    getattr(transformers, config_class)(**SMALL, dtype="bfloat16").save_pretrained(tmp_path)
    assert KVLayout.from_hf_config(tmp_path) == KVLayout(2, 2, head_dim, torch.bfloat16)


def test_transformers_5_dtype_and_rope_parameters_are_read(transformers, tmp_path):
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    transformers.LlamaConfig(**SMALL, dtype="bfloat16", rope_parameters=rope).save_pretrained(
        tmp_path
    )
    model = ModelConfig.from_hf(tmp_path / "config.json")
    assert (model.dtype, model.rope_theta) == (torch.bfloat16, 500000.0)


def test_transformers_4_torch_dtype_and_rope_theta_are_read(transformers, tmp_path):
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    config = transformers.Qwen2Config(**SMALL, dtype="bfloat16", rope_parameters=rope).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(transformers_style_before_v5(config)))
    model = ModelConfig.from_hf(tmp_path)
    assert (model.dtype, model.rope_theta) == (torch.bfloat16, 1000000.0)
    assert KVLayout.from_hf_config(tmp_path).dtype == torch.bfloat16


def test_an_explicit_head_dim_wins_over_hidden_size_by_heads(transformers):
    config = transformers.Qwen3Config(**SMALL, head_dim=32).to_dict()
    assert KVLayout.from_hf_config(config).head_dim == 32


def test_num_key_value_heads_defaults_to_num_attention_heads(transformers):
    config = transformers.LlamaConfig(**SMALL).to_dict()
    del config["num_key_value_heads"]
    assert KVLayout.from_hf_config(config).num_kv_heads == 4


def test_from_hf_config_names_the_presets_when_no_config_is_found(tmp_path):
    with pytest.raises(ConfigError, match="no config at .*Llama-3-8B"):
        KVLayout.from_hf_config(tmp_path / "missing")


def test_from_hf_config_rejects_an_unsupported_architecture():
    with pytest.raises(ConfigError, match="unsupported architecture GPT2LMHeadModel"):
        KVLayout.from_hf_config({"architectures": ["GPT2LMHeadModel"]})


def test_from_hf_config_rejects_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KVLayout.from_hf_config(tmp_path)


# Parameter counts


@pytest.mark.parametrize(("name", "num_parameters"), PUBLISHED_PARAMETERS.items())
def test_parameter_count_of_published_models(name, num_parameters):
    assert count_parameters(ModelConfig.from_hf(name)) == num_parameters


@pytest.mark.parametrize("name", ["Llama-3-8B", "Qwen3-8B"])
def test_parameter_count_of_published_models_matches_transformers(transformers, name):
    config = dict(PRESETS[name])
    config.pop("architectures")
    hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    assert hf_parameter_count(hf_config) == PUBLISHED_PARAMETERS[name]


@pytest.mark.parametrize(("config_class", "options"), [
    ("LlamaConfig", {}),
    ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    ("LlamaConfig", {"tie_word_embeddings": True}),
    ("Qwen2Config", {}),
    ("Qwen2Config", {"tie_word_embeddings": True}),
    ("Qwen3Config", {"head_dim": 32, "attention_bias": True}),
    ("MistralConfig", {}),
])
def test_parameter_count_matches_transformers(transformers, config_class, options):
    hf_config = getattr(transformers, config_class)(**SMALL, **options)
    model = ModelConfig.from_hf(hf_config.to_dict())
    assert count_parameters(model) == hf_parameter_count(hf_config)


def test_weight_bytes_are_parameters_times_dtype_size_not_twice_that():
    assert plan_memory("Llama-3-8B", 80 * GiB).weight_bytes == 8_030_261_248 * 2
    assert plan_memory("Llama-3-8B", 80 * GiB, dtype=torch.float32).weight_bytes == (
        8_030_261_248 * 4
    )


# Activations


def test_activation_estimate_is_one_layer_of_a_batched_forward_plus_float32_logits():
    # tiny: hidden 256, q 8 x 32, kv 2 x 32, intermediate 704 (the MLP is the larger phase)
    per_token = (2 * 256 + 3 * 704) * 4
    logits = 256 * 258 * 4
    model = ModelConfig.from_hf("tiny")
    assert estimate_activation_bytes(model, torch.float32) == 2048 * per_token + logits


def test_activation_estimate_counts_logits_of_at_most_one_per_batched_token():
    model = ModelConfig.from_hf("tiny")
    estimate = estimate_activation_bytes(model, torch.float32, max_num_batched_tokens=8,
                                         max_num_seqs=256)
    assert estimate == 8 * (2 * 256 + 3 * 704) * 4 + 8 * 258 * 4


def test_plan_subtracts_the_activation_estimate_by_default():
    model = ModelConfig.from_hf("Llama-3-8B")
    plan = plan_memory(model, 24 * GiB)
    assert plan.activation_bytes == estimate_activation_bytes(model, torch.bfloat16)


# Budget arithmetic


def test_plan_for_given_device_memory():
    plan = plan_memory("Llama-3-8B", 24 * GiB, activation_bytes=0)
    assert plan.budget_bytes == int(24 * GiB * 0.9) - 16_060_522_496 == 7_132_300_902
    assert (plan.bytes_per_token, plan.bytes_per_page, plan.page_size) == (131_072, 2 * 2**20, 16)
    assert plan.num_pages == 3400  # 7,132,300,902 // 2,097,152
    assert plan.kv_bytes == 3400 * 2 * 2**20
    assert plan.max_tokens == 3400 * 16
    assert (plan.device, plan.device_memory, plan.in_use_bytes) == (None, 24 * GiB, 0)
    assert plan.reason is None


def test_max_sequences_gives_each_sequence_whole_pages():
    plan = plan_memory("Llama-3-8B", 24 * GiB, activation_bytes=0)
    assert plan.max_sequences(8192) == 3400 // 512
    assert plan.max_sequences(17) == 3400 // 2


def test_a_larger_page_size_gives_fewer_pages_of_the_same_bytes():
    plan = plan_memory("Llama-3-8B", 24 * GiB, activation_bytes=0, page_size=64)
    assert (plan.num_pages, plan.bytes_per_page) == (850, 8 * 2**20)


def test_memory_fraction_is_of_the_given_memory():
    plan = plan_memory("tiny", 2**30, memory_fraction=0.5, activation_bytes=0)
    assert plan.budget_bytes == 2**29 - 2_952_448 * 4


def test_plan_reads_cuda_total_and_excludes_memory_others_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * GiB, 80 * GiB))
    plan = plan_memory("Llama-3-8B", activation_bytes=0)
    assert (plan.device, plan.device_memory, plan.in_use_bytes) == ("cuda", 80 * GiB, 10 * GiB)
    assert plan.budget_bytes == int(80 * GiB * 0.9) - 10 * GiB - 16_060_522_496


def test_plan_on_cpu_uses_available_ram(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemAvailable:   16777216 kB\n")
    monkeypatch.setattr(layout_module, "_MEMINFO", meminfo)
    plan = plan_memory("tiny", device="cpu", activation_bytes=0)
    assert (plan.device, plan.device_memory, plan.in_use_bytes) == ("cpu", 16 * GiB, 0)
    assert plan.budget_bytes == int(16 * GiB * 0.9) - 2_952_448 * 4


def test_available_ram_falls_back_to_free_pages_without_meminfo(monkeypatch, tmp_path):
    monkeypatch.setattr(layout_module, "_MEMINFO", tmp_path / "missing")
    sizes = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(layout_module.os, "sysconf", sizes.__getitem__)
    assert plan_memory("tiny", device="cpu").device_memory == 4_096_000


def test_plan_reads_this_machine_memory_by_default():
    plan = plan_memory("tiny")
    assert plan.device in ("cpu", "cuda") and plan.device_memory > 0


def test_a_model_larger_than_the_memory_gets_no_pages_and_a_reason():
    plan = plan_memory("Llama-3-8B", 8 * GiB, activation_bytes=GiB // 2)
    assert (plan.num_pages, plan.max_tokens, plan.kv_bytes, plan.max_sequences(8192)) == (
        0, 0, 0, 0)
    assert plan.budget_bytes < 0
    assert plan.reason == ("weights 14.96 GiB + activations 512.00 MiB exceed 90% of "
                           "8.00 GiB (7.20 GiB)")


def test_the_reason_names_memory_other_processes_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * GiB, 24 * GiB))
    plan = plan_memory("Llama-3-8B", activation_bytes=0)
    assert plan.reason == ("weights 14.96 GiB + activations 0 B + 20.00 GiB in use by other "
                           "processes exceed 90% of 24.00 GiB (21.60 GiB)")


def test_a_budget_below_one_page_gets_no_pages_and_a_reason():
    weights = 2_952_448 * 4
    plan = plan_memory("tiny", weights + 1000, memory_fraction=1.0, activation_bytes=0)
    assert (plan.num_pages, plan.budget_bytes) == (0, 1000)
    assert plan.reason == "the 1000 B left for the KV cache is less than one page (32.00 KiB)"


# Argument validation


@pytest.mark.parametrize("fraction", [0, -0.1, 1.01])
def test_plan_rejects_a_memory_fraction_outside_zero_to_one(fraction):
    with pytest.raises(ValueError, match=rf"memory_fraction must be in \(0, 1\], got {fraction}"):
        plan_memory("tiny", GiB, memory_fraction=fraction)


@pytest.mark.parametrize(("device_memory", "error"), [
    (0, ValueError), (-1, ValueError), (2.5e9, TypeError), ("24GiB", TypeError), (True, TypeError),
])
def test_plan_rejects_device_memory_that_is_not_a_positive_int(device_memory, error):
    with pytest.raises(error, match="device_memory must be a positive int"):
        plan_memory("tiny", device_memory)


def test_plan_rejects_negative_activation_bytes():
    with pytest.raises(ValueError, match="activation_bytes must be an int >= 0, got -1"):
        plan_memory("tiny", GiB, activation_bytes=-1)


def test_plan_rejects_a_page_size_below_one():
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        plan_memory("tiny", GiB, page_size=0)


def test_max_sequences_rejects_a_context_len_below_one():
    with pytest.raises(ValueError, match="context_len must be a positive int, got 0"):
        plan_memory("tiny", GiB).max_sequences(0)


def test_plan_cannot_read_cuda_memory_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        plan_memory("tiny", device="cuda")


@pytest.mark.parametrize(("device", "message"), [
    ("meta", "cannot read the memory of device 'meta'; pass device_memory"),
    ("gpu0", "bad device 'gpu0'"),
])
def test_plan_rejects_devices_it_cannot_read(device, message):
    with pytest.raises(ValueError, match=message):
        plan_memory("tiny", device=device)


# Byte sizes


@pytest.mark.parametrize(("text", "num_bytes"), [
    ("24GiB", 24 * GiB), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
    ("1048576", 1_048_576), ("24 gib", 24 * GiB), ("2KB", 2000), ("0.5KiB", 512),
    ("1TiB", 2**40), ("100B", 100),
])
def test_parse_bytes(text, num_bytes):
    assert parse_bytes(text) == num_bytes


@pytest.mark.parametrize("text", ["", "GiB", "24XB", "-1GiB", "1e9", "24 G iB"])
def test_parse_bytes_rejects_what_is_not_a_size(text):
    with pytest.raises(ValueError, match=f"bad size {text!r}: expected a number"):
        parse_bytes(text)


@pytest.mark.parametrize(("num_bytes", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (24 * GiB, "24.00 GiB"),
    (16_060_522_496, "14.96 GiB"), (-2 * GiB, "-2.00 GiB"),
])
def test_format_bytes_uses_the_largest_binary_unit(num_bytes, text):
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize(("field", "value", "message"), [
    ("architectures", 5, "unsupported architecture 5; kvpool supports LlamaForCausalLM"),
    ("architectures", {"LlamaForCausalLM": 1}, "unsupported architecture {'LlamaForCausalLM': 1}"),
    ("model_type", ["llama"], "no 'architectures' and an unsupported model_type=['llama']"),
    ("rms_norm_eps", "abc", "'rms_norm_eps' must be a positive finite number, got 'abc'"),
    ("rms_norm_eps", -1e-6, "'rms_norm_eps' must be a positive finite number, got -1e-06"),
    ("rope_theta", "abc", "'rope_theta' must be a positive finite number, got 'abc'"),
    ("rope_scaling", "abc", "'rope_scaling' must be an object, got 'abc'"),
    ("rope_parameters", [1], "'rope_parameters' must be an object, got [1]"),
    ("eos_token_id", "x", "'eos_token_id' must be a token id or a list of them"),
    ("eos_token_id", [2, -1], "'eos_token_id' must be a token id or a list of them"),
    ("bos_token_id", 1.5, "'bos_token_id' must be an integer >= 0 or null, got 1.5"),
    ("tie_word_embeddings", "no", "'tie_word_embeddings' must be true or false, got 'no'"),
    ("attention_bias", 1, "'attention_bias' must be true or false, got 1"),
    ("dtype", ["bfloat16"], "unsupported dtype ['bfloat16']"),
])
def test_config_fields_of_the_wrong_type_are_config_errors_naming_the_field(field, value,
                                                                              message):
    config = dict(PRESETS["tiny"], **{field: value})
    if field == "model_type":
        del config["architectures"]
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_hf(config)
    assert message in str(error.value)


def test_a_null_rms_norm_eps_takes_the_default():
    assert ModelConfig.from_hf(dict(PRESETS["tiny"], rms_norm_eps=None)).rms_norm_eps == 1e-6


def test_mistral_sliding_window_must_be_a_positive_int_or_null():
    mistral = PRESETS["Mistral-7B"]
    assert ModelConfig.from_hf(dict(mistral, sliding_window=None)).sliding_window is None
    with pytest.raises(ConfigError, match="'sliding_window' must be an integer >= 1 or null"):
        ModelConfig.from_hf(dict(mistral, sliding_window="4096"))
