"""Numbers checked as the device holds them (kvpool.numeric), and the callers that share the
check: SamplingParams and the server's request parsing."""

import math

import pytest
import torch

from kvpool.numeric import FLOAT32_TINY, INT64_MAX, check_float32, check_int64, int_tensor
from kvpool.server.limits import ServerLimits
from kvpool.server.protocol import RequestError, parse_completion


@pytest.mark.parametrize("value", [1e39, -1e39, math.inf, math.nan, 10**400])
def test_check_float32_refuses_what_is_not_finite_in_float32(value):
    with pytest.raises(ValueError, match="scale must be finite as a float32"):
        check_float32("scale", value)


@pytest.mark.parametrize("value", [1e-46, 1e-39, 0.0])
def test_check_float32_normal_refuses_what_flushes_or_is_subnormal(value):
    with pytest.raises(ValueError, match=f"scale must be a normal float32.*got {value!r}"):
        check_float32("scale", value, normal=True)


def test_check_float32_accepts_the_float32_bounds():
    assert check_float32("x", FLOAT32_TINY, normal=True) == FLOAT32_TINY
    assert check_float32("x", 3.4e38) == 3.4e38


def test_check_float32_names_an_open_low_bound():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        check_float32("top_p", 0, low=0.0, high=1.0, open_low=True)


@pytest.mark.parametrize("value", [True, "1.0", None])
def test_check_float32_refuses_other_types(value):
    with pytest.raises(TypeError, match="x must be a number"):
        check_float32("x", value)


def test_check_int64_refuses_past_int64():
    assert check_int64("top_k", INT64_MAX, 0) == INT64_MAX
    with pytest.raises(ValueError, match=r"top_k must be in \[0, 9223372036854775807\]"):
        check_int64("top_k", 2**63, 0)


@pytest.mark.parametrize("name", ["top_k", "n", "max_tokens"])
def test_server_refuses_an_int_past_int64_naming_the_field(name):
    with pytest.raises(RequestError, match=f"{name} must be <= {INT64_MAX}") as info:
        parse_completion({"model": "tiny", "prompt": "x", name: 2**63}, "tiny", ServerLimits())
    assert info.value.param == name


def test_server_accepts_a_tiny_top_p():
    request = parse_completion({"model": "tiny", "prompt": "x", "top_p": 1e-300}, "tiny",
                               ServerLimits())
    assert request.sampling_params(4).top_p == 1e-300


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int_tensor_holds_the_ints_in_order(dtype):
    values = [0, 5, -3, torch.iinfo(dtype).max, torch.iinfo(dtype).min]
    t = int_tensor(values, dtype)
    assert t.dtype == dtype and t.device.type == "cpu" and t.tolist() == values


def test_int_tensor_of_no_ints_is_empty():
    assert int_tensor([], torch.int32).shape == (0,)


def test_int_tensor_refuses_an_int_past_its_dtype():
    with pytest.raises(OverflowError):
        int_tensor([2**31], torch.int32)
