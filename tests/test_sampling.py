"""Sampling: SamplingParams validation, top-k/top-p filtering, greedy and seeded draws,
and the stop rules (stop tokens, EOS, ignore_eos, max_tokens)."""

import math

import pytest
import torch

from kvpool.engine.params import MIN_TEMPERATURE, SamplingParams
from kvpool.engine.sampling import (
    Sampler,
    apply_top_k_top_p,
    exponential_noise,
    hash32,
    row_keys,
    stop_reason,
)

INF = math.inf


def _filter(logits, top_k, top_p):
    logits = torch.tensor(logits, dtype=torch.float32)
    return apply_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p)).tolist()


# ---- SamplingParams ----------------------------------------------------------------------

def test_sampling_params_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.n) == (16, 1.0, 1.0, 0, 1)
    assert (p.seed, p.stop_token_ids, p.ignore_eos, p.greedy) == (None, (), False, False)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"n": 0}, "n"),
    ({"seed": -3}, "seed"),
    ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
    ({"stop_token_ids": "ab"}, "stop_token_ids"),
    ({"stop_token_ids": 7}, "stop_token_ids"),
    ({"stop_token_ids": {3, 4}}, "stop_token_ids"),
    ({"stop_token_ids": {3: 4}}, "stop_token_ids"),
    ({"top_k": 2**63}, "top_k"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"n": 2**64}, "n"),
    ({"stop_token_ids": (2**63,)}, "stop_token_ids"),
    ({"temperature": 1e39}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
])
def test_sampling_params_rejects_bad_values_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"max_tokens": 2.0}, {"n": True}, {"top_p": "0.9"}])
def test_sampling_params_rejects_bad_types(kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_sampling_params_stores_stop_token_ids_as_tuple():
    p = SamplingParams(stop_token_ids=[3, 4, 3])
    assert (p.stop_token_ids, p.stop_token_set) == ((3, 4, 3), frozenset({3, 4}))


def test_sampling_params_stores_int_temperatures_and_top_p_as_floats():
    params = SamplingParams(temperature=10**20, top_p=1)
    assert (params.temperature, params.top_p) == (1e20, 1.0)
    assert type(params.temperature) is float and type(params.top_p) is float


# ---- top-k / top-p -----------------------------------------------------------------------

def test_top_k_keeps_the_k_largest_logits():
    assert _filter([[1.0, 4.0, 2.0, 3.0]], [2], [1.0]) == [[-INF, 4.0, -INF, 3.0]]


def test_top_k_keeps_ties_with_the_kth_value():
    assert _filter([[1.0, 3.0, 3.0, 0.0]], [2], [1.0]) == [[-INF, 3.0, 3.0, -INF]]
    assert _filter([[2.0, 3.0, 2.0, 0.0]], [2], [1.0]) == [[2.0, 3.0, 2.0, -INF]]


def test_top_k_zero_and_above_vocab_keep_everything():
    logits = [[1.0, 4.0, 2.0], [0.5, 0.0, -1.0]]
    assert _filter(logits, [0, 7], [1.0, 1.0]) == logits


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.2, 0.2, 0.1]]).log().tolist()
    kept = _filter(logits, [0], [0.6])  # 0.5 < 0.6, so 0.5 + one 0.2
    assert [x > -INF for x in kept[0]] == [True, True, False, False]
    kept = _filter(logits, [0], [0.5])  # 0.5 reaches 0.5 alone
    assert [x > -INF for x in kept[0]] == [True, False, False, False]
    kept = _filter(logits, [0], [0.95])
    assert [x > -INF for x in kept[0]] == [True, True, True, True]


def test_top_p_always_keeps_the_most_likely_token():
    kept = _filter([[0.0, 5.0, 1.0]], [0], [1e-6])
    assert kept == [[-INF, 5.0, -INF]]


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-40])
def test_a_top_p_that_is_zero_or_subnormal_in_float32_samples_the_most_likely_token(top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=i) for i in range(6)]
    assert _sample(logits, params) == logits.argmax(-1).tolist()


def test_top_p_applies_to_probabilities_renormalised_after_top_k():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().tolist()
    # after top_k=2: 0.4/0.7 = 0.57 and 0.3/0.7 = 0.43; top_p 0.5 keeps only the first
    kept = _filter(logits, [2], [0.5])
    assert [x > -INF for x in kept[0]] == [True, False, False, False]


def test_filters_are_per_row():
    logits = [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]
    assert _filter(logits, [1, 0], [1.0, 1.0]) == [[-INF, -INF, 3.0], [3.0, 2.0, 1.0]]


# ---- Sampler -----------------------------------------------------------------------------

def _sample(logits, params, *, seed=0, streams=None, positions=None):
    n = len(params)
    streams = list(range(n)) if streams is None else streams
    positions = [5] * n if positions is None else positions
    return Sampler(seed)(logits, params, streams, positions).tolist()


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 4.9], [0.0, 0.0, 1.0]])
    greedy = SamplingParams(temperature=0)
    assert _sample(logits, [greedy] * 3) == [1, 0, 2]


def test_greedy_ties_take_the_first_index_like_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0]])
    assert _sample(logits, [SamplingParams(temperature=0)]) == [1]


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, MIN_TEMPERATURE / 2])
def test_tiny_temperatures_are_greedy_not_nan(temperature):
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0], [-3.0, -1.0, -2.0, -0.5]])
    params = [SamplingParams(temperature=temperature)] * 2
    assert _sample(logits, params) == [1, 3]
    assert params[0].greedy and not SamplingParams(temperature=MIN_TEMPERATURE).greedy


def test_a_temperature_at_the_bound_samples():
    logits = torch.tensor([[0.0, 1e-9, 0.0]] * 200)
    tokens = _sample(logits, [SamplingParams(temperature=MIN_TEMPERATURE)] * 200)
    # 1e-9 / 1e-5 is a tiny margin: the draw is close to uniform, not an argmax
    assert set(tokens) == {0, 1, 2}


def test_top_k_one_sampling_is_the_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    assert _sample(logits, params) == logits.argmax(-1).tolist()


def test_sampling_never_picks_a_filtered_token():
    logits = torch.zeros(64, 10)
    params = [SamplingParams(top_k=3)] * 64
    logits[:, [2, 5, 7]] = 1.0
    assert set(_sample(logits, params)) <= {2, 5, 7}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(3000, 3)
    tokens = torch.tensor(_sample(logits, [SamplingParams()] * 3000))
    freq = torch.bincount(tokens, minlength=3) / 3000
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize("temperature", [0.25, 4.0])
def test_sampling_follows_the_distribution_of_the_logits_over_the_temperature(temperature):
    logits = torch.tensor([0.0, -1.0]).expand(4000, 2)
    tokens = torch.tensor(_sample(logits, [SamplingParams(temperature=temperature)] * 4000))
    freq = torch.bincount(tokens, minlength=2) / 4000
    # P(token 0) is 0.982 at 0.25 and 0.562 at 4 (0.731 at temperature 1)
    assert torch.allclose(freq, (logits[0] / temperature).softmax(-1), atol=0.03)


def test_one_row_over_many_positions_follows_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = probs.log().expand(4000, 4)
    params = [SamplingParams(seed=3)] * 4000
    tokens = torch.tensor(_sample(logits, params, streams=[0] * 4000,
                                  positions=list(range(4000))))
    freq = torch.bincount(tokens, minlength=4) / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_exponential_noise_has_mean_one_and_is_positive():
    noise = exponential_noise(row_keys([0] * 64, list(range(64)), [0] * 64), 1000)
    assert noise.min() > 0
    assert abs(noise.mean().item() - 1.0) < 0.01


def test_row_keys_differ_in_each_component():
    keys = row_keys([1, 2, 1, 1, 2**64 - 1], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0]).tolist()
    assert len(set(keys)) == 5
    assert all(0 <= k < 2**32 for k in keys)


def test_two_seeds_never_share_a_whole_stream():
    """Seeds 1 and hash32(1) << 32 met in one 32-bit state when the seed was hashed first,
    and then drew the same tokens at every position."""
    pair = [1, hash32(torch.tensor(1)).item() << 32]
    positions = list(range(200))
    keys = [row_keys([seed] * 200, [0] * 200, positions) for seed in pair]
    assert (keys[0] == keys[1]).sum() <= 1


def test_seeded_row_draws_the_same_whatever_the_batch():
    row = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(seed=7)
    alone = _sample(row, [p], seed=0, streams=[0], positions=[9])
    others = torch.randn(5, 100)
    batch = torch.cat([others[:3], row, others[3:]])
    params = [SamplingParams()] * 3 + [p] + [SamplingParams(seed=8, top_k=5)] * 2
    assert _sample(batch, params, seed=99, streams=[4, 5, 6, 0, 0, 1],
                   positions=[1, 2, 3, 9, 9, 9])[3] == alone[0]


def test_seeded_draws_are_reproducible_and_depend_on_seed_stream_and_position():
    logits = torch.zeros(1, 1000)
    def draw(seed, stream, position):
        return _sample(logits, [SamplingParams(seed=seed)], streams=[stream],
                       positions=[position])[0]
    assert draw(7, 0, 3) == draw(7, 0, 3)
    base = draw(7, 0, 3)
    assert base not in [draw(8, 0, 3), draw(7, 1, 3), draw(7, 0, 4)]


def test_unseeded_rows_draw_from_the_engine_seed():
    logits = torch.zeros(4, 1000)
    params = [SamplingParams()] * 4
    assert _sample(logits, params, seed=1) == _sample(logits, params, seed=1)
    assert _sample(logits, params, seed=1) != _sample(logits, params, seed=2)


def test_a_row_seeded_with_the_engine_seed_draws_apart_from_the_unseeded_row_of_its_stream():
    # stream 0: the seeded request's first sample, and the unseeded sequence with id 0
    logits = torch.zeros(400, 1000)
    params = [SamplingParams(seed=0)] * 200 + [SamplingParams()] * 200
    tokens = _sample(logits, params, seed=0, streams=[0] * 400, positions=list(range(200)) * 2)
    assert sum(a == b for a, b in zip(tokens[:200], tokens[200:], strict=True)) <= 2


def test_temperature_mixes_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 1.0, 0.5]] * 2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1, top_k=1)]
    assert _sample(logits, params) == [1, 1]


@pytest.mark.parametrize("temperature", [2**63, 10**20])
@pytest.mark.parametrize("beside", [[], [0.7]], ids=["alone", "beside_a_float"])
def test_int_temperatures_finite_in_float32_sample_alone_or_beside_a_float(temperature,
                                                                          beside):
    """An int temperature past int64 (finite in float32) samples whatever else is in the
    batch: its row's tensors never take the dtype of the values."""
    params = [SamplingParams(temperature=temperature)] + [SamplingParams(temperature=t)
                                                          for t in beside]
    logits = torch.randn(len(params), 16, generator=torch.Generator().manual_seed(0))
    tokens = _sample(logits, params)
    assert all(0 <= token < 16 for token in tokens)


def test_sampled_tokens_stay_on_the_logits_device_as_int64():
    tokens = Sampler(0)(torch.zeros(2, 4), [SamplingParams()] * 2, [0, 1], [0, 0])
    assert tokens.dtype == torch.int64 and tokens.device == torch.device("cpu")


def test_hash32_avalanches():
    x = torch.arange(1024, dtype=torch.int64)
    flipped = hash32(x) ^ hash32(x ^ 1)
    bits = sum(((flipped >> b) & 1).sum().item() for b in range(32)) / 1024
    assert 14 < bits < 18  # about half of the 32 output bits change


# ---- stop rules --------------------------------------------------------------------------

def test_stop_token_stops():
    p = SamplingParams(stop_token_ids=(5,))
    assert stop_reason(5, 1, p, eos_token_ids=()) == "stop"
    assert stop_reason(4, 1, p, eos_token_ids=()) is None


def test_a_sampled_token_is_looked_up_in_the_stop_ids_not_compared_with_each():
    compared = []

    class TokenId(int):  # records each comparison asked of it
        def __eq__(self, other):
            compared.append(other)
            return int(self) == other

        __hash__ = int.__hash__

    p = SamplingParams(stop_token_ids=[TokenId(t) for t in range(1000)])
    compared.clear()
    assert stop_reason(5000, 1, p, eos_token_ids=()) is None
    assert stop_reason(7, 1, p, eos_token_ids=()) == "stop"
    assert compared == [7]  # the one id of the same hash


def test_eos_stops_unless_ignore_eos():
    assert stop_reason(2, 1, SamplingParams(), eos_token_ids={2}) == "stop"
    assert stop_reason(2, 1, SamplingParams(ignore_eos=True), eos_token_ids={2}) is None


def test_ignore_eos_still_honours_stop_token_ids():
    p = SamplingParams(ignore_eos=True, stop_token_ids=(2,))
    assert stop_reason(2, 1, p, eos_token_ids={2}) == "stop"


def test_max_tokens_ends_with_length():
    p = SamplingParams(max_tokens=3)
    assert stop_reason(9, 2, p, eos_token_ids=()) is None
    assert stop_reason(9, 3, p, eos_token_ids=()) == "length"


def test_stop_token_wins_over_length_on_the_last_token():
    p = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    assert stop_reason(9, 3, p, eos_token_ids=()) == "stop"
