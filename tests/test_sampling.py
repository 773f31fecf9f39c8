"""Sampling: SamplingParams validation, top-k/top-p filtering, greedy and seeded draws,
and the stop rules (stop tokens, EOS, ignore_eos, max_tokens)."""

import math

import pytest
import torch

from kvpool.engine.params import SamplingParams
from kvpool.engine.sampling import Sampler, apply_top_k_top_p, stop_reason

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
])
def test_sampling_params_rejects_bad_values_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"max_tokens": 2.0}, {"n": True}, {"top_p": "0.9"}])
def test_sampling_params_rejects_bad_types(kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_sampling_params_stores_stop_token_ids_as_tuple():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


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


def test_top_p_applies_to_probabilities_renormalised_after_top_k():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().tolist()
    # after top_k=2: 0.4/0.7 = 0.57 and 0.3/0.7 = 0.43; top_p 0.5 keeps only the first
    kept = _filter(logits, [2], [0.5])
    assert [x > -INF for x in kept[0]] == [True, False, False, False]


def test_filters_are_per_row():
    logits = [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]
    assert _filter(logits, [1, 0], [1.0, 1.0]) == [[-INF, -INF, 3.0], [3.0, 2.0, 1.0]]


# ---- Sampler -----------------------------------------------------------------------------

def _sampler(seed=0):
    return Sampler(torch.Generator().manual_seed(seed))


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 4.9], [0.0, 0.0, 1.0]])
    greedy = SamplingParams(temperature=0)
    assert _sampler()(logits, [greedy] * 3, [None] * 3) == [1, 0, 2]


def test_greedy_ties_take_the_first_index_like_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0]])
    assert _sampler()(logits, [SamplingParams(temperature=0)], [None]) == [1]


def test_top_k_one_sampling_is_the_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    assert _sampler()(logits, params, [None] * 8) == logits.argmax(-1).tolist()


def test_sampling_never_picks_a_filtered_token():
    logits = torch.zeros(64, 10)
    params = [SamplingParams(top_k=3)] * 64
    logits[:, [2, 5, 7]] = 1.0
    assert set(_sampler()(logits, params, [None] * 64)) <= {2, 5, 7}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(3000, 3)
    tokens = torch.tensor(_sampler()(logits, [SamplingParams()] * 3000, [None] * 3000))
    freq = torch.bincount(tokens, minlength=3) / 3000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_row_draws_the_same_whatever_the_batch():
    row = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(seed=7)
    alone = _sampler(0)(row, [p], [torch.Generator().manual_seed(7)])
    others = torch.randn(5, 100)
    batch = torch.cat([others[:3], row, others[3:]])
    params = [SamplingParams()] * 3 + [p] + [SamplingParams()] * 2
    gens = [None] * 3 + [torch.Generator().manual_seed(7)] + [None] * 2
    assert _sampler(99)(batch, params, gens)[3] == alone[0]


def test_temperature_mixes_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 1.0, 0.5]] * 2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1, top_k=1)]
    assert _sampler()(logits, params, [None, None]) == [1, 1]


# ---- stop rules --------------------------------------------------------------------------

def test_stop_token_stops():
    p = SamplingParams(stop_token_ids=(5,))
    assert stop_reason(5, 1, p, eos_token_ids=()) == "stop"
    assert stop_reason(4, 1, p, eos_token_ids=()) is None


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
