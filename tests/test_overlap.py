"""Overlap scheduling (kvpool.engine.overlap): step N+1 is launched before step N's tokens
reach the host, and the outputs are the plain loop's: greedy, seeded and unseeded sampling,
stop tokens, max_tokens, n samples, preemption, logprobs, aborts (hypothesis compares the two
loops on random workloads); a sequence that stopped at step N loses the token step N+1
computed for it, and its pages come back; prefix commits hold the sampled tokens, never a
placeholder."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from depth import examples
from kvpool.engine import LLM, SamplingParams
from kvpool.engine.runner import fill_placeholders
from kvpool.engine.scheduler import placeholder

PAGE_SIZE = 4
MAX_MODEL_LEN = 64
VOCAB = 258  # the tiny preset's


def engine(overlap: bool, num_pages: int) -> LLM:
    """A small engine on the CPU, with or without overlap."""
    return LLM("tiny", num_pages=num_pages, page_size=PAGE_SIZE, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=4, max_num_batched_tokens=32, device="cpu", overlap=overlap)


@functools.cache
def shared_engine(overlap: bool, num_pages: int) -> LLM:
    """An engine per loop and pool size shared by the property test's examples (building
    one is the slow part). Both loops run every example, so the two engines keep the same
    history: an unseeded sample draws from its sequence id, counted from the first."""
    return engine(overlap, num_pages)


def _run(llm: LLM, prompts, params, aborts: dict[int, int]) -> list:
    """generate, aborting request i from on_step once its first sample has aborts[i]
    tokens; returns per request, per sample, (tokens, finish reason, logprobs), and checks
    the cache after every step and that every page came back."""
    first_id = llm._next_request_id

    def on_step(record):
        llm.check()
        for index, length in aborts.items():
            request = llm._requests.get(str(first_id + index))
            if request and request.seqs and len(request.seqs[0].output_token_ids) >= length:
                llm.abort(request.request_id)

    llm.on_step = on_step
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.on_step = None
    llm.check()
    assert llm.cache.stats().num_used_pages == 0 and not llm.has_unfinished()
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outputs]


def _assert_same_outputs(plain: list, overlapped: list) -> None:
    """Tokens and finish reasons equal; logprobs equal up to float32 rounding (a batch of
    other rows sums in another order). The later samples of an aborted request may have
    run apart from its first when preempted: theirs agree as far as both got."""
    for plain_request, overlap_request in zip(plain, overlapped, strict=True):
        for index, (a, b) in enumerate(zip(plain_request, overlap_request, strict=True)):
            if index and a[1] == b[1] == "abort":
                common = min(len(a[0]), len(b[0]))
                assert a[0][:common] == b[0][:common]
                continue
            assert a[:2] == b[:2]
            if a[2] is None or b[2] is None:
                assert a[2] is b[2]
                continue
            for x, y in zip(a[2], b[2], strict=True):
                assert x.token_id == y.token_id
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
params = st.builds(SamplingParams, max_tokens=st.integers(1, 8),
                   temperature=st.sampled_from([0.0, 1.0]), n=st.integers(1, 3),
                   seed=st.none() | st.integers(0, 2**32), ignore_eos=st.booleans(),
                   stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2).map(tuple),
                   logprobs=st.none() | st.just(2))


@settings(max_examples=examples(8), deadline=None)
@given(batch=st.lists(st.tuples(prompts, params), min_size=1, max_size=4),
       num_pages=st.sampled_from([12, 24, 64]),
       aborts=st.dictionaries(st.integers(0, 3), st.integers(1, 6), max_size=2))
def test_overlap_gives_the_plain_loops_outputs(batch, num_pages, aborts):
    prompt_list, param_list = [p for p, _ in batch], [sp for _, sp in batch]
    aborts = {i: n for i, n in aborts.items() if i < len(batch)}
    plain = _run(shared_engine(False, num_pages), prompt_list, param_list, aborts)
    overlapped = _run(shared_engine(True, num_pages), prompt_list, param_list, aborts)
    _assert_same_outputs(plain, overlapped)


def test_overlap_preempts_and_still_gives_the_plain_outputs():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % VOCAB for j in range(20)] for i in range(4)]
    llm = engine(True, 12)
    before = llm.scheduler.num_preemptions
    overlapped = _run(llm, prompts, params, {})
    assert llm.scheduler.num_preemptions > before
    _assert_same_outputs(_run(engine(False, 12), prompts, params, {}), overlapped)


def test_a_sample_that_stopped_does_not_shift_the_rows_of_the_samples_after_it():
    # A stops on its first token; the next step, launched before that was read, holds A's
    # row and the end of B's prompt, whose two samples must read B's row
    a, b = [1, 2, 3, 4, 5], list(range(100, 140))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (first,) = engine(False, 64).generate([a], greedy, use_tqdm=False)
    stop_at_once = SamplingParams(max_tokens=4, temperature=0,
                                  stop_token_ids=(first.outputs[0].token_ids[0],))
    params = [stop_at_once, SamplingParams(max_tokens=4, temperature=0, n=2)]
    plain = _run(engine(False, 64), [a, b], params, {})
    assert plain[0][0][:2] == (first.outputs[0].token_ids[:1], "stop")
    _assert_same_outputs(plain, _run(engine(True, 64), [a, b], params, {}))


def test_the_step_api_with_overlap_gives_the_plain_outputs():
    params = [SamplingParams(max_tokens=9, temperature=1.0, n=2),
              SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(3,)),
              SamplingParams(max_tokens=7, temperature=1.0, seed=11, n=3)]
    prompts = [[5, 6, 7], list(range(30, 52)), [9] * 13]
    results = []
    for overlap in (False, True):
        llm = engine(overlap, 64)
        ids, final, calls = [], {}, 0
        while len(ids) < len(prompts) or llm.has_unfinished():
            if len(ids) < len(prompts) and calls % 2 == 0:  # one request every other call
                ids.append(llm.add_request(prompts[len(ids)], params[len(ids)]))
            calls += 1
            for output in llm.step():
                if output.finished:
                    final[output.request_id] = [c.token_ids for c in output.outputs]
        results.append([final[i] for i in ids])
    assert results[0] == results[1]


def test_a_sample_that_stopped_loses_the_token_the_next_step_computed(monkeypatch):
    llm = engine(True, 64)
    prompt = [11, 12, 13, 14, 15]
    (greedy,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                      ignore_eos=True), use_tqdm=False)
    tokens = greedy.outputs[0].token_ids
    stop = tokens[2]
    first = tokens.index(stop)
    forwards = []
    run = llm.runner.run
    monkeypatch.setattr(llm.runner, "run", lambda batch, last_tokens=None: (
        forwards.append(len(batch.seqs)), run(batch, last_tokens))[1])
    llm.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop,)))
    outputs = []
    while llm.has_unfinished():
        outputs += llm.step()
    assert outputs[-1].outputs[0].token_ids == tokens[:first + 1]
    assert outputs[-1].outputs[0].finish_reason == "stop"
    # the plain loop runs first + 1 forwards; the one after the stop was launched before the
    # stop was read, and its token dropped
    assert len(forwards) == first + 2
    assert llm._in_flight is None and llm.cache.stats().num_used_pages == 0
    llm.check()


def test_an_abort_while_a_step_runs_returns_the_tokens_read_so_far():
    llm = engine(True, 64)
    request_id = llm.add_request([1, 2, 3], SamplingParams(max_tokens=10, temperature=0,
                                                           ignore_eos=True))
    seen = []
    for _ in range(4):
        seen = [o.outputs[0].token_ids for o in llm.step()] or seen
    assert llm._in_flight is not None  # the next step is launched
    output = llm.abort(request_id)
    assert output.outputs[0].token_ids == seen[-1] and output.outputs[0].finish_reason == "abort"
    assert all(t >= 0 for t in output.outputs[0].token_ids)
    assert llm.step() == [] and not llm.has_unfinished()
    assert llm.cache.stats().num_used_pages == 0
    llm.check()


@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_commits_hold_the_sampled_tokens(overlap):
    llm = engine(overlap, 64)
    prompt = [40, 41, 42]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                   ignore_eos=True), use_tqdm=False)
    follow_up = prompt + out.outputs[0].token_ids + [1]
    (again,) = llm.generate([follow_up], SamplingParams(max_tokens=1), use_tqdm=False)
    # every full page of the first run's tokens (prompt + 11 KV-written outputs) is a hit
    assert again.num_cached_tokens == (len(prompt) + 11) // PAGE_SIZE * PAGE_SIZE


def test_placeholders_take_the_previous_steps_tokens_on_the_device(device):
    input_ids = torch.tensor([5, placeholder(1), 7, placeholder(0)], device=device)
    sampled = torch.tensor([70, 80], device=device)
    fill_placeholders(input_ids, sampled)
    assert input_ids.tolist() == [5, 80, 7, 70]


def test_overlap_is_off_by_default_on_the_cpu_and_checked():
    assert engine(False, 64).overlap is False
    assert LLM("tiny", num_pages=8, device="cpu").overlap is False
    with pytest.raises(TypeError, match="overlap must be a bool or None"):
        LLM("tiny", num_pages=8, device="cpu", overlap="yes")


def test_without_overlap_a_step_returns_the_token_it_sampled():
    llm = engine(False, 64)
    request_id = llm.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0,
                                                           ignore_eos=True))
    (output,) = llm.step()
    assert output.request_id == request_id and len(output.outputs[0].token_ids) == 1
    assert llm._in_flight is None  # nothing left running behind the call


@functools.cache
def _gpu_engine_benchmark():
    """benchmarks/gpu_engine.py as a module (benchmarks/ is no package), imported once."""
    path = Path(__file__).parent.parent / "benchmarks" / "gpu_engine.py"
    spec = importlib.util.spec_from_file_location("gpu_engine_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("overlap", [False, True])
def test_the_decode_step_profile_point_runs_on_the_cpu(overlap):
    bench = _gpu_engine_benchmark()
    requests = [bench.Request(list(range(1, 20 + 3 * i)), 10) for i in range(4)]
    profile = bench.profile_decode_step("tiny", requests, device="cpu", overlap=overlap,
                                        steps=3)
    assert profile.wall_ms > 0 and profile.host_work_ms > 0
    assert profile.gpu_busy_ms == profile.host_wait_ms == profile.kernels == 0  # no device


def test_the_profile_merges_overlapping_device_intervals():
    bench = _gpu_engine_benchmark()
    assert bench.merged_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert bench.merged_us([]) == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_token_an_abort_drops_is_not_counted(overlap):
    """With overlap an aborted request's token is in flight: dropped, and not counted."""
    llm = engine(overlap, num_pages=64)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids = [llm.add_request([5 + i, 6, 7], params) for i in range(2)]
    outputs = {}
    for _ in range(4):
        outputs.update((o.request_id, o) for o in llm.step())
    outputs[ids[0]] = llm.abort(ids[0])
    while llm.has_unfinished():
        outputs.update((o.request_id, o) for o in llm.step())
    assert llm.stats().num_generated_tokens == sum(
        len(o.outputs[0].token_ids) for o in outputs.values())


def test_a_step_s_tokens_are_waited_for_on_their_own_device_s_stream(monkeypatch):
    # An engine on cuda:1 while cuda:0 is current: the event behind the copy of its tokens
    # must pass on cuda:1's stream, or the host reads the tokens before they land.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvpool.engine.overlap import HostCopy

    recorded = []

    class Event:
        def record(self, stream=None):
            recorded.append(None if stream is None else stream.device)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(
        device=torch.device("cuda", 0 if device is None else torch.device(device).index)))
    with FakeTensorMode(allow_non_fake_inputs=True):
        tokens = torch.empty(4, dtype=torch.int64, device="cuda:1")
        HostCopy(tokens, torch.ones(4, dtype=torch.bool, device="cuda:1"), None)
    assert recorded == [torch.device("cuda", 1)]


def test_an_engine_makes_its_device_current_while_it_steps(monkeypatch):
    from kvpool.engine import llm as llm_module

    devices = []

    def made_current(device):
        devices.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(llm_module, "made_current", made_current)
    llm = LLM("tiny", num_pages=32, overlap=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert devices and set(devices) == {llm._device}
