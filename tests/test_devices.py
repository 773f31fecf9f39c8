"""Devices are explicit below LLM and the CLI: every pool, cache, state pool, workspace and model
takes a keyword-only device with no default; a bad one is a ValueError that says what was
expected. Only the engine picks one (CUDA when present, else the CPU)."""

import pytest
import torch

from hybrid_util import hybrid_cache
from kvpool.cache import KVCache
from kvpool.devices import check_device
from kvpool.engine.config import engine_device
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import KVPool
from kvpool.memory.state_pool import MambaLayout, MambaPool
from kvpool.memory.workspace import Workspace
from kvpool.models.config import ModelConfig
from kvpool.models.llama import LlamaForCausalLM
from kvpool.models.loader import LoadedModel, load_model

LAYOUT = KVLayout(1, 1, 4, torch.float32, page_size=4)
MIXED = KVLayout(2, 1, 4, torch.float32, page_size=4, layer_windows=(None, 8))
STATES = MambaLayout(num_layers=1, conv_dim=3, conv_kernel=3, num_heads=1, head_dim=2,
                     state_size=2, dtype=torch.float32)
BUILDERS = {
    "KVPool": lambda **device: KVPool(LAYOUT, 2, **device),
    "KVCache": lambda **device: KVCache(LAYOUT, 2, **device),
    "KVCache full+window": lambda **device: KVCache(MIXED, (2, 2), **device),
    "KVCache full+state": lambda **device: hybrid_cache(LAYOUT, 2, STATES, 1, **device),
    "MambaPool": lambda **device: MambaPool(STATES, 1, **device),
    "Workspace": lambda **device: Workspace(64, **device),
    "LlamaForCausalLM": lambda **device: LlamaForCausalLM(ModelConfig.from_hf("tiny"), **device),
    "load_model": lambda **device: load_model("tiny", **device),
}


@pytest.mark.parametrize("name", BUILDERS)
def test_a_missing_device_is_a_type_error(name):
    with pytest.raises(TypeError, match="device"):
        BUILDERS[name]()


@pytest.mark.parametrize("name", BUILDERS)
def test_none_is_no_device(name):
    with pytest.raises(ValueError, match="device must be given"):
        BUILDERS[name](device=None)


def device_types(built) -> set[str]:
    """The device types of what `built` holds."""
    module = built.model if isinstance(built, LoadedModel) else built
    if isinstance(module, torch.nn.Module):
        return {t.device.type for t in [*module.parameters(), *module.buffers()]}
    return {built.device.type}


@pytest.mark.parametrize("name", BUILDERS)
def test_everything_lands_on_the_device_it_is_given(name, device):
    assert device_types(BUILDERS[name](device=device)) == {device.type}


@pytest.mark.parametrize(("device", "message"), [
    (None, "device must be given"),
    ("gpu", "device 'gpu' is not a torch device"),
    (0, "device must be a torch.device or a name such as 'cpu' or 'cuda', got int 0"),
])
def test_check_device_refuses_what_is_not_a_device(device, message):
    with pytest.raises(ValueError, match=message):
        check_device(device)


def test_a_cuda_device_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda:0' needs CUDA, and this machine has no"):
        check_device("cuda:0")


def test_a_cuda_device_past_the_last_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="'cuda:2' does not exist: this machine has 2 CUDA"):
        check_device("cuda:2")


def test_the_engine_picks_cuda_when_present_else_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_device(None) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_device(None) == torch.device("cuda")
    assert engine_device("cpu") == torch.device("cpu")


def test_decode_steps_replay_graphs_only_where_attention_runs_on_triton(monkeypatch):
    # The torch path reads a batch's lengths back on the host, which a capture forbids.
    from kvpool.engine.graphs import replays_graphs
    from kvpool.kernels import triton_support
    from kvpool.memory.fp8 import FP8_DTYPE

    cuda = torch.device("cuda")
    monkeypatch.setattr(triton_support, "triton_installed", lambda: True)
    monkeypatch.setattr(triton_support, "interpreted", lambda: False)
    for arch, fp8 in ((80, False), (89, True), (90, True)):  # fp8 pages from sm_89 on
        monkeypatch.setattr(triton_support, "_cuda_arch", lambda device, arch=arch: arch)
        assert replays_graphs(cuda, torch.bfloat16)
        assert replays_graphs(cuda, FP8_DTYPE) == fp8
    monkeypatch.setattr(triton_support, "triton_installed", lambda: False)
    assert not replays_graphs(cuda, torch.bfloat16)
    assert not replays_graphs(torch.device("cpu"), torch.bfloat16)
