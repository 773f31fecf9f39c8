"""KVLayout: the geometry of the paged KV cache."""

import dataclasses

import pytest
import torch

from kvpool.memory.layout import KVLayout

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
@pytest.mark.parametrize("value", [0, -1, 2**63])
def test_layout_rejects_sizes_below_one_or_past_int64(field, value):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16) | {field: value}
    with pytest.raises(ValueError, match=rf"{field} must be in \[1, {2**63 - 1}\], got {value}"):
        KVLayout(**args)


@pytest.mark.parametrize("value", [True, 16.0, "16"])
def test_layout_rejects_sizes_that_are_not_ints(value):
    with pytest.raises(TypeError, match="page_size must be an int"):
        KVLayout(2, 2, 64, page_size=value)


@pytest.mark.parametrize("dtype", ["float16", torch.int32])
def test_layout_rejects_a_dtype_that_is_not_a_floating_torch_dtype(dtype):
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        KVLayout(2, 2, 64, dtype)


@pytest.mark.parametrize(("num_tokens", "num_pages"), [(0, 0), (1, 1), (16, 1), (17, 2)])
def test_num_pages_for_rounds_up_to_whole_pages(num_tokens, num_pages):
    assert KVLayout(2, 2, 64).num_pages_for(num_tokens) == num_pages


def test_num_pages_for_refuses_a_negative_token_count():
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -5"):
        KVLayout(2, 2, 64).num_pages_for(-5)


# MLA: one latent plane


def test_mla_bytes_per_token_count_one_latent_per_layer():
    # DeepSeek-V2-Lite: 27 layers, kv_lora_rank 512 + qk_rope_head_dim 64, bf16
    layout = KVLayout(27, 1, 576, torch.bfloat16, kind="mla")
    assert (layout.num_planes, layout.bytes_per_token) == (1, 27 * 576 * 2)


def test_layout_kind_defaults_to_mha_with_k_and_v_planes():
    assert (KVLayout(2, 2, 64).kind, KVLayout(2, 2, 64).num_planes) == ("mha", 2)


def test_layout_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match=r"kind must be one of \('mha', 'mla'\), got 'gqa'"):
        KVLayout(2, 2, 64, kind="gqa")


def test_mla_layout_rejects_more_than_one_kv_head():
    with pytest.raises(ValueError, match="num_kv_heads must be 1, got 2"):
        KVLayout(2, 2, 64, kind="mla")


# layer groups

def test_a_layout_without_windows_is_one_full_group_of_every_layer():
    (group,) = KVLayout(3, 2, 64, torch.bfloat16).groups
    assert (group.window, group.layers) == (None, (0, 1, 2))
    assert group.bytes_per_token == KVLayout(3, 2, 64, torch.bfloat16).bytes_per_token


def test_groups_gather_layers_by_window_full_first_then_smallest_window():
    layout = KVLayout(5, 2, 64, torch.bfloat16, layer_windows=(512, None, 128, 512, None))
    assert [(g.window, g.layers) for g in layout.groups] == [
        (None, (1, 4)), (128, (2,)), (512, (0, 3))]
    assert [g.bytes_per_token for g in layout.groups] == [2 * 2 * 2 * 64 * 2, 2 * 2 * 64 * 2,
                                                         2 * 2 * 2 * 64 * 2]
    assert sum(g.bytes_per_token for g in layout.groups) == layout.bytes_per_token


def test_layer_windows_must_name_every_layer():
    with pytest.raises(ValueError, match="layer_windows names 2 layers, the layout has 3"):
        KVLayout(3, 2, 64, layer_windows=(8, None))


def test_layer_windows_must_be_a_tuple():
    with pytest.raises(TypeError, match=r"layer_windows must be a tuple, got \[None, 8\]"):
        KVLayout(2, 2, 64, layer_windows=[None, 8])


def test_a_window_must_be_a_positive_token_count():
    with pytest.raises(ValueError, match="layer_windows"):
        KVLayout(2, 2, 64, layer_windows=(0, None))
