"""Memory planning: parameter counts of published models, activation estimates, and the
pages that fit in a share of a device's memory."""

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from kvpool.engine.config import EngineConfig
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import MOST_PAGES, pages_within
from kvpool.models.config import PRESETS, ModelConfig
from kvpool.planning import planner
from kvpool.planning.geometry import ModelGeometry
from kvpool.planning.group_plan import split_budget
from kvpool.planning.planner import plan_memory

GiB = 2**30
TINY, LLAMA = ModelConfig.from_hf("tiny"), ModelConfig.from_hf("Llama-3-8B")
GEMMA, MISTRAL = ModelConfig.from_hf("Gemma-3-4B"), ModelConfig.from_hf("Mistral-7B")
SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")
PUBLISHED_PARAMETERS = {
    "Llama-3-8B": 8_030_261_248,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen3-8B": 8_190_735_360,
    "Mistral-7B": 7_241_732_096,
    "Gemma-3-4B": 3_880_263_168,  # the text decoder
}


def hf_parameter_count(config) -> int:
    """Parameters of the transformers model built from `config`, on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def fake_cuda(monkeypatch, *, free: int, total: int, share: float = 1.0, reserved: int = 0,
              allocated: int | None = None):
    """A CUDA device of `total` bytes, `free` of them free, of which torch lets this process
    take `share` (torch.cuda.set_per_process_memory_fraction); torch's allocator holds
    `reserved` for this process, `allocated` of it (all by default) in tensors."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: share,
                        raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated",
                        lambda device: reserved if allocated is None else allocated)


# Parameter counts


@pytest.mark.parametrize(("name", "num_parameters"), PUBLISHED_PARAMETERS.items())
def test_parameter_count_of_published_models(name, num_parameters):
    assert ModelConfig.from_hf(name).count_parameters() == num_parameters


@pytest.mark.parametrize("name", ["Llama-3-8B", "Qwen3-8B", "Gemma-3-4B"])
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
    ("Gemma3TextConfig", {"head_dim": 16}),
    ("Gemma3TextConfig", {"head_dim": 16, "tie_word_embeddings": False}),
    ("Gemma2Config", {"head_dim": 16, "attention_bias": True}),  # no q/k norms
    ("GraniteConfig", {"attention_bias": True, "mlp_bias": True}),
    ("Olmo2Config", {"attention_bias": True}),  # q/k norms across all heads
    ("Olmo3Config", {"attention_bias": True}),
    ("SeedOssConfig", {"head_dim": 32, "attention_out_bias": True, "mlp_bias": True}),
    ("ArceeConfig", {"attention_bias": True, "mlp_bias": True}),  # an ungated MLP
    ("ArceeConfig", {}),
    ("Ernie4_5Config", {"head_dim": 16, "use_bias": True}),
    ("Ernie4_5Config", {"tie_word_embeddings": False}),
    ("ApertusConfig", {"attention_bias": True}),  # xIELU's two weights per layer
    ("Glm4Config", {"head_dim": 16, "pad_token_id": None}),  # four norms a layer
    ("Exaone4Config", {}),  # q/k norms per head
    ("GlmConfig", {"head_dim": 16, "pad_token_id": None}),
    ("Qwen2MoeConfig", {"num_experts": 4, "moe_intermediate_size": 32,
                        "shared_expert_intermediate_size": 48}),  # a gated shared expert
    ("GraniteMoeConfig", {"num_local_experts": 4, "attention_bias": True}),
    # sinks per head, biases on q/k/v/o, the router and every expert
    ("GptOssConfig", {"num_local_experts": 4, "head_dim": 16}),
    ("GraniteMoeSharedConfig", {"num_local_experts": 4,
                                "shared_intermediate_size": 48}),  # an ungated shared MLP
    ("GraniteMoeHybridConfig", {"num_local_experts": 4, "shared_intermediate_size": 48,
                                "layer_types": ["mamba", "attention"], "mamba_n_heads": 8,
                                "mamba_d_state": 16, "mamba_n_groups": 2}),  # Mamba and MoE
    ("GraniteMoeHybridConfig", {"num_local_experts": 0, "shared_intermediate_size": 48,
                                "layer_types": ["mamba", "attention"], "mamba_n_heads": 8,
                                "mamba_d_state": 16}),  # the shared MLP alone, dense
])
def test_parameter_count_matches_transformers(transformers, config_class, options):
    hf_config = getattr(transformers, config_class)(**SMALL, **options)
    model = ModelConfig.from_hf(hf_config.to_dict())
    assert model.count_parameters() == hf_parameter_count(hf_config)


def test_weight_bytes_are_parameters_times_dtype_size_not_twice_that():
    assert plan_memory(LLAMA, 80 * GiB).weight_bytes == 8_030_261_248 * 2
    assert plan_memory(LLAMA, 80 * GiB, dtype=torch.float32).weight_bytes == (
        8_030_261_248 * 4
    )


# Activations


def test_activation_estimate_is_one_layer_of_a_batched_forward_plus_float32_logits():
    # tiny: hidden 256, q 8 x 32, kv 2 x 32, intermediate 704 (the MLP is the larger phase)
    per_token = (2 * 256 + 3 * 704) * 4
    logits = 256 * 258 * 4
    assert TINY.estimate_activation_bytes(torch.float32, max_num_batched_tokens=2048,
                                          max_num_seqs=256) == 2048 * per_token + logits


def test_activation_estimate_counts_logits_of_at_most_one_per_batched_token():
    estimate = TINY.estimate_activation_bytes(torch.float32, max_num_batched_tokens=8,
                                              max_num_seqs=256)
    assert estimate == 8 * (2 * 256 + 3 * 704) * 4 + 8 * 258 * 4


def test_plan_subtracts_the_activation_estimate_of_a_2048_token_forward_by_default():
    plan = plan_memory(LLAMA, 24 * GiB)
    assert plan.activation_bytes == LLAMA.estimate_activation_bytes(
        torch.bfloat16, max_num_batched_tokens=2048, max_num_seqs=256)


# Budget arithmetic


def test_plan_for_given_device_memory():
    plan = plan_memory(LLAMA, 24 * GiB, activation_bytes=0)
    assert plan.budget_bytes == int(24 * GiB * 0.9) - 16_060_522_496 == 7_132_300_902
    layout = plan.layout
    assert (layout.bytes_per_token, layout.bytes_per_page, layout.page_size) == (
        131_072, 2 * 2**20, 16)
    assert plan.num_pages == 3399  # 7,132,300,902 // 2,097,152 = 3400, one of them reserved
    assert plan.kv_bytes == 3400 * 2 * 2**20
    assert plan.max_tokens == 3399 * 16
    assert (plan.device, plan.device_memory, plan.in_use_bytes) == (None, 24 * GiB, 0)
    assert plan.reason is None


def test_max_sequences_gives_each_sequence_whole_pages():
    plan = plan_memory(LLAMA, 24 * GiB, activation_bytes=0)
    assert plan.max_sequences(8192) == 3399 // 512
    assert plan.max_sequences(17) == 3399 // 2


def test_a_larger_page_size_gives_fewer_pages_of_the_same_bytes():
    plan = plan_memory(LLAMA, 24 * GiB, activation_bytes=0, page_size=64)
    assert (plan.num_pages, plan.layout.bytes_per_page) == (849, 8 * 2**20)


def test_memory_fraction_is_of_the_given_memory():
    plan = plan_memory(TINY, 2**30, memory_fraction=0.5, activation_bytes=0)
    assert plan.budget_bytes == 2**29 - 2_952_448 * 4


def test_plan_reads_cuda_total_and_excludes_memory_others_use(monkeypatch):
    fake_cuda(monkeypatch, free=70 * GiB, total=80 * GiB)
    plan = plan_memory(LLAMA, activation_bytes=0, device="cuda")
    assert (plan.device, plan.device_memory, plan.in_use_bytes) == ("cuda", 80 * GiB, 10 * GiB)
    assert plan.budget_bytes == int(80 * GiB * 0.9) - 10 * GiB - 16_060_522_496


def test_plan_on_cpu_takes_the_fraction_of_total_ram_less_what_is_in_use(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemFree:         1048576 kB\n"
                       "MemAvailable:   16777216 kB\n")
    monkeypatch.setattr(planner, "_MEMINFO", meminfo)
    plan = plan_memory(TINY, device="cpu", activation_bytes=0)
    assert (plan.device, plan.device_memory, plan.in_use_bytes) == ("cpu", 32 * GiB, 16 * GiB)
    assert plan.budget_bytes == int(32 * GiB * 0.9) - 16 * GiB - 2_952_448 * 4
    # two tensor-parallel ranks on the CPU share the host: each plans in half of it
    rank = plan_memory(TINY, device="cpu", activation_bytes=0, tensor_parallel_size=2)
    assert (rank.device_memory, rank.in_use_bytes) == (16 * GiB, 8 * GiB)


def test_host_memory_falls_back_to_the_os_page_counts_without_meminfo(monkeypatch, tmp_path):
    monkeypatch.setattr(planner, "_MEMINFO", tmp_path / "missing")
    sizes = {"SC_PHYS_PAGES": 3000, "SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(planner.os, "sysconf", sizes.__getitem__)
    plan = plan_memory(TINY, device="cpu")
    assert (plan.device_memory, plan.in_use_bytes) == (12_288_000, 8_192_000)


def test_reserved_bytes_come_out_of_the_budget_and_are_named_when_it_is_short():
    weights = 2_952_448 * 4
    plan = plan_memory(TINY, weights + 2**20, memory_fraction=1.0, activation_bytes=0,
                       reserved_bytes=2**20 - 64 * 2**10)
    assert (plan.reserved_bytes, plan.budget_bytes, plan.num_pages) == (
        2**20 - 64 * 2**10, 64 * 2**10, 1)  # a page of 32 KiB and the reserved one
    short = plan_memory(TINY, weights, memory_fraction=1.0, activation_bytes=0,
                        reserved_bytes=2**20)
    assert short.reason == ("weights 11.26 MiB + activations 0 B + reserved 1.00 MiB exceed "
                            "100% of 11.26 MiB (11.26 MiB)")


def test_plan_reads_the_memory_of_the_device_it_is_given(device):
    cpu = device.type == "cpu"
    plan = plan_memory(TINY, device=device)
    assert plan.device == str(device) and plan.device_memory > 0
    if cpu:
        assert plan.device_memory == planner.host_memory()[0]
    # ranks on the CPU share the host's memory; on CUDA each rank has a device of its own
    rank = plan_memory(TINY, device=device, tensor_parallel_size=2)
    assert rank.device_memory == (plan.device_memory // 2 if cpu else plan.device_memory)


def test_plan_needs_device_memory_or_a_device_to_read_it_from():
    with pytest.raises(ValueError, match="needs device_memory .bytes. or the device to read"):
        plan_memory(TINY)


def test_a_model_larger_than_the_memory_gets_no_pages_and_a_reason():
    plan = plan_memory(LLAMA, 8 * GiB, activation_bytes=GiB // 2)
    assert (plan.num_pages, plan.max_tokens, plan.kv_bytes, plan.max_sequences(8192)) == (
        0, 0, 0, 0)
    assert plan.budget_bytes < 0
    assert plan.reason == ("weights 14.96 GiB + activations 512.00 MiB exceed 90% of "
                           "8.00 GiB (7.20 GiB)")


def test_the_reason_names_memory_already_in_use(monkeypatch):
    fake_cuda(monkeypatch, free=4 * GiB, total=24 * GiB)
    plan = plan_memory(LLAMA, activation_bytes=0, device="cuda")
    assert plan.reason == ("weights 14.96 GiB + activations 0 B + 20.00 GiB already in use exceed "
                           "90% of 24.00 GiB (21.60 GiB)")


def test_a_budget_below_one_page_gets_no_pages_and_a_reason():
    weights = 2_952_448 * 4
    plan = plan_memory(TINY, weights + 1000, memory_fraction=1.0, activation_bytes=0)
    assert (plan.num_pages, plan.budget_bytes) == (0, 1000)
    assert plan.reason == ("the 1,000 B left for the KV cache is less than one page of 32,768 B "
                           "(32.00 KiB) and the pool's reserved one: 65,536 B (64.00 KiB)")


# The model's geometry


@dataclass(frozen=True)
class Geometry:
    """A model known only by its sizes: what the planner reads of one."""

    layout: KVLayout
    num_parameters: int
    max_position_embeddings: int = 4096

    def weights_dtype(self, dtype=None):
        return dtype or self.layout.dtype

    def kv_layout(self, *, dtype=None, page_size=16, kv_cache_dtype="auto", max_model_len=None):
        return replace(self.layout, page_size=page_size)

    def mamba_layout(self, *, dtype=None, tensor_parallel_size=1):
        return None

    def count_parameters(self, tensor_parallel_size=1):
        return self.num_parameters

    def count_float32_parameters(self, tensor_parallel_size=1):
        return 0

    def estimate_activation_bytes(self, dtype, *, max_num_batched_tokens, max_num_seqs):
        return max_num_batched_tokens * 4


def test_a_model_config_is_a_model_geometry():
    assert isinstance(TINY, ModelGeometry)


def test_plan_takes_any_model_geometry():
    layout = KVLayout(2, 1, 8, torch.float32, 4)  # 128 B a token, 512 B a page
    plan = plan_memory(Geometry(layout, 1000), 20_000, memory_fraction=1.0, page_size=4)
    assert (plan.weight_bytes, plan.activation_bytes) == (4000, 2048 * 4)
    assert plan.budget_bytes == 20_000 - 4000 - 8192 == 7808
    assert plan.num_pages == 7808 // 512 - 1 == 14  # and the reserved page


class SplitGeometry(Geometry):
    """`num_parameters` of which 3 every rank holds whole and the rest split evenly."""

    def count_parameters(self, tensor_parallel_size=1):
        return (self.num_parameters - 3) // tensor_parallel_size + 3


def test_a_rank_plans_the_weights_its_geometry_counts_for_one_rank():
    layout = KVLayout(2, 1, 8, torch.float32, 4)
    plan = plan_memory(SplitGeometry(layout, 1001), 20_000, tensor_parallel_size=2)
    assert (plan.num_parameters, plan.weight_bytes) == (1001, (499 + 3) * 4)


@pytest.mark.parametrize("source", ["Llama-3-8B", Path("config.json"), dict(SMALL), None])
def test_plan_refuses_what_is_not_a_model_geometry_and_names_the_parser(source):
    with pytest.raises(TypeError, match=r"plan_memory takes a model geometry, got .*"
                                        r"ModelConfig\.from_hf\(source\)"):
        plan_memory(source, GiB)


# Argument validation


@pytest.mark.parametrize("fraction", [0, -0.1, 1.01])
def test_plan_rejects_a_memory_fraction_outside_zero_to_one(fraction):
    with pytest.raises(ValueError, match=rf"memory_fraction must be in \(0, 1\], got {fraction}"):
        plan_memory(TINY, GiB, memory_fraction=fraction)


@pytest.mark.parametrize(("device_memory", "error"), [
    (0, ValueError), (-1, ValueError), (2**63, ValueError), (2.5e9, TypeError),
    ("24GiB", TypeError), (True, TypeError),
])
def test_plan_rejects_device_memory_that_is_not_a_positive_int64(device_memory, error):
    with pytest.raises(error, match="device_memory must be"):
        plan_memory(TINY, device_memory)


def test_all_of_the_largest_device_memory_stays_within_int64():
    plan = plan_memory(TINY, 2**63 - 1, memory_fraction=1.0)
    assert plan.usable_bytes == 2**63 - 1  # the float product rounds to 2**63


@pytest.mark.parametrize("name", ["activation_bytes", "reserved_bytes"])
@pytest.mark.parametrize("value", [-1, 2**63])
def test_plan_rejects_bytes_set_aside_below_0_or_past_int64(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be in \[0, {2**63 - 1}\], got {value}"):
        plan_memory(TINY, GiB, **{name: value})


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"dtype": torch.float8_e4m3fn}, ValueError, "not one kvpool's models compute in"),
    ({"dtype": torch.float64}, ValueError, "not one kvpool's models compute in"),
    ({"dtype": "bfloat16"}, TypeError, "dtype must be a torch.dtype or None"),
    ({"max_model_len": 8193}, ValueError, "max_model_len 8193 exceeds the model's "
                                          "max_position_embeddings 8192"),
    ({"free_out_of_window": "no"}, TypeError, "free_out_of_window must be a bool, got str"),
])
def test_plan_refuses_what_the_engine_refuses(options, error, message):
    with pytest.raises(error, match=message):
        plan_memory(ModelConfig.from_hf("Llama-3-8B"), 24 * GiB, **options)


def test_plan_rejects_a_page_size_below_one():
    with pytest.raises(ValueError, match=rf"page_size must be in \[1, {2**63 - 1}\], got 0"):
        plan_memory(TINY, GiB, page_size=0)


@pytest.mark.parametrize("context_len", [0, 2**63])
def test_max_sequences_rejects_a_context_len_below_one_or_past_int64(context_len):
    with pytest.raises(ValueError, match=rf"context_len must be in \[1, {2**63 - 1}\], "
                                         rf"got {context_len}"):
        plan_memory(TINY, GiB).max_sequences(context_len)


def test_plan_reads_the_share_of_cuda_memory_torch_allows_this_process(monkeypatch):
    # set_per_process_memory_fraction(0.25) on an 80 GiB device, 70 GiB free, 4 GiB reserved
    # by this process already: the plan sees a 20 GiB device with 4 GiB in use.
    fake_cuda(monkeypatch, free=70 * GiB, total=80 * GiB, share=0.25, reserved=4 * GiB)
    plan = plan_memory(LLAMA, activation_bytes=0, device="cuda")
    assert (plan.device_memory, plan.in_use_bytes) == (20 * GiB, 4 * GiB)


def test_memory_torch_keeps_for_this_process_but_no_tensor_uses_is_free_to_the_plan(
        monkeypatch):
    # an earlier engine's pool, freed, stays reserved in torch's cache: 6 GiB reserved, 2 GiB
    # allocated; the device says 70 GiB free, this process can have 74
    fake_cuda(monkeypatch, free=70 * GiB, total=80 * GiB, reserved=6 * GiB, allocated=2 * GiB)
    assert plan_memory(LLAMA, activation_bytes=0, device="cuda").in_use_bytes == 6 * GiB
    fake_cuda(monkeypatch, free=70 * GiB, total=80 * GiB, share=0.25, reserved=6 * GiB,
              allocated=2 * GiB)
    plan = plan_memory(LLAMA, activation_bytes=0, device="cuda")
    assert (plan.device_memory, plan.in_use_bytes) == (20 * GiB, 2 * GiB)


def test_plan_cannot_read_cuda_memory_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA, and this machine has no CUDA device"):
        plan_memory(TINY, device="cuda")


@pytest.mark.parametrize(("device", "message"), [
    ("meta", "cannot read the memory of device 'meta'; pass device_memory"),
    ("gpu0", "device 'gpu0' is not a torch device"),
])
def test_plan_rejects_devices_it_cannot_read(device, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(TINY, device=device)


# The engine's plan


def test_the_engine_on_cuda_plans_its_share_of_the_total_less_what_is_in_use(monkeypatch):
    fake_cuda(monkeypatch, free=70 * GiB, total=80 * GiB)
    model, config = ModelConfig.from_hf("Llama-3-8B"), EngineConfig()
    layout = model.kv_layout()
    activations = model.estimate_activation_bytes(torch.bfloat16, max_num_batched_tokens=2048,
                                                  max_num_seqs=64)
    workspace = config.workspace_bytes(model, layout, 8192)
    graphs = config.cuda_graph_bytes(model, torch.bfloat16)
    budget = int(80 * GiB * 0.9) - 10 * GiB - 8_030_261_248 * 2 - activations - workspace - graphs
    assert config.plan_num_pages(model, torch.device("cuda"), 8192) == budget // 2**21 - 1


def test_the_cuda_graphs_hold_the_activations_of_max_num_seqs_tokens_and_none_when_eager():
    # a decode graph runs one token per sequence: its bucket is max_num_seqs tokens
    model = ModelConfig.from_hf("Llama-3-8B")
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=2048)
    assert config.cuda_graph_bytes(model, torch.bfloat16) == model.estimate_activation_bytes(
        torch.bfloat16, max_num_batched_tokens=8, max_num_seqs=8)
    assert EngineConfig(enforce_eager=True).cuda_graph_bytes(model, torch.bfloat16) == 0


def test_a_mixed_model_plan_splits_the_pages_bytes_between_its_pools():
    plan = plan_memory(GEMMA, 24 * GiB, max_num_seqs=32, max_model_len=8192)
    full, window = plan.groups
    assert (full.group.window, window.group.window) == (None, 1024)
    assert window.num_pages == 32 * 65 + 512
    # each pool's reserved page on top: one page of every layer in all, as one pool's
    assert full.nbytes + window.nbytes <= (plan.num_pages + 1) * plan.layout.bytes_per_page
    assert (plan.num_pages + 1) * plan.layout.bytes_per_page - full.nbytes - window.nbytes < \
        full.bytes_per_page
    assert plan.max_tokens == full.max_tokens and plan.kv_bytes == full.nbytes + window.nbytes
    assert plan.max_sequences(8192) == min(full.num_pages // 512, window.num_pages // 65)


def test_a_mixed_model_plan_keeps_one_pool_when_told_to():
    plan = plan_memory(GEMMA, 24 * GiB, free_out_of_window=False)
    assert plan.groups == () and plan.max_tokens == plan.num_pages * 16


def test_an_all_windowed_model_plans_one_pool():
    assert plan_memory(MISTRAL, 24 * GiB).groups == ()


def test_a_model_of_windows_of_different_widths_counts_the_widest_per_sequence():
    layout = KVLayout(2, 1, 8, torch.float32, 16, layer_windows=(4, 64))
    plan = plan_memory(Geometry(layout, 1000), 10**6, memory_fraction=1.0)
    assert plan.window == 64
    assert plan.pages_per_sequence(1000) == 64 // 16 + 1


def test_an_all_windowed_model_counts_a_window_of_pages_per_sequence_unless_it_keeps_them():
    given_back = plan_memory(MISTRAL, 24 * GiB)
    kept = plan_memory(MISTRAL, 24 * GiB, free_out_of_window=False)
    assert (given_back.window, kept.window) == (4096, None)
    assert given_back.num_pages == kept.num_pages
    assert given_back.max_sequences(32768) == kept.num_pages // (256 + 1)
    assert kept.max_sequences(32768) == kept.num_pages // 2048
    assert given_back.max_sequences(1024) == kept.max_sequences(1024) == kept.num_pages // 64


def test_split_budget_gives_the_window_pool_its_windows_and_a_prompt_and_the_rest_to_the_full():
    layout = KVLayout(4, 1, 8, torch.float16, 4, layer_windows=(None, 8, 8, None))
    full, window = split_budget(layout, 10 * layout.bytes_per_page, max_num_seqs=1,
                                prefill_tokens=8)
    assert window.num_pages == 3 + 2  # one window (2 pages and 1) and an 8-token prompt
    assert full.num_pages == 15  # the bytes of 10 pages of 4 layers, less 5 of 2 layers
    assert window.pages_per_sequence(100) == 3 and full.pages_per_sequence(100) == 25


def test_split_budget_never_gives_a_window_pool_more_tokens_than_one_pool_holds():
    layout = KVLayout(4, 1, 8, torch.float16, 4, layer_windows=(None, 8, 8, None))
    full, window = split_budget(layout, 10 * layout.bytes_per_page, max_num_seqs=8,
                                prefill_tokens=8)
    assert (full.num_pages, window.num_pages) == (10, 10)


def test_no_pool_is_planned_past_the_page_ids_of_int32_page_tables():
    plan = plan_memory(TINY, 2**44, page_size=1, kv_cache_dtype="fp8_e4m3", activation_bytes=0)
    assert plan.layout.bytes_per_page * MOST_PAGES < plan.budget_bytes
    assert (plan.num_pages, plan.reason) == (MOST_PAGES, None)
    layout = KVLayout(4, 1, 1, torch.float8_e4m3fn, 1, layer_windows=(None, 8, 8, None))
    full, window = split_budget(layout, 2**40, max_num_seqs=2**40, prefill_tokens=0)
    assert (full.num_pages, window.num_pages) == (MOST_PAGES, MOST_PAGES)


def test_a_hybrid_whose_state_slots_leave_no_page_says_so():
    from kvpool.formats import exact_bytes
    from kvpool.models.config import ModelConfig
    bamba = ModelConfig.from_hf("Bamba-9B")
    slot = bamba.mamba_layout().bytes_per_slot
    first = plan_memory(bamba, 40 * 2**30, memory_fraction=1.0)
    # memory for 50 slots and 1,000 bytes more once the weights and activations are in
    memory = 40 * 2**30 - first.budget_bytes + 50 * slot + 1000
    plan = plan_memory(bamba, memory, memory_fraction=1.0, mamba_memory_ratio=1 - 1e-9)
    assert plan.num_pages == 0 and plan.num_state_slots == 49
    assert plan.reason.startswith(f"the {exact_bytes(plan.budget_bytes - plan.state_bytes)} "
                                  f"left for the KV cache after 49 state slots")


def test_a_hybrid_given_its_state_slots_takes_them_out_of_the_budget_before_the_pages():
    bamba = ModelConfig.from_hf("Bamba-9B")
    plan = plan_memory(bamba, 40 * GiB, num_state_slots=128)
    slot = bamba.mamba_layout().bytes_per_slot
    assert (plan.num_state_slots, plan.mamba_memory_ratio) == (128, 0.0)
    assert plan.num_pages == pages_within(plan.layout, plan.budget_bytes - 129 * slot)
    for bad, error in ((0, ValueError), (True, TypeError), (2**63, ValueError)):
        with pytest.raises(error, match="num_state_slots"):
            plan_memory(bamba, 40 * GiB, num_state_slots=bad)


def test_a_hybrid_with_nothing_left_for_the_cache_says_no_state_slot_fits():
    bamba = ModelConfig.from_hf("Bamba-9B")
    first = plan_memory(bamba, 40 * GiB, memory_fraction=1.0)
    plan = plan_memory(bamba, 40 * GiB - first.budget_bytes, memory_fraction=1.0)
    assert (plan.budget_bytes, plan.num_state_slots, plan.num_pages) == (0, 0, 0)
    assert plan.reason == ("50% of the 0 B left for the cache is less than one state slot of "
                           "62,287,360 B (59.40 MiB) and the reserved one")


def test_a_window_no_sequence_of_max_model_len_passes_is_planned_as_full_attention():
    # as the engine keeps it (Phi-3.5 states a window of 262,144 tokens past its context)
    short = plan_memory(GEMMA, 24 * GiB, max_model_len=1024)
    assert short.layout.layer_windows == () and short.groups == ()
    assert short.max_tokens == short.num_pages * 16
    longer = plan_memory(GEMMA, 24 * GiB, max_model_len=1025)
    assert [pool.group.window for pool in longer.groups] == [None, 1024]
    assert plan_memory(MISTRAL, 24 * GiB, max_model_len=4096).window is None
    assert plan_memory(MISTRAL, 24 * GiB, max_model_len=4097).window == 4096
    with pytest.raises(ValueError, match="max_model_len must be .* got 0"):
        plan_memory(GEMMA, 24 * GiB, max_model_len=0)
