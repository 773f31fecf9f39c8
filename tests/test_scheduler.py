"""Scheduler without a model: which tokens each step computes, chunked prefill, admission
with a watermark, preemption by recompute, forking of n samples, abort and refusals.
Pages hold 4 tokens; "sampling" appends token 9 to every sequence that samples."""

import random

import pytest
import torch

from kvpool.cache import HOLE, KVCache
from kvpool.engine.params import SamplingParams
from kvpool.engine.request import Request, SequenceStatus
from kvpool.engine.scheduler import Scheduler
from kvpool.errors import OutOfPages, SequenceTooLong
from kvpool.memory.layout import KVLayout

PAGE = 4


def _scheduler(num_pages=16, *, max_num_seqs=8, max_num_batched_tokens=64, watermark_pages=1,
               prefix_caching=False, max_model_len=64, window=None, reserve=0, device):
    layout = KVLayout(1, 1, 4, dtype=torch.float32, page_size=PAGE,
                      layer_windows=() if window is None else (window,))
    cache = KVCache(layout, num_pages, device=device, prefix_caching=prefix_caching,
                    max_tokens_per_step=max_num_batched_tokens,  # as the engine builds it
                    reserve=reserve)
    return Scheduler(cache, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                     watermark_pages=watermark_pages, eos_token_ids={1})


def _add(scheduler, prompt_len, request_id="r", *, start=10, **params):
    request = Request(request_id, None, list(range(start, start + prompt_len)),
                      SamplingParams(ignore_eos=True, **params))
    scheduler.check_fits(request)
    scheduler.add_request(request)
    return request


def _step(scheduler, token=9):
    """One step with a fake model; returns [(request id, sample index, start, end)]."""
    batch = scheduler.schedule()
    scheduler.check()
    work = [(s.request.request_id, s.index, a, b)
            for s, a, b in zip(batch.seqs, batch.starts, batch.ends, strict=True)]
    seqs, _ = scheduler.update(batch)
    scheduler.check()
    scheduler.add_placeholders(seqs)
    scheduler.check()
    scheduler.postprocess(seqs, [token] * len(seqs))
    scheduler.check()
    scheduler.cache.check()
    return work


def _run(scheduler, max_steps=200):
    """Step until every request finishes."""
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        _step(scheduler)
    raise AssertionError("scheduler did not finish")


def test_prompt_is_prefilled_then_decoded_one_token_per_step(device):
    s = _scheduler(device=device)
    request = _add(s, 6, max_tokens=3)
    assert _step(s) == [("r", 0, 0, 6)]
    assert _step(s) == [("r", 0, 6, 7)]
    assert _step(s) == [("r", 0, 7, 8)]
    assert request.finished and request.seqs[0].finish_reason == "length"
    assert request.seqs[0].token_ids[6:] == [9, 9, 9]
    assert s.cache.sequences() == [] and not s.has_unfinished()


def test_long_prompt_is_prefilled_in_chunks_of_the_remaining_budget(device):
    s = _scheduler(max_num_batched_tokens=8, device=device)
    _add(s, 3, "a", max_tokens=4)
    _add(s, 12, "b", max_tokens=2)
    assert _step(s) == [("a", 0, 0, 3), ("b", 0, 0, 5)]
    assert _step(s) == [("a", 0, 3, 4), ("b", 0, 5, 12)]  # decode and chunk, one batch
    assert _step(s) == [("a", 0, 4, 5), ("b", 0, 12, 13)]


def test_running_sequences_past_the_token_budget_wait_out_of_the_batch(device):
    s = _scheduler(max_num_batched_tokens=2, device=device)
    _add(s, 1, n=3, max_tokens=4)
    _step(s)  # the prompt, then three samples
    assert _step(s) == [("r", 0, 1, 2), ("r", 1, 1, 2)]


def test_the_last_token_of_a_prompt_alone_in_its_chunk_is_not_a_decode(device):
    s = _scheduler(max_num_batched_tokens=4, device=device)
    _add(s, 5, max_tokens=2)
    _step(s)
    batch = s.schedule()
    assert (batch.starts, batch.ends, batch.num_decode_tokens) == ([4], [5], 0)
    seqs, _ = s.update(batch)
    s.add_placeholders(seqs)
    s.postprocess(seqs, [9])
    assert s.schedule().num_decode_tokens == 1


def test_chunk_in_progress_does_not_sample(device):
    s = _scheduler(max_num_batched_tokens=5, device=device)
    request = _add(s, 12, max_tokens=2)
    batch = s.schedule()
    assert batch.sampled == [False]
    assert s.update(batch) == ([], [])
    assert request.seqs[0].token_ids == list(range(10, 22))


def test_waiting_requests_are_admitted_in_order_up_to_max_num_seqs(device):
    s = _scheduler(max_num_seqs=2, device=device)
    for name in "abc":
        _add(s, 2, name, max_tokens=5)
    assert [w[0] for w in _step(s)] == ["a", "b"]
    assert [seq.request.request_id for seq in s.waiting] == ["c"]


def test_request_with_n_samples_takes_n_seats_before_its_fork(device):
    s = _scheduler(max_num_seqs=4, device=device)
    _add(s, 2, "a", n=3, max_tokens=5)
    _add(s, 2, "b", n=2, max_tokens=5)
    assert [w[0] for w in _step(s)] == ["a"]
    assert [(w[0], w[1]) for w in _step(s)] == [("a", 0), ("a", 1), ("a", 2)]


def test_n_samples_fork_after_prefill_and_share_the_prompt_pages(device):
    s = _scheduler(device=device)
    request = _add(s, 6, n=3, max_tokens=4)
    _step(s)
    assert len(request.seqs) == 3
    pages = [s.cache.pages(seq.seq_id) for seq in request.seqs]
    assert pages[0] == pages[1] == pages[2] and len(pages[0]) == 2
    assert [s.cache.allocator.refcount(p) for p in pages[0]] == [3, 3]
    assert all(seq.token_ids[6:] == [9] for seq in request.seqs)
    _step(s)  # each sample writes into the shared partial page: copy-on-write
    last_pages = {s.cache.pages(seq.seq_id)[1] for seq in request.seqs}
    assert len(last_pages) == 3
    assert s.cache.allocator.refcount(pages[0][0]) == 3


def test_forked_samples_are_numbered_by_their_index(device):
    s = _scheduler(device=device)
    request = _add(s, 2, n=2, seed=5)
    _step(s)
    assert [seq.index for seq in request.seqs] == [0, 1]


def test_newest_sequence_is_preempted_to_the_front_of_the_queue(device):
    s = _scheduler(num_pages=4, watermark_pages=0, device=device)
    a = _add(s, 4, "a", max_tokens=8)
    b = _add(s, 4, "b", max_tokens=8)
    c = _add(s, 4, "c", max_tokens=8)
    _step(s)  # a, b and c prefill a page each
    _step(s)  # a takes the last free page; b needs one: c, the newest, is preempted
    assert s.num_preemptions == 1
    assert [q.request.request_id for q in s.waiting] == ["c"]
    assert c.seqs[0].status is SequenceStatus.WAITING and c.seqs[0].num_computed_tokens == 0
    assert c.seqs[0].token_ids == [10, 11, 12, 13, 9]  # its generated token is kept
    assert s.cache.sequences() == [a.seqs[0].seq_id, b.seqs[0].seq_id]
    for _ in range(4):  # a and b fill their second pages; then a needs a third
        _step(s)
    assert s.num_preemptions == 2
    assert [q.request.request_id for q in s.waiting] == ["b", "c"]
    _run(s)
    assert all(len(r.seqs[0].token_ids) == 12 for r in (a, b, c))


def test_the_newest_of_several_running_sequences_is_preempted_first(device):
    s = _scheduler(num_pages=4, watermark_pages=0, device=device)
    for name in "abcd":
        _add(s, 4, name, max_tokens=8)
    _step(s)  # four prompts fill the pool
    _step(s)  # a needs a page: d, the newest, goes; then b needs one: c goes
    assert [q.request.request_id for q in s.running] == ["a", "b"]
    assert [q.request.request_id for q in s.waiting] == ["c", "d"]


def test_a_preempted_request_keeps_what_its_first_admission_recorded(device):
    s = _scheduler(num_pages=4, watermark_pages=0, prefix_caching=True, device=device)
    _add(s, 4, "a", max_tokens=8)
    b = _add(s, 8, "b", max_tokens=8, start=100)
    _step(s)
    first = (b.num_cached_tokens, b.scheduled_time)
    for _ in range(12):
        _step(s)
        if s.num_preemptions and b.seqs[0].status is SequenceStatus.RUNNING:
            break
    # readmitted: its own committed pages are a prefix hit now
    assert s.num_preemptions == 1 and b.seqs[0].status is SequenceStatus.RUNNING
    assert (b.num_cached_tokens, b.scheduled_time) == first


def test_preempted_sequence_recomputes_its_prompt_and_outputs(device):
    s = _scheduler(num_pages=3, watermark_pages=0, device=device)
    _add(s, 4, "a", max_tokens=5)
    b = _add(s, 4, "b", max_tokens=3)
    _step(s)
    _step(s)  # a takes page 3; b then needs one and preempts itself
    assert s.num_preemptions == 1
    work = []
    while s.has_unfinished():
        work += [w for w in _step(s) if w[0] == "b"]
    assert work[0] == ("b", 0, 0, 5)  # prompt and its first output token, prefilled again
    assert b.seqs[0].token_ids == [10, 11, 12, 13, 9, 9, 9]


def test_a_sequence_whose_pending_token_is_its_last_is_not_scheduled_again(device):
    # the prompt fills the pool: one more token would need a page there is not
    s = _scheduler(num_pages=4, watermark_pages=0, device=device)
    request = _add(s, 16, max_tokens=1)
    seqs, _ = s.update(s.schedule())
    s.add_placeholders(seqs)
    assert s.schedule().seqs == []  # scheduled before the token reaches the host
    s.postprocess(seqs, [9])
    assert s.num_preemptions == 0
    assert request.finished and request.seqs[0].token_ids[16:] == [9]


def test_admission_keeps_the_watermark_while_others_run(device):
    s = _scheduler(num_pages=6, watermark_pages=2, device=device)
    _add(s, 8, "a", max_tokens=2)  # 2 pages
    _add(s, 8, "b", max_tokens=2)  # 2 more would leave 2 free: allowed
    _add(s, 5, "c", max_tokens=2)  # 2 more would leave 0 free: waits
    assert [w[0] for w in _step(s)] == ["a", "b"]
    assert [q.request.request_id for q in s.waiting] == ["c"]


def test_watermark_is_ignored_when_nothing_runs(device):
    s = _scheduler(num_pages=4, watermark_pages=2, device=device)
    _add(s, 15, max_tokens=2)
    assert _step(s) == [("r", 0, 0, 15)]


def test_prefix_cache_serves_committed_pages_of_a_shared_prompt(device):
    s = _scheduler(prefix_caching=True, device=device)
    _add(s, 10, "a", max_tokens=1)
    _run(s)
    _add(s, 11, "b", max_tokens=1)  # same first 10 tokens: two full pages are cached
    assert _step(s) == [("b", 0, 8, 11)]


def test_abort_frees_pages_at_once_and_removes_the_request_everywhere(device):
    s = _scheduler(max_num_seqs=1, device=device)
    a = _add(s, 6, "a", n=1, max_tokens=8)
    b = _add(s, 6, "b", max_tokens=8)
    _step(s)
    s.abort(a)
    s.abort(b)
    assert s.cache.sequences() == [] and s.cache.allocator.num_free == 16
    assert not s.has_unfinished()
    assert a.finished and b.finished
    assert a.seqs[0].finish_reason == b.seqs[0].finish_reason == "abort"


def test_abort_before_the_fork_finishes_the_request(device):
    s = _scheduler(device=device)
    request = _add(s, 6, n=3)
    s.abort(request)
    assert request.finished and len(request.seqs) == 1


def test_stop_token_and_eos_finish_a_sample(device):
    s = _scheduler(device=device)
    request = Request("r", None, [3, 4], SamplingParams(max_tokens=10))
    s.add_request(request)
    _step(s, token=1)  # eos
    assert request.seqs[0].finish_reason == "stop"
    assert request.seqs[0].token_ids == [3, 4, 1]


def _request(prompt_len, **params):
    return Request("r", None, [5] * prompt_len, SamplingParams(**params))


def test_request_over_max_model_len_is_refused_with_the_numbers(device):
    s = _scheduler(max_model_len=20, device=device)
    with pytest.raises(SequenceTooLong, match=r"12 tokens \+ max_tokens 9 = 21 .*max_model_len 20"):
        s.check_fits(_request(12, max_tokens=9))
    s.check_fits(_request(12, max_tokens=8))


def test_request_over_the_pool_is_refused_with_the_numbers(device):
    s = _scheduler(num_pages=4, device=device)  # 16 tokens; the last sampled token needs no slot
    s.check_fits(_request(10, max_tokens=7))
    with pytest.raises(OutOfPages, match=r"need 5 pages of 4 tokens; the pool has 4"):
        s.check_fits(_request(10, max_tokens=8))


def test_more_samples_than_max_num_seqs_are_refused(device):
    s = _scheduler(max_num_seqs=2, device=device)
    with pytest.raises(ValueError, match="n=3 samples exceed max_num_seqs 2"):
        s.check_fits(_request(1, n=3))


@pytest.mark.parametrize("seed", range(10))
def test_random_workloads_finish_without_leaking_pages(seed, device):
    rng = random.Random(seed)
    num_pages, max_num_seqs = rng.choice([6, 10, 24]), rng.choice([2, 5, 8])
    budget, watermark = rng.choice([4, 9, 64]), rng.randint(0, 2)
    caching, window = rng.random() < 0.5, rng.choice([None, 5, 8])
    if caching and window:  # room for the copies of a first drop (check_fits): 2 pages
        num_pages += 2
    s = _scheduler(num_pages=num_pages, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                   watermark_pages=watermark, prefix_caching=caching, window=window,
                   device=device)
    requests = []
    for i in range(12):
        shared = rng.random() < 0.5  # half the prompts start alike, to hit the prefix cache
        prompt_len = rng.randint(1, 14)
        request = _add(s, prompt_len, str(i), start=10 if shared else 100 + 20 * i,
                       max_tokens=rng.randint(1, 9), n=rng.choice([1, 1, 2]))
        requests.append(request)
        if rng.random() < 0.3:
            _step(s)
        if rng.random() < 0.1:
            s.abort(rng.choice(requests))
    _run(s)
    assert s.cache.stats().num_used_pages == 0
    for r in requests:
        assert r.finished
        if not r.aborted:
            assert [len(q.output_token_ids) for q in r.seqs] == [r.params.max_tokens] * r.params.n


@pytest.mark.parametrize("seed", range(8))
def test_windowed_requests_longer_than_the_pool_finish_in_the_smallest_pool_taking_any_length(
        seed, device):
    """A windowed sequence grown at most a step's budget a call holds its window, two steps'
    tokens and the copies of its first drop, however long: check_fits takes requests longer
    than the pool, and in the smallest pool that takes every length they finish, alone and
    together, prefix hits (held whole until the first drop) capped to leave that room."""
    rng = random.Random(seed)
    window, budget = rng.choice([5, 8]), rng.choice([1, 4, 9])
    caching, max_num_seqs = rng.random() < 0.5, rng.choice([2, 3])
    options = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, window=window,
                   prefix_caching=caching, reserve=rng.randint(0, 1), max_model_len=10_000,
                   device=device)
    num_pages = next(n for n in range(1, 64) if _fits(_scheduler(n, **options), 10_000))
    assert not _fits(_scheduler(num_pages - 1, **options), 10_000)
    s = _scheduler(num_pages, watermark_pages=rng.randint(0, 1), **options)
    pool_tokens, requests = num_pages * PAGE, []
    for i in range(6):
        shared = rng.random() < 0.5  # prompts alike, to hit the prefix cache
        requests.append(_add(s, rng.randint(1, 2 * pool_tokens), str(i),
                             start=10 if shared else 1_000 * (i + 1),
                             max_tokens=rng.randint(1, pool_tokens), n=rng.choice([1, 1, 2])))
        if rng.random() < 0.3:
            _step(s)
    assert any(len(r.prompt_token_ids) + r.params.max_tokens > pool_tokens for r in requests)
    _run(s, max_steps=5_000)
    assert s.cache.stats().num_used_pages == 0
    for r in requests:
        assert [len(q.output_token_ids) for q in r.seqs] == [r.params.max_tokens] * r.params.n


def _fits(scheduler, num_tokens):
    try:
        scheduler.cache.check_fits(num_tokens)
    except OutOfPages:
        return False
    return True


def test_windowed_prompt_takes_its_pages_chunk_by_chunk_and_gives_back_what_leaves_the_window(
        device):
    s = _scheduler(num_pages=16, max_num_batched_tokens=8, window=8, device=device)
    _add(s, 40, max_tokens=2)
    held = []
    while s.has_unfinished():
        _step(s)
        held += [len([p for p in s.cache.pages(seq) if p != HOLE]) for seq in s.cache.sequences()]
    # at most the window's 2 pages and the chunk's 2, where a whole prompt would hold 10
    assert held == [2, 4, 4, 4, 4]


def test_windowed_prompts_too_long_to_hold_whole_together_run_together(device):
    s = _scheduler(num_pages=12, max_num_batched_tokens=16, window=8, watermark_pages=0,
                   device=device)
    _add(s, 40, "a", max_tokens=2)
    _add(s, 40, "b", start=100, max_tokens=2)
    assert _step(s) == [("a", 0, 0, 16)]  # the budget is spent
    assert _step(s) == [("a", 0, 16, 32)]
    assert _step(s) == [("a", 0, 32, 40)] + [("b", 0, 0, 8)]
    _run(s)
    assert s.num_preemptions == 0


def test_windowed_prompt_is_committed_chunk_by_chunk_until_its_first_page_leaves_the_window(device):
    s = _scheduler(num_pages=24, max_num_batched_tokens=8, window=8, prefix_caching=True,
                   device=device)
    _add(s, 40, "a", max_tokens=1)
    _run(s)
    again = _add(s, 40, "b", max_tokens=1)
    _step(s)
    # chunks [0, 8) and [8, 16) were committed; the chunk at 16 gave back pages 0 and 1
    assert again.num_cached_tokens == 16


def test_check_names_a_sequence_out_of_step_with_its_queue_or_the_cache(device):
    s = _scheduler(device=device)
    _add(s, 6, "a", max_tokens=3)
    _add(s, 6, "b", max_tokens=3)
    _step(s)
    a = s.running[0]
    a.num_computed_tokens += 1
    with pytest.raises(AssertionError, match="running sequence 0: 7 tokens computed, 6 in the "
                                             "cache, 7 in all"):
        s.check()
    a.num_computed_tokens -= 1
    s.waiting.append(a)
    with pytest.raises(AssertionError, match=r"a sequence is queued twice: \[0, 0, 1\]"):
        s.check()
    s.waiting.pop()
    s.cache.free_sequence(a.seq_id)
    with pytest.raises(AssertionError, match=r"the cache holds sequences \[1\], the running "
                                             r"ones are \[0, 1\]"):
        s.check()
