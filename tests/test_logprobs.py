"""Log-probabilities of generated tokens (SamplingParams.logprobs): the log_softmax of the
model's logits at each position, computed independently by transformers, for the sampled
token and the most likely ones, sorted; nothing is computed or returned unless asked."""

import math
import random

import pytest
import torch
import transformers

from kvpool.engine import LLM, SamplingParams, TokenLogprobs

VOCAB = 128
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def hf_model(device):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(config).eval().to(device)


@pytest.fixture(scope="module")
def llm(hf_model, tmp_path_factory, device):
    folder = tmp_path_factory.mktemp("llama")
    hf_model.save_pretrained(folder)
    return LLM(folder, num_pages=64, page_size=4, device=device)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 17, 30)]


def reference(hf_model, prompt, generated):
    """transformers' log_softmax over the vocabulary at each generated token's position."""
    ids = torch.tensor([prompt + generated[:-1]], device=hf_model.device)
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1:].float()
    return logits.log_softmax(dim=-1)


def test_greedy_logprobs_equal_transformers_log_softmax(llm, hf_model, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        sample = out.outputs[0]
        expected = reference(hf_model, prompt, sample.token_ids)
        assert len(sample.logprobs) == len(sample.token_ids) == MAX_TOKENS
        for position, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs,
                                                      strict=True)):
            top_values, top_ids = expected[position].topk(5)
            assert entry.token_id == token == top_ids[0].item()  # greedy: the most likely
            assert entry.logprob == pytest.approx(expected[position, token].item(), abs=1e-4)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_top_logprobs_are_sorted_most_likely_first(llm, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=1, ignore_eos=True, logprobs=20)
    for entry in llm.generate(prompts[1], params, use_tqdm=False)[0].outputs[0].logprobs:
        values = [v for _, v in entry.top]
        assert len(values) == 20 and values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)


def test_a_sampled_tokens_logprob_is_the_models_not_the_temperatures(llm, hf_model, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.7, seed=3, ignore_eos=True,
                            logprobs=2)
    sample = llm.generate(prompts[2], params, use_tqdm=False)[0].outputs[0]
    expected = reference(hf_model, prompts[2], sample.token_ids)
    for position, entry in enumerate(sample.logprobs):
        assert entry.token_id == sample.token_ids[position]
        assert entry.logprob == pytest.approx(
            expected[position, entry.token_id].item(), abs=1e-4)
    # at this temperature some sampled token is not the most likely one
    assert any(e.token_id != e.top[0][0] for e in sample.logprobs)


def test_logprobs_zero_gives_the_sampled_token_only(llm, prompts):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)
    entries = llm.generate(prompts[0], params, use_tqdm=False)[0].outputs[0].logprobs
    assert [e.top for e in entries] == [(), (), ()]
    assert all(math.isfinite(e.logprob) and e.logprob <= 0 for e in entries)


def test_requests_of_one_batch_each_get_the_top_logprobs_they_asked_for(llm, prompts):
    counts = [1, None, 5]
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=count)
              for count in counts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [None if o.outputs[0].logprobs is None else
            [len(e.top) for e in o.outputs[0].logprobs] for o in outputs] == [
        [1, 1, 1], None, [5, 5, 5]]


def test_without_logprobs_the_outputs_carry_none(llm, prompts):
    out = llm.generate(prompts[0], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None


def test_each_of_n_samples_has_its_own_logprobs(llm, hf_model, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, n=2, seed=5, ignore_eos=True, logprobs=1)
    out = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    for sample in out.outputs:
        expected = reference(hf_model, prompts[1], sample.token_ids)
        assert [e.token_id for e in sample.logprobs] == sample.token_ids
        assert [e.logprob for e in sample.logprobs] == pytest.approx(
            [expected[i, t].item() for i, t in enumerate(sample.token_ids)], abs=1e-4)


def test_preempted_sequences_keep_one_entry_per_token(hf_model, llm, prompts, tmp_path, device):
    hf_model.save_pretrained(tmp_path)
    # 16 pages of 4 tokens; the three sequences end at 23, 37 and 50 tokens: 29 pages
    small = LLM(tmp_path, num_pages=16, page_size=4, device=device)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight = small.generate(prompts, params, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    for a, b in zip(roomy, tight, strict=True):
        assert [e.token_id for e in b.outputs[0].logprobs] == b.outputs[0].token_ids
        assert [e.logprob for e in b.outputs[0].logprobs] == pytest.approx(
            [e.logprob for e in a.outputs[0].logprobs], abs=1e-4)


def test_the_step_api_returns_logprobs_as_tokens_come(llm, prompts):
    request_id = llm.add_request(prompts[0], SamplingParams(max_tokens=2, temperature=0,
                                                            ignore_eos=True, logprobs=1))
    counts = []
    while llm.has_unfinished():
        for out in llm.step():
            assert out.request_id == request_id
            counts.append(len(out.outputs[0].logprobs))
    assert counts == [1, 2]
    assert isinstance(out.outputs[0].logprobs[0], TokenLogprobs)


def test_samples_aborted_before_they_fork_carry_empty_logprobs_not_none(llm, prompts):
    request_id = llm.add_request(prompts[0], SamplingParams(n=2, max_tokens=2, logprobs=1))
    out = llm.abort(request_id)  # still waiting: no sample has forked
    assert [(o.token_ids, o.logprobs) for o in out.outputs] == [([], []), ([], [])]
    llm.check()


@pytest.mark.parametrize("value, error, message", [
    (21, ValueError, "logprobs must be in [0, 20], got 21"),
    (-1, ValueError, "logprobs must be in [0, 20], got -1"),
    (True, TypeError, "logprobs must be an int, got bool True"),
    (2.0, TypeError, "logprobs must be an int, got float 2.0"),
])
def test_logprobs_outside_0_to_20_are_refused(value, error, message):
    with pytest.raises(error) as info:
        SamplingParams(logprobs=value)
    assert str(info.value) == message
