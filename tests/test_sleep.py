"""LLM.sleep / wake: the KV cache's memory goes back (the weights too at level 2) and
comes again; greedy tokens after wake are a fresh engine's; a hundred cycles leak no pool;
calls in the wrong state are typed errors that change nothing."""

import gc
import random
import weakref

import pytest
import torch

from hybrid_util import make_bamba
from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.errors import EngineStateError
from models_util import make_hf_model, save_hf_model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def prompts():
    """Six prompts of 2 to 40 tokens; three share a 20-token prefix."""
    rng = random.Random(0)
    shared = [rng.randrange(160) for _ in range(20)]
    out = [[rng.randrange(160) for _ in range(rng.randint(2, 40))] for _ in range(3)]
    return out + [shared + [rng.randrange(160) for _ in range(k)] for k in (1, 7, 13)]


@pytest.fixture(scope="module")
def expected(checkpoint, prompts, device):
    return _tokens(_llm(checkpoint, device).generate(prompts, GREEDY, use_tqdm=False))


def _llm(checkpoint, device, **options):
    return LLM(checkpoint, device=device, **{"num_pages": 64, "page_size": 4, **options})


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _pool_tensors(llm):
    """Weak references to the tensors of the engine's KV pool (one per layer group)."""
    return [weakref.ref(pool.kv) for pool in llm.runner.kv.pools]


@pytest.mark.parametrize("level", [1, 2])
def test_greedy_tokens_after_wake_equal_a_fresh_engines(checkpoint, prompts, expected, device,
                                                        level):
    llm = _llm(checkpoint, device)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    pools = _pool_tensors(llm)
    llm.sleep(level)
    assert llm.sleeping and all(pool() is None for pool in pools)
    if level == 2:
        assert next(llm.model.parameters()).device.type == "cpu"
    llm.wake()
    assert next(llm.model.parameters()).device.type == device.type
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected
    # the prefix cache went with the pool: prompts seen before sleep are computed again
    assert outputs[0].num_cached_tokens == 0
    llm.check()


def test_a_hundred_sleep_wake_cycles_leak_no_pool(checkpoint, prompts, expected, device):
    llm = _llm(checkpoint, device)
    pools = []
    for _ in range(100):
        pools += _pool_tensors(llm)
        llm.sleep()
        llm.wake()
    gc.collect()
    assert [pool for pool in pools if pool() is not None] == []
    stats = llm.stats()
    assert stats.num_free_pages == llm.cache.num_pages and stats.num_used_pages == 0
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("stage", ["cache", "runner"])
def test_a_wake_that_fails_leaves_the_engine_asleep_holding_no_pool(checkpoint, prompts,
                                                                   expected, device, level,
                                                                   stage, monkeypatch):
    """The device out of memory while wake() builds the cache or captures the graphs."""
    llm = _llm(checkpoint, device)
    llm.sleep(level)
    built, make_cache = [], llm._make_cache

    def failing(*args):
        raise RuntimeError("out of memory")

    def make():
        cache = make_cache()
        built.append(weakref.ref(cache.kv_pools.pools[0].kv))
        return cache
    monkeypatch.setattr(llm, "_make_cache", failing if stage == "cache" else make)
    if stage == "runner":
        monkeypatch.setattr(llm, "_build_runner", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        llm.wake()
    gc.collect()
    assert llm.sleeping and llm.cache is None and llm.runner is None
    assert [pool for pool in built if pool() is not None] == []
    assert next(llm.model.parameters()).device.type == ("cpu" if level == 2 else device.type)
    monkeypatch.undo()
    llm.wake()
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    llm.check()


def test_sleep_with_requests_unfinished_is_refused_and_changes_nothing(checkpoint, prompts,
                                                                      expected, device):
    llm = _llm(checkpoint, device)
    request_id = llm.add_request(prompts[0], GREEDY)
    llm.step()
    with pytest.raises(EngineStateError, match="1 request.*unfinished"):
        llm.sleep()
    assert not llm.sleeping
    outputs = []
    while llm.has_unfinished():
        outputs += [o for o in llm.step() if o.finished]
    assert [(o.request_id, o.outputs[0].token_ids) for o in outputs] == [(request_id,
                                                                          expected[0])]
    llm.sleep()


def test_sleep_with_a_held_request_is_refused_and_the_request_resumes(checkpoint, prompts,
                                                                      expected, device):
    # a held request (hold_request) is unfinished though no sample of it is queued yet
    llm = _llm(checkpoint, device)
    request_id, _ = llm.hold_request(prompts[0], GREEDY)
    with pytest.raises(EngineStateError, match="1 request.*unfinished"):
        llm.sleep()
    assert not llm.sleeping
    llm.resume_request(request_id, None)
    outputs = []
    while llm.has_unfinished():
        outputs += [o for o in llm.step() if o.finished]
    assert [(o.request_id, o.outputs[0].token_ids) for o in outputs] == [(request_id,
                                                                          expected[0])]

def test_calls_in_the_wrong_state_are_typed_errors(checkpoint, prompts, device):
    llm = _llm(checkpoint, device)
    with pytest.raises(EngineStateError, match="while awake"):
        llm.wake()
    with pytest.raises(ValueError, match=r"sleep level \(1: .*must be in \[1, 2\], got 3"):
        llm.sleep(3)
    for level in (True, 2.0):  # equal to 1 and 2, yet not levels
        with pytest.raises(TypeError, match="sleep level"):
            llm.sleep(level)
    llm.sleep()
    with pytest.raises(EngineStateError, match="asleep already"):
        llm.sleep()
    for call in (lambda: llm.add_request(prompts[0], GREEDY),
                 lambda: llm.generate(prompts, GREEDY, use_tqdm=False),
                 llm.step, llm.stats, lambda: llm.takes_prefilled):
        with pytest.raises(EngineStateError, match="asleep.*wake"):
            call()
    assert llm.abort("0") is None and not llm.has_unfinished()
    llm.wake()
    assert not llm.sleeping


def test_a_tier_keeps_the_prefix_cache_through_sleep(checkpoint, prompts, expected, device):
    llm = _llm(checkpoint, device, host_tier_memory=1 << 20)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.sleep()
    llm.wake()
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected
    assert llm.stats().num_tier_loads > 0
    assert sum(o.num_cached_tokens for o in outputs) > 0


def test_a_hybrid_model_wakes_with_new_state_slots(tmp_path, device):
    folder = save_hf_model(make_bamba("bamba"), tmp_path)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8]]
    fresh = _tokens(_llm(folder, device).generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(folder, device)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    states = weakref.ref(llm.cache.states.ssm)
    llm.sleep()
    assert states() is None
    llm.wake()
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == fresh


def test_sleep_returns_the_memory_to_cuda_and_wake_captures_the_graphs_again(
        checkpoint, prompts, expected, device):
    if device.type != "cuda":
        pytest.skip("needs CUDA")
    # a pool of tens of MiB: torch's allocator gives it segments of its own (it places
    # blocks under 10 MiB in shared 20 MiB segments, which other tensors may keep reserved)
    llm = _llm(checkpoint, device, num_pages=32768)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    graphs = llm.stats().num_cuda_graphs
    pool_bytes = sum(pool.nbytes for pool in llm.runner.kv.pools)
    assert pool_bytes > 20 * 2**20
    awake = torch.cuda.memory_reserved(device)
    llm.sleep(2)
    assert torch.cuda.memory_reserved(device) <= awake - pool_bytes
    llm.wake()
    assert llm.stats().num_cuda_graphs == graphs > 0
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
