"""A hybrid model's config (Bamba): its Mamba layers and mixer geometry, the KV layout of its
attention layers only, the state-slot layout, and memory planning split between the two."""

import pytest
import torch

from kvpool.engine.config import EngineConfig
from kvpool.errors import ConfigError
from kvpool.memory.state_pool import MambaLayout
from kvpool.models.config import ModelConfig, read_hf_config
from kvpool.planning.planner import plan_memory

GiB = 2**30


def bamba(**changes):
    cfg = read_hf_config("Bamba-9B")
    cfg.update(changes)
    return cfg


def test_bamba_attention_layers_are_the_kv_pools_layers():
    config = ModelConfig.from_hf("Bamba-9B")
    assert config.attention_layers == (9, 18, 27)
    assert config.mamba.layers == tuple(i for i in range(32) if i not in (9, 18, 27))
    assert config.kv_layout().num_layers == 3
    assert config.kv_layout().bytes_per_token == 2 * 3 * 8 * 128 * 2


def test_bamba_state_slot_layout():
    layout = ModelConfig.from_hf("Bamba-9B").mamba_layout()
    assert layout == MambaLayout(29, 8192 + 2 * 128, 4, 128, 64, 128, torch.bfloat16)
    assert layout.bytes_per_slot == 29 * (8448 * 3 + 128 * 64 * 128) * 2


def test_bamba_rotates_half_of_each_head():
    assert ModelConfig.from_hf("Bamba-9B").rotary_dim == 64


def test_bamba_9b_parameter_count_is_exact():
    # BambaForCausalLM built by transformers 5.23 on the meta device counts the same
    assert ModelConfig.from_hf("Bamba-9B").count_parameters() == 9_780_235_392


def test_attention_only_models_have_no_state_layout():
    assert ModelConfig.from_hf("Llama-3-8B").mamba_layout() is None


def test_bamba_without_attention_layers_is_refused():
    with pytest.raises(ConfigError, match="no attention layer"):
        ModelConfig.from_hf(bamba(attn_layer_indices=[]))


def test_attention_layer_index_out_of_range_is_named():
    with pytest.raises(ConfigError, match=r"in \[0, 32\), got \[9, 32\]"):
        ModelConfig.from_hf(bamba(attn_layer_indices=[9, 32]))


def test_mamba_heads_that_do_not_divide_the_channels_are_named():
    with pytest.raises(ConfigError, match="mamba_n_heads=100 does not divide"):
        ModelConfig.from_hf(bamba(mamba_n_heads=100, mamba_d_head="auto"))


def test_mamba_groups_that_do_not_divide_the_heads_are_named():
    with pytest.raises(ConfigError, match="mamba_n_groups=3 does not divide mamba_n_heads=128"):
        ModelConfig.from_hf(bamba(mamba_n_groups=3))


def test_a_time_step_limit_may_clamp_dt_to_one_value():
    config = ModelConfig.from_hf(bamba(time_step_limit=[0.5, 0.5]))
    assert config.mamba.time_step_limit == (0.5, 0.5)


def test_time_step_limit_as_transformers_writes_infinity():
    config = ModelConfig.from_hf(bamba(time_step_limit=[0.0, {"__float__": "Infinity"}]))
    assert config.mamba.time_step_limit == (0.0, float("inf"))


def test_plan_gives_the_state_share_to_whole_slots_and_the_rest_to_pages():
    plan = plan_memory(ModelConfig.from_hf("Bamba-9B"), 40 * GiB, mamba_memory_ratio=0.25)
    slot = plan.mamba_layout.bytes_per_slot
    # each pool sets one aside: the padding slot, the padding page
    assert plan.num_state_slots == int(plan.budget_bytes * 0.25) // slot - 1
    assert plan.num_pages == (plan.budget_bytes - (plan.num_state_slots + 1) * slot) // (
        plan.layout.bytes_per_page) - 1
    assert plan.state_bytes + plan.kv_bytes <= plan.budget_bytes


def test_hybrid_sequences_need_a_page_run_and_a_state_slot_each():
    plan = plan_memory(ModelConfig.from_hf("Bamba-9B"), 40 * GiB, mamba_memory_ratio=0.1)
    by_pages = plan.num_pages // plan.layout.num_pages_for(8192)
    assert plan.max_sequences(8192) == min(by_pages, plan.num_state_slots)
    assert plan.max_checkpoints(8192) == plan.num_state_slots - plan.max_sequences(8192)


def test_state_budget_below_one_slot_is_a_reason():
    plan = plan_memory(ModelConfig.from_hf("Bamba-9B"), 21 * GiB, mamba_memory_ratio=0.01)
    assert plan.num_state_slots == 0
    assert "less than one state slot" in plan.reason


@pytest.mark.parametrize("ratio", [0, 1, 1.5])
def test_mamba_memory_ratio_outside_zero_one_is_refused(ratio):
    with pytest.raises(ValueError, match=f"mamba_memory_ratio must be in \\(0, 1\\), got {ratio}"):
        plan_memory(ModelConfig.from_hf("Bamba-9B"), 40 * GiB, mamba_memory_ratio=ratio)


def test_attention_only_plan_has_no_state_slots():
    plan = plan_memory(ModelConfig.from_hf("Llama-3-8B"), 24 * GiB)
    assert (plan.num_state_slots, plan.state_bytes, plan.max_checkpoints(8192)) == (0, 0, 0)


def test_kvpool_plan_reports_state_slots_and_checkpoints(capsys):
    from kvpool.cli.main import main
    assert main(["plan", "Bamba-9B", "--device-memory", "40GiB", "--context-len", "8192",
                 "--mamba-memory-ratio", "0.5"]) == 0
    out = capsys.readouterr().out
    plan = EngineConfig(max_model_len=8192).memory_plan(
        ModelConfig.from_hf("Bamba-9B"), None, 8192, device_memory=40 * GiB)
    assert f"state slots           {plan.num_state_slots:,} (" in out
    assert f"checkpoints           {plan.max_checkpoints(8192):,} state slots left" in out


def test_bamba_whose_every_layer_attends_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="attn_layer_indices leaves no state layer of its 4"):
        ModelConfig.from_hf(bamba(num_hidden_layers=4, attn_layer_indices=[0, 1, 2, 3]))
