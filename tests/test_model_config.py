"""ModelConfig: Hugging Face configs of Llama, Qwen2, Qwen3 and Mistral, and the KV layout
they imply."""

import json
import re
from dataclasses import replace

import pytest
import torch

from kvpool.errors import ConfigError
from kvpool.memory.layout import KVLayout
from kvpool.models import rotary
from kvpool.models.config import NO_MULTIPLIERS, PRESETS, ModelConfig, Multipliers

SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def transformers_style_before_v5(config: dict) -> dict:
    """`config` as transformers 4 wrote it: `torch_dtype` and a top-level `rope_theta`."""
    old = {k: v for k, v in config.items() if k not in ("dtype", "rope_parameters")}
    old["torch_dtype"] = config["dtype"]
    old["rope_theta"] = config["rope_parameters"]["rope_theta"]
    old["rope_scaling"] = None
    return old


# ModelConfig.kv_layout


def test_kv_layout_of_a_preset_takes_geometry_and_dtype_from_the_config():
    assert ModelConfig.from_hf("Llama-3-8B").kv_layout() == KVLayout(32, 8, 128, torch.bfloat16, 16)


def test_kv_layout_dtype_and_page_size_arguments_override_the_config():
    layout = ModelConfig.from_hf("Llama-3-8B").kv_layout(dtype=torch.float32, page_size=32)
    assert (layout.dtype, layout.page_size) == (torch.float32, 32)


def test_kv_layout_defaults_to_float32_when_the_config_states_no_dtype():
    config = {k: v for k, v in PRESETS["Llama-3-8B"].items() if k != "torch_dtype"}
    assert ModelConfig.from_hf(config).kv_layout().dtype == torch.float32


def test_weights_dtype_is_the_given_one_else_the_config_s_else_float32():
    model = ModelConfig.from_hf("Llama-3-8B")
    assert model.weights_dtype() == torch.bfloat16
    assert model.weights_dtype(torch.float16) == torch.float16
    assert ModelConfig.from_hf(dict(PRESETS["Llama-3-8B"], torch_dtype=None)).weights_dtype() == (
        torch.float32)


@pytest.mark.parametrize(("name", "bytes_per_token"), [
    ("Llama-3-8B", 131_072), ("Qwen2.5-7B", 57_344), ("Qwen3-8B", 147_456),
    ("Mistral-7B", 131_072),
])
def test_kv_bytes_per_token_of_published_models_in_bf16(name, bytes_per_token):
    assert ModelConfig.from_hf(name).kv_layout().bytes_per_token == bytes_per_token


@pytest.mark.parametrize(("config_class", "head_dim", "windows"), [
    ("LlamaConfig", 16, ()), ("Qwen2Config", 16, ()), ("Qwen3Config", 128, ()),
    ("MistralConfig", 16, (4096, 4096)),
])  # hidden_size 64 / 4 heads, except Qwen3, whose config always states head_dim (default 128);
# Mistral windows every layer (transformers' default window: 4096)
def test_kv_layout_reads_a_checkpoint_folder_written_by_transformers(
    transformers, tmp_path, config_class, head_dim, windows
):
    getattr(transformers, config_class)(**SMALL, dtype="bfloat16").save_pretrained(tmp_path)
    assert ModelConfig.from_hf(tmp_path).kv_layout() == KVLayout(2, 2, head_dim, torch.bfloat16,
                                                                 layer_windows=windows)


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
    assert ModelConfig.from_hf(tmp_path).kv_layout().dtype == torch.bfloat16


@pytest.mark.parametrize("rope", [
    # Qwen3's published recipe for 131,072 tokens (its config says 40,960)
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
     "original_max_position_embeddings": 32768},
    # the trained context from max_position_embeddings; an attention factor given; no truncation
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "attention_factor": 0.8,
     "beta_fast": 16, "truncate": False},
    # a ramp whose upper end (the dimension turning beta_slow times) lies past the last
    # dimension, where transformers clamps it
    {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "beta_fast": 1024,
     "beta_slow": 0.5},
], ids=["qwen3-recipe", "given-factor-untruncated", "ramp-past-the-last-dimension"])
def test_yarn_on_a_qwen3_config_gives_transformers_frequencies_and_factor(transformers, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvpool.models.rotary import attention_factor, inv_frequencies

    hf_config = transformers.Qwen3Config(**SMALL, head_dim=128, max_position_embeddings=40960,
                                         rope_parameters=rope)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    ours = ModelConfig.from_hf(hf_config.to_dict())
    assert torch.equal(inv_frequencies(ours, device="cpu"), hf_inv_freq)
    assert attention_factor(ours) == hf_factor != 1.0


def test_a_trained_context_at_the_configs_top_level_wins_for_yarn_as_in_transformers(
        transformers):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = {"architectures": ["Qwen3ForCausalLM"], **SMALL, "head_dim": 128,
              "max_position_embeddings": 40960, "original_max_position_embeddings": 8192,
              "rope_scaling": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                               "original_max_position_embeddings": 32768}}
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](transformers.Qwen3Config.from_dict(config))
    ours = ModelConfig.from_hf(config)
    assert ours.rope_scaling["original_max_position_embeddings"] == 8192
    assert torch.equal(rotary.inv_frequencies(ours, device="cpu"), hf_inv_freq)


@pytest.mark.parametrize(("name", "model_class", "expected"), [
    ("Mixtral-8x7B", "MixtralForCausalLM", 46_702_792_704),  # "46.7B"
    ("Phi-4", "Phi3ForCausalLM", 14_659_507_200),  # "14.7B"
])
def test_presets_count_their_parameters_as_transformers_builds_them(transformers, name,
                                                                    model_class, expected):
    model_type = getattr(transformers, model_class).config_class
    with torch.device("meta"):
        hf = getattr(transformers, model_class)(model_type.from_dict(PRESETS[name]))
    assert ModelConfig.from_hf(name).count_parameters() == expected
    assert expected == sum(p.numel() for p in hf.parameters())


def test_smollm3_leaves_every_fourth_layer_unrotated_unless_its_config_lists_them():
    config = {"architectures": ["SmolLM3ForCausalLM"], **SMALL, "num_hidden_layers": 8}
    assert ModelConfig.from_hf(config).no_rope_layers == (3, 7)
    flags = [1, 0, 1, 1, 1, 1, 1, 0]
    assert ModelConfig.from_hf({**config, "no_rope_layers": flags}).no_rope_layers == (1, 7)


@pytest.mark.parametrize(("change", "message"), [
    ({"no_rope_layers": [1, 0]}, r"'no_rope_layers' must be 0 or 1 for each of the 3 layers, "
                                 r"got \[1, 0\]"),
    ({"no_rope_layers": [1, 2, 1]}, "must be 0 or 1"),
    ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true is not"),
], ids=["too-few", "not-a-flag", "sliding-window"])
def test_unsupported_smollm3_configs_name_the_field(change, message):
    config = {"architectures": ["SmolLM3ForCausalLM"], **SMALL, "num_hidden_layers": 3, **change}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(config)


def test_frequency_factors_without_a_list_of_factors_is_a_config_error():
    config = {"architectures": ["LlamaForCausalLM"], **SMALL,
              "rope_scaling": {"rope_type": "frequency_factors", "factors": 2.0}}
    with pytest.raises(ConfigError, match="rope_type 'frequency_factors' needs a list "
                                          "'factors', got 2.0"):
        ModelConfig.from_hf(config)


def test_an_unsupported_rope_type_names_the_supported_ones():
    config = {"architectures": ["Qwen3ForCausalLM"], **SMALL,
              "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}
    with pytest.raises(ConfigError, match="unsupported rope_type 'longrope'; kvpool supports "
                                          "default, linear, llama3, yarn, frequency_factors here"):
        ModelConfig.from_hf(config)


def test_an_explicit_head_dim_wins_over_hidden_size_by_heads(transformers):
    config = transformers.Qwen3Config(**SMALL, head_dim=32).to_dict()
    assert ModelConfig.from_hf(config).kv_layout().head_dim == 32


def test_num_key_value_heads_defaults_to_num_attention_heads(transformers):
    config = transformers.LlamaConfig(**SMALL).to_dict()
    del config["num_key_value_heads"]
    assert ModelConfig.from_hf(config).kv_layout().num_kv_heads == 4


@pytest.mark.parametrize(("model_type", "architecture"), [
    ("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
    ("qwen2_moe", "Qwen2MoeForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"),
    ("qwen3_next", "Qwen3NextForCausalLM"), ("mistral", "MistralForCausalLM"),
    ("mixtral", "MixtralForCausalLM")])
def test_kv_heads_and_mlp_width_left_out_are_each_architectures_as_transformers_reads_them(
        transformers, tmp_path, model_type, architecture):
    config = {"model_type": model_type, "architectures": [architecture], "vocab_size": 1000,
              "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 32, "head_dim": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf, ours = transformers.AutoConfig.from_pretrained(tmp_path), ModelConfig.from_hf(tmp_path)
    assert (ours.num_kv_heads, ours.intermediate_size) == (hf.num_key_value_heads,
                                                           hf.intermediate_size)


# Every model_type kvpool reads, with the keys its config cannot leave out besides the sizes
# (transformers' DeepSeek-V2 has no top-k of its own; a hybrid needs its state layers)
MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16}
MODEL_TYPES = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "qwen3_moe": {}, "qwen2_moe": {}, "mistral": {},
    "phi3": {}, "smollm3": {}, "granite": {}, "granitemoe": {}, "granitemoeshared": {},
    "olmo2": {}, "olmo3": {}, "seed_oss": {}, "arcee": {}, "ernie4_5": {}, "ernie4_5_moe": {},
    "apertus": {}, "glm": {}, "glm4": {}, "glm4_moe": {}, "exaone4": {}, "mixtral": {},
    "gemma2": {}, "gemma3_text": {}, "gpt_oss": {}, "deepseek_v2": {"num_experts_per_tok": 2},
    "deepseek_v3": {}, "bamba": {**MAMBA, "attn_layer_indices": [1]},
    "granitemoehybrid": {**MAMBA, "layer_types": ["mamba", "attention"] * 2},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"] * 2},
}


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_keys_left_out_read_as_transformers_defaults_them(transformers, tmp_path, model_type):
    """head_dim, the tie, rope_theta, rms_norm_eps, the experts and top-k, ...: kvpool reads a
    config of sizes alone as it reads transformers' whole config of it (token ids aside)."""
    config = {"model_type": model_type, "vocab_size": 160, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 4, **MODEL_TYPES[model_type]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    written = transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
    written.pop("architectures", None)  # both name the architecture by the model_type
    ours, theirs = ModelConfig.from_hf(tmp_path), ModelConfig.from_hf(written)
    assert replace(ours, eos_token_ids=(), bos_token_id=None) == \
        replace(theirs, eos_token_ids=(), bos_token_id=None)


def test_kv_layout_names_the_presets_when_no_config_is_found(tmp_path):
    with pytest.raises(ConfigError, match="no config at .*Llama-3-8B"):
        ModelConfig.from_hf(tmp_path / "missing").kv_layout()


def test_kv_layout_rejects_an_unsupported_architecture():
    with pytest.raises(ConfigError, match="unsupported architecture GPT2LMHeadModel"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]}).kv_layout()


def test_kv_layout_rejects_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path).kv_layout()


# Config validation



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


def test_attention_heads_that_the_kv_heads_do_not_divide_are_a_config_error():
    with pytest.raises(ConfigError, match="num_attention_heads=8 is not a multiple of "
                                          "num_key_value_heads=3"):
        ModelConfig.from_hf(dict(PRESETS["tiny"], num_attention_heads=8, num_key_value_heads=3))


def test_token_id_zero_is_a_valid_bos_and_end_id():
    config = ModelConfig.from_hf(dict(PRESETS["tiny"], bos_token_id=0, eos_token_id=[0, 2]))
    assert (config.bos_token_id, config.eos_token_ids) == (0, (0, 2))


def test_a_null_rms_norm_eps_takes_the_default():
    assert ModelConfig.from_hf(dict(PRESETS["tiny"], rms_norm_eps=None)).rms_norm_eps == 1e-6


def test_mistral_sliding_window_must_be_a_positive_int_or_null():
    mistral = PRESETS["Mistral-7B"]
    assert ModelConfig.from_hf(dict(mistral, sliding_window=None)).sliding_window is None
    with pytest.raises(ConfigError, match="'sliding_window' must be an integer >= 1 or null"):
        ModelConfig.from_hf(dict(mistral, sliding_window="4096"))


GEMMA_ROPES = {"full_attention": {"rope_type": "linear", "factor": 8.0},
               "sliding_attention": {"rope_type": "default"}}


@pytest.mark.parametrize(("model_type", "architecture", "keys"), [
    # keys left out: each architecture's own defaults
    ("mixtral", "MixtralForCausalLM", {"num_local_experts": 2, "num_experts_per_tok": 1}),
    ("smollm3", "SmolLM3ForCausalLM", {}),
    ("mistral", "MistralForCausalLM", {}),
    ("phi3", "Phi3ForCausalLM", {}),
    ("llama", "LlamaForCausalLM", {}),
    ("qwen3", "Qwen3ForCausalLM", {"use_sliding_window": True}),
    # rope_scaling wins over rope_parameters
    ("qwen3", "Qwen3ForCausalLM", {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64}}),
    # Gemma 3's per-layer ropes take their thetas from the top-level keys, else 1e6 and 1e4
    ("gemma3_text", "Gemma3ForCausalLM", {"rope_parameters": GEMMA_ROPES}),
    ("gemma3_text", "Gemma3ForCausalLM", {"rope_parameters": GEMMA_ROPES,
                                          "rope_theta": 5e5, "rope_local_base_freq": 100.0}),
], ids=["mixtral", "smollm3", "mistral", "phi3", "llama", "qwen3-window", "rope-scaling-wins",
        "gemma3-default-thetas", "gemma3-top-level-thetas"])
def test_a_config_reads_as_transformers_reads_it(transformers, tmp_path, model_type,
                                                 architecture, keys):
    config = {"model_type": model_type, "architectures": [architecture], **SMALL, **keys}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf, ours = transformers.AutoConfig.from_pretrained(tmp_path), ModelConfig.from_hf(tmp_path)
    ropes = hf.rope_parameters
    full, sliding = ((ropes["full_attention"], ropes["sliding_attention"])
                     if "full_attention" in ropes else (ropes, None))
    assert ours.rope_theta == full["rope_theta"]
    assert (ours.rope_scaling or {"rope_type": "default"})["rope_type"] == full["rope_type"]
    if sliding is not None:
        assert ours.gemma.local_rope_theta == sliding["rope_theta"]
    window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) \
        else None
    assert (ours.rms_norm_eps, ours.sliding_window, ours.max_position_embeddings) == (
        hf.rms_norm_eps, window, hf.max_position_embeddings)


def test_phi3_scales_its_rope_by_longrope_only():
    phi3 = dict(PRESETS["Phi-4"], rope_scaling={"rope_type": "linear", "factor": 4.0})
    with pytest.raises(ConfigError, match="unsupported rope_type 'linear'; kvpool supports "
                                          "default, longrope here"):
        ModelConfig.from_hf(phi3)


def phi35_config(**rope) -> dict:
    """Phi-3.5-mini's config.json as published (transformers 4's format): the trained context
    at the top level, LongRoPE's 48 factors of each kind, 3/4 of each 128-channel head."""
    return dict(PRESETS["Phi-4"], max_position_embeddings=131072,
                original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                              "long_factor": [2.0] * 48, **rope})


@pytest.mark.parametrize("name", ["longrope", "su", "yarn"])  # transformers' older names
def test_a_phi3_5_config_takes_longrope_long_factors_where_sequences_pass_its_trained_context(
        name):
    config = ModelConfig.from_hf(phi35_config(type=name))
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rotary_dim == 96
    assert config.rope_scaling["original_max_position_embeddings"] == 4096
    assert config.rope_scaling["long"]  # its context, 131,072, passes 4,096
    assert not config.for_max_model_len(4096).rope_scaling["long"]
    assert config.for_max_model_len(4097).rope_scaling["long"]
    assert config.for_max_model_len(4096).rope_scaling["short_factor"] == [1.0] * 48


@pytest.mark.parametrize(("rope", "top_level", "message"), [
    ({"long_factor": None}, {}, "rope_type 'longrope' needs a list 'long_factor', got None"),
    ({"original_max_position_embeddings": None}, {"original_max_position_embeddings": None},
     "needs original_max_position_embeddings, an int of at least 2"),
    # ln(1) = 0 would divide the attention factor
    ({}, {"original_max_position_embeddings": 1},
     "needs original_max_position_embeddings, an int of at least 2 (its log divides the "
     "attention factor), got 1"),
    ({"short_factor": [1.0, "x"]}, {}, "short_factor"),
    # the top level's 0 wins over the parameters' value, as any top-level value does
    ({"original_max_position_embeddings": 32}, {"original_max_position_embeddings": 0},
     "needs original_max_position_embeddings, an int of at least 2 (its log divides the "
     "attention factor), got 0"),
])
def test_broken_longrope_parameters_are_refused_by_name(rope, top_level, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf({**phi35_config(**rope), **top_level})


def test_phi3s_trained_context_is_its_top_level_4096_unless_given_as_transformers_reads_it():
    # transformers 5's form, the trained context inside the rope parameters only: Phi3Config's
    # own default of 4,096 wins over it
    config = dict(PRESETS["Phi-4"], max_position_embeddings=131072, partial_rotary_factor=0.75,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 16,
                                   "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    assert ModelConfig.from_hf(config).rope_scaling["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize("factor", [0.01, 0.35])  # 0 and 5 channels of a head of 16
def test_a_partial_rotary_factor_of_no_channel_or_an_odd_count_is_refused_by_name(factor):
    config = {"architectures": ["Phi3ForCausalLM"], **SMALL, "partial_rotary_factor": factor}
    with pytest.raises(ConfigError, match=re.escape(
            f"partial_rotary_factor {factor} rotates int(16 * {factor}) = {int(16 * factor)} "
            f"channels of each head: kvpool rotates an even number, at least 2")):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("bad", [0, -5, True, 2.5, float("nan"), "4096"])
def test_a_max_model_len_that_is_not_a_positive_int_is_refused_by_name(bad):
    config = ModelConfig.from_hf(phi35_config())
    for call in (config.for_max_model_len, lambda n: config.kv_layout(max_model_len=n)):
        with pytest.raises((TypeError, ValueError), match="max_model_len must be"):
            call(bad)


@pytest.mark.parametrize("name", ["short_factor", "long_factor"])
def test_longrope_factors_of_another_count_than_the_frequencies_are_refused_when_read(name):
    # whichever set max_model_len picks later: Phi-3.5's context of 131,072 takes the long
    with pytest.raises(ConfigError, match=f"{name} factors: 47 given, but a rotary "
                                          f"dimension of 96 has 48 frequencies"):
        ModelConfig.from_hf(phi35_config(**{name: [1.0] * 47}))


def test_granite_reads_its_multipliers_each_1_when_left_out_as_transformers_does():
    granite = {"architectures": ["GraniteForCausalLM"], **SMALL}
    assert ModelConfig.from_hf(granite).multipliers == Multipliers(1.0, 1.0, 1.0, 1.0)
    given = {**granite, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
             "attention_multiplier": 0.0078125, "logits_scaling": 16.0}
    assert ModelConfig.from_hf(given).multipliers == Multipliers(12.0, 0.22, 0.0078125, 16.0)
    # other architectures take none of them, as transformers' do not
    llama = {**given, "architectures": ["LlamaForCausalLM"]}
    assert ModelConfig.from_hf(llama).multipliers == NO_MULTIPLIERS


@pytest.mark.parametrize("key", ["embedding_multiplier", "residual_multiplier",
                                 "attention_multiplier", "logits_scaling"])
def test_a_granite_multiplier_that_is_not_a_positive_number_is_refused_by_name(key):
    granite = {"architectures": ["GraniteForCausalLM"], **SMALL, key: 0}
    with pytest.raises(ConfigError, match=f"config '{key}' must be a positive finite number, "
                                          f"got 0"):
        ModelConfig.from_hf(granite)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "SeedOssForCausalLM",
                                          "Ernie4_5ForCausalLM"])
def test_an_odd_head_dim_that_rope_would_rotate_is_refused_by_name(architecture):
    config = {"architectures": [architecture], **SMALL, "head_dim": 15}
    with pytest.raises(ConfigError, match="head_dim 15 is odd: RoPE rotates channels in pairs"):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("architecture", ["Gemma3ForConditionalGeneration",
                                          "Mistral3ForConditionalGeneration"])
def test_a_multimodal_config_ties_the_head_as_its_top_level_says_true_when_left_out(
        architecture):
    # transformers ties by the top level's tie_word_embeddings, whose default is true
    text = {"model_type": "gemma3_text" if "Gemma" in architecture else "mistral", **SMALL,
            "tie_word_embeddings": False}
    config = {"architectures": [architecture], "text_config": text}
    assert ModelConfig.from_hf(config).tie_word_embeddings
    assert not ModelConfig.from_hf({**config, "tie_word_embeddings": False}).tie_word_embeddings


@pytest.mark.parametrize("text_config", ["Ministral3Config", "LlamaConfig"])
def test_a_mistral3_multimodal_config_whose_text_decoder_is_not_mistral_is_refused_by_name(
        transformers, text_config):
    # transformers runs the decoder its text_config's model_type names: Ministral 3's scales
    # its queries by position, which a Mistral decoder would silently leave out
    text = getattr(transformers, text_config)(**SMALL)
    config = {**transformers.Mistral3Config(text_config=text).to_dict(),
              "architectures": ["Mistral3ForConditionalGeneration"]}
    with pytest.raises(ConfigError, match=f"Mistral3ForConditionalGeneration with a text_config "
                                          f"of model_type '{text.model_type}' is not "
                                          f"supported; kvpool runs it with a 'mistral' "
                                          f"text_config only"):
        ModelConfig.from_hf(config)


def test_a_mistral3_multimodal_text_config_without_a_model_type_is_read_as_mistral():
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "text_config": SMALL}
    assert ModelConfig.from_hf(config).architecture == "MistralForCausalLM"


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_a_gemma_config_that_leaves_out_its_sizes_reads_as_transformers_defaults_them(
        transformers, tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    written = transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
    ours, theirs = ModelConfig.from_hf(tmp_path), ModelConfig.from_hf(written)
    assert replace(ours, eos_token_ids=(), bos_token_id=None) == \
        replace(theirs, eos_token_ids=(), bos_token_id=None)
    assert (ours.vocab_size, ours.num_heads, ours.num_kv_heads) == (
        written["vocab_size"], written["num_attention_heads"], written["num_key_value_heads"])


# The text_config of google/gemma-3-4b-it, -12b-it and -27b-it as published: only the keys that
# differ from transformers' defaults (no vocab_size; the 4B's no heads either)
GEMMA3_ROPE = {"factor": 8.0, "rope_type": "linear"}
GEMMA3_PUBLISHED = {
    "gemma-3-4b-it": {"hidden_size": 2560, "intermediate_size": 10240,
                      "model_type": "gemma3_text", "num_hidden_layers": 34,
                      "rope_scaling": GEMMA3_ROPE, "sliding_window": 1024},
    "gemma-3-12b-it": {"hidden_size": 3840, "intermediate_size": 15360,
                       "model_type": "gemma3_text", "num_attention_heads": 16,
                       "num_hidden_layers": 48, "num_key_value_heads": 8,
                       "rope_scaling": GEMMA3_ROPE, "sliding_window": 1024},
    "gemma-3-27b-it": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                       "model_type": "gemma3_text", "num_attention_heads": 32,
                       "num_hidden_layers": 62, "num_key_value_heads": 16,
                       "query_pre_attn_scalar": 168, "rope_scaling": GEMMA3_ROPE,
                       "sliding_window": 1024},
}


@pytest.mark.parametrize("name", list(GEMMA3_PUBLISHED))
def test_the_published_gemma3_multimodal_configs_read_as_transformers_reads_them(transformers,
                                                                                name):
    published = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
                 "text_config": GEMMA3_PUBLISHED[name]}
    hf = transformers.Gemma3Config(text_config=GEMMA3_PUBLISHED[name], dtype="bfloat16")
    written = {**hf.to_dict(), "architectures": ["Gemma3ForConditionalGeneration"]}
    del written["text_config"]["dtype"]  # null there, which save_pretrained leaves out
    ours = ModelConfig.from_hf(published)
    assert replace(ours, eos_token_ids=(), bos_token_id=None) == replace(
        ModelConfig.from_hf(written), eos_token_ids=(), bos_token_id=None)
    text, layout = hf.text_config, ours.kv_layout()
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (
        text.num_hidden_layers, text.num_key_value_heads, text.head_dim, torch.bfloat16)
    assert (ours.vocab_size, ours.num_heads) == (text.vocab_size, text.num_attention_heads)


@pytest.mark.parametrize("architecture", ["Olmo3ForCausalLM", "Gemma2ForCausalLM",
                                          "GptOssForCausalLM"])
def test_default_sliding_layers_without_a_window_are_refused_as_given_ones_are(architecture):
    config = {"architectures": [architecture], **SMALL, "num_hidden_layers": 4,
              "sliding_window": None}
    with pytest.raises(ConfigError, match="config 'layer_types' left out gives "
                                          r"\(transformers' default\) \d sliding_attention "
                                          "layer\\(s\\) but sliding_window is null"):
        ModelConfig.from_hf(config)
