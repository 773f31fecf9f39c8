"""config.json's `hidden_act` is read: the Llama family runs the activation it names, as
transformers does, and a name kvpool does not run is a ConfigError naming the field and
the value (not SiLU in disguise)."""

from __future__ import annotations

import functools

import pytest
import transformers

from kvpool.errors import ConfigError
from kvpool.models.config import PRESETS, ModelConfig
from kvpool.models.loader import load_model
from models_util import (
    SMALL,
    PagedRunner,
    assert_logits_match,
    make_hf_model,
    prompts,
    save_hf_model,
)

FAMILIES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mistral": transformers.MistralConfig,
    # every expert, and the dense MLP of the layer mlp_only_layers names, runs hidden_act
    "qwen3-moe": functools.partial(transformers.Qwen3MoeConfig, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=32,
                                   mlp_only_layers=[1]),
}


@pytest.mark.parametrize(("family", "act"), [
    ("llama", "gelu"), ("llama", "relu"), ("llama", "gelu_pytorch_tanh"), ("llama", "gelu_new"),
    ("llama", "gelu_fast"), ("qwen2", "gelu"), ("qwen3", "relu"),
    ("mistral", "gelu_pytorch_tanh"), ("qwen3-moe", "gelu"),
])
def test_the_mlp_runs_the_hidden_act_of_the_config_as_transformers_does(family, act, tmp_path):
    configs = {act: lambda: FAMILIES[family](**SMALL, hidden_act=act)}
    hf = make_hf_model(act, configs=configs)
    model = load_model(save_hf_model(hf, tmp_path), device="cpu").model
    assert model.config.hidden_act == act
    batch = prompts(model.config.vocab_size, lengths=(5, 11))
    assert_logits_match(hf, batch, PagedRunner(model).step(batch, all_logits=True))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "MistralForCausalLM"])
@pytest.mark.parametrize("act", ["bogus_act", "tanh", None, 3])
def test_an_unsupported_hidden_act_is_a_config_error_naming_it(arch, act):
    config = {**PRESETS["tiny"], "architectures": [arch], "hidden_act": act}
    with pytest.raises(ConfigError, match=f"unsupported hidden_act {act!r} for {arch}"):
        ModelConfig.from_hf(config)


def test_bamba_runs_silu_only():
    config = {**PRESETS["Bamba-9B"], "hidden_act": "gelu"}
    with pytest.raises(ConfigError, match="unsupported hidden_act 'gelu' for BambaForCausalLM"):
        ModelConfig.from_hf(config)
    assert ModelConfig.from_hf({**config, "hidden_act": "silu"}).hidden_act == "silu"


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_a_partial_rotary_factor_is_refused_for_the_llama_family(where):
    config = dict(PRESETS["Llama-3-8B"])
    if where == "top":
        config["partial_rotary_factor"] = 0.5
    else:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5,
                                     "partial_rotary_factor": 0.5}
    with pytest.raises(ConfigError, match="unsupported partial_rotary_factor 0.5"):
        ModelConfig.from_hf(config)
    config.pop("partial_rotary_factor", None)
    config.pop("rope_parameters", None)
    assert ModelConfig.from_hf({**config, "partial_rotary_factor": 1.0}).rotary_dim == 128
