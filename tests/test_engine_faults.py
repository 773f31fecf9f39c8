"""One request never harms another: a request whose sampling fails in a step finishes with
"error" and the message, alone; the others finish with the tokens they would have had, every
later step runs, and the cache holds its invariants with no page leaked; with overlap
scheduling too."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from depth import examples
from kvpool.engine import LLM, SamplingParams
from kvpool.errors import StepFailed

VOCAB = 258  # the tiny preset's


class FailingSampler:
    """Wraps the engine's sampler: a call that samples for a poisoned request raises from
    that request's `fail_at`-th such call on (1: its first sample)."""

    def __init__(self, sampler, fail_at: dict[int, int]):
        self.sampler = sampler
        self.fail_at = fail_at  # id of a request's SamplingParams -> its failing call
        self.calls = dict.fromkeys(fail_at, 0)

    def __call__(self, logits, params, streams, positions):
        for key in {id(p) for p in params} & self.fail_at.keys():
            self.calls[key] += 1
            if self.calls[key] >= self.fail_at[key]:
                raise RuntimeError("injected failure")
        return self.sampler(logits, params, streams, positions)


@functools.cache
def engine(overlap: bool = False) -> LLM:
    """One small engine shared by the examples, with or without overlap scheduling; each
    leaves it with no request."""
    return LLM("tiny", num_pages=32, page_size=4, max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=24, device="cpu", overlap=overlap)


def run_with_failures(llm: LLM, prompts, params, fail_at: dict[int, int]) -> dict[str, object]:
    """Run the prompts through the step API with the requests of `fail_at` (index -> call)
    failing; returns each request's final output by index."""
    real = llm.sampler
    llm.sampler = FailingSampler(real, {id(params[i]): k for i, k in fail_at.items()})
    try:
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        final = {}
        while llm.has_unfinished():
            for output in llm.step():
                llm.check()
                if output.finished:
                    final[output.request_id] = output
        return {i: final[request_id] for i, request_id in enumerate(ids)}
    finally:
        llm.sampler = real


def assert_nothing_leaks(llm: LLM) -> None:
    llm.check()
    assert llm.cache.stats().num_used_pages == 0
    llm.cache.prefix_cache.clear()
    assert llm.cache.stats().num_free_pages == llm.cache.num_pages


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_sampling_fails_finishes_with_error_and_the_other_finishes(overlap):
    llm = engine(overlap)
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True) for _ in prompts]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    outputs = run_with_failures(llm, prompts, params, {0: 2})
    failed = outputs[0]
    assert isinstance(failed.error, StepFailed)
    assert str(failed.error) == (f"request {failed.request_id!r} failed while sampling: "
                                 f"RuntimeError: injected failure")
    assert failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].token_ids == expected[0][:1]
    assert outputs[1].outputs[0].token_ids == expected[1]
    assert outputs[1].outputs[0].finish_reason == "length"
    assert_nothing_leaks(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_admission_fails_finishes_with_error_and_the_others_run(overlap,
                                                                              monkeypatch):
    """A fault of one request's admission (a device fault copying its state or loading the
    KV handed over, raised every time it is tried) fails that request alone."""
    llm = engine(overlap)
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    add_sequence = llm.cache.add_sequence

    def failing_for_the_second(seq_id, token_ids=None, **options):
        if token_ids is not None and list(token_ids) == prompts[1]:
            raise RuntimeError("out of memory")
        return add_sequence(seq_id, token_ids, **options)
    monkeypatch.setattr(llm.cache, "add_sequence", failing_for_the_second)
    ids = [llm.add_request(prompt, params) for prompt in prompts]
    final = {}
    while llm.has_unfinished():
        for output in llm.step():
            llm.check()
            final[output.request_id] = output
    failed = final[ids[1]]
    assert isinstance(failed.error, StepFailed)
    assert str(failed.error) == (f"request {ids[1]!r} failed: its admission raised "
                                 f"RuntimeError: out of memory")
    assert (failed.outputs[0].finish_reason, failed.outputs[0].token_ids) == ("error", [])
    assert [final[ids[i]].outputs[0].token_ids for i in (0, 2)] == [expected[0], expected[2]]
    monkeypatch.undo()
    assert_nothing_leaks(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_steps_on_after_a_failed_request_and_serves_new_ones(overlap):
    llm = engine(overlap)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outputs = run_with_failures(llm, [[1, 2, 3]], [params], {0: 1})
    assert outputs[0].outputs[0].finish_reason == "error"
    again = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0]
    assert (len(again.token_ids), again.finish_reason) == (3, "length")
    assert_nothing_leaks(llm)


requests = st.lists(
    st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
              st.integers(1, 8), st.integers(1, 2),
              st.none() | st.integers(1, 9)),  # the sample that fails, None: never
    min_size=1, max_size=5)


@pytest.mark.parametrize("overlap", [False, True])
@settings(max_examples=examples(25), deadline=None)
@given(requests=requests)
def test_failures_injected_into_sampling_harm_no_other_request(requests, overlap):
    llm = engine(overlap)
    prompts = [prompt for prompt, *_ in requests]
    params = [SamplingParams(max_tokens=m, temperature=0.0, n=n, ignore_eos=True)
              for _, m, n, _ in requests]
    expected = llm.generate(prompts, params, use_tqdm=False)
    fail_at = {i: k for i, (*_, k) in enumerate(requests) if k is not None}
    outputs = run_with_failures(llm, prompts, params, fail_at)
    for i, output in outputs.items():
        reasons = {o.finish_reason for o in output.outputs}
        if reasons == {"error"}:
            assert i in fail_at and isinstance(output.error, StepFailed)
            continue
        assert output.error is None
        assert [o.token_ids for o in output.outputs] == \
            [o.token_ids for o in expected[i].outputs]
    assert_nothing_leaks(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_whose_forward_fails_is_run_again_with_nothing_marked_computed(overlap):
    llm = engine(overlap)
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    real, calls = llm.runner.run, []

    def run_failing_on_the_third_call(batch, last_tokens=None):
        calls.append(len(calls))
        if len(calls) == 3:
            raise RuntimeError("injected forward failure")
        return real(batch, last_tokens)

    llm.runner.run = run_failing_on_the_third_call
    try:
        ids = [llm.add_request(p, params) for p in prompts]
        final = {}
        while llm.has_unfinished():
            try:
                outputs = llm.step()
            except RuntimeError as e:
                assert str(e) == "injected forward failure"
                continue
            llm.check()
            final.update((o.request_id, o) for o in outputs if o.finished)
    finally:
        del llm.runner.run
    assert [final[i].outputs[0].token_ids for i in ids] == expected
    assert_nothing_leaks(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_logits_are_not_finite_fails_alone(overlap):
    # A NaN embedding row stands in for an overflow in the model's dtype: the request that
    # reads it fails by name instead of drawing token 0 with NaN logprobs to max_tokens.
    llm = LLM("tiny", num_pages=32, page_size=4, device="cpu", overlap=overlap)
    prompts, bad = [[5, 6, 7, 8, 9], [20, 99, 22]], 99
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    expected = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
    (embedding,) = [m for m in llm.model.modules() if isinstance(m, torch.nn.Embedding)]
    embedding.weight.data[bad] = float("nan")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    good, poisoned = outputs[0].outputs[0], outputs[1]
    assert good.token_ids == expected.token_ids and good.finish_reason == "length"
    assert isinstance(poisoned.error, StepFailed)
    assert "logits for its token at position 3 hold NaN or infinity" in str(poisoned.error)
    assert poisoned.outputs[0].finish_reason == "error"
    assert poisoned.outputs[0].token_ids == []
    assert poisoned.outputs[0].logprobs == []  # no logprobs of the token it never got
    assert_nothing_leaks(llm)


def test_a_request_aborted_while_its_step_with_non_finite_logits_ran_stays_aborted():
    # with overlap the step runs on while the host returns: the abort comes first, and the
    # NaN logits its step then finds fail nobody
    llm = LLM("tiny", num_pages=32, page_size=4, device="cpu", overlap=True)
    (embedding,) = [m for m in llm.model.modules() if isinstance(m, torch.nn.Embedding)]
    embedding.weight.data[99] = float("nan")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    request_id = llm.add_request([20, 99, 22], params)
    assert llm.step() == []  # its prefill launched, not finished
    aborted = llm.abort(request_id)
    assert aborted.outputs[0].finish_reason == "abort" and aborted.error is None
    assert llm.step() == []
    assert not llm.has_unfinished()
    assert_nothing_leaks(llm)
