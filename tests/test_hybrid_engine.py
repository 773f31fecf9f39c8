"""The engine end to end on a small random Bamba checkpoint (Mamba2 and attention layers):
greedy outputs equal transformers' with continuous batching, chunked prefill, preemption and
forked samples; every sequence's pages and state slot come back. On the CPU, as the
transformers reference is: exact tokens from random weights are a CPU-only check (see
tests/test_bamba.py for the teacher-forced logits on every device)."""

import copy
import random

import pytest
import torch

from hybrid_util import make_bamba
from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.errors import OutOfPages
from models_util import hf_greedy, interrupt_once, save_hf_model
from test_numerics import cached_reference, file_digest

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    return make_bamba("bamba")


@pytest.fixture(scope="module")
def checkpoint(hf_model, tmp_path_factory):
    return save_hf_model(hf_model, tmp_path_factory.mktemp("bamba"))


@pytest.fixture(scope="module")
def prompts():
    """8 prompts of 1 to 40 tokens (the mixer's chunk is 8)."""
    rng = random.Random(0)
    return [[rng.randrange(160) for _ in range(n)] for n in (1, 5, 8, 13, 20, 27, 33, 40)]


def _hf_greedy(hf_model, checkpoint, prompts, device) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone on `device` (on the CPU read
    from the user's cache folder after the first time)."""
    def compute():
        model = copy.deepcopy(hf_model).to(device)
        return [hf_greedy(model, p, MAX_TOKENS) for p in prompts]

    if device.type != "cpu":
        return compute()
    return cached_reference("bamba-greedy", [file_digest(checkpoint / "model.safetensors"),
                                             file_digest(checkpoint / "config.json"),
                                             prompts, MAX_TOKENS], compute)


@pytest.fixture(scope="module")
def expected(hf_model, checkpoint, prompts, device):
    return _hf_greedy(hf_model, checkpoint, prompts, device)


def _llm(checkpoint, **options):
    return LLM(checkpoint, **{"device": "cpu", "num_pages": 128, "page_size": 4,
                              "max_num_seqs": 8, **options})


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _assert_drained(llm):
    llm.check()
    # recomputed K/V goes to the pool's reserved padding page, which no sequence holds
    assert llm.cache.sequences() == [] and llm.cache.stats().num_used_pages == 0
    assert llm.cache.states.num_free == llm.cache.states.num_slots - len(
        llm.cache.state.checkpoints)


def test_hybrid_engine_runs_on_a_hybrid_cache_with_a_slot_per_seat(checkpoint, device):
    llm = _llm(checkpoint, device=device)
    assert [group.name for group in llm.cache.groups] == ["full attention", "mamba state"]
    assert llm.cache.states.num_slots == 16  # 8 for sequences, 8 for checkpoints
    assert llm.cache.layout.num_layers == 1  # the KV pool holds the attention layer only


def test_a_tier_is_refused_with_a_clear_error(checkpoint, device):
    with pytest.raises(ValueError, match="redis_tier: .* hybrid .* takes none yet"):
        _llm(checkpoint, device=device, redis_tier="redis://127.0.0.1:1/0")


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 7, "max_num_seqs": 4},
], ids=["roomy", "chunked-7"])
def test_greedy_outputs_equal_transformers(checkpoint, prompts, expected, options, device):
    llm = _llm(checkpoint, **options, device=device)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected
    assert all(len(set(tokens)) > 4 for tokens in expected)  # varied, not a constant
    _assert_drained(llm)


def test_greedy_outputs_survive_preemption(checkpoint, prompts, expected, device):
    llm = _llm(checkpoint, num_pages=24, device=device)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    assert _tokens(outputs) == expected
    _assert_drained(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_forked_greedy_samples_each_continue_from_a_copy_of_the_state(checkpoint, prompts,
                                                                      expected, device, overlap):
    llm = _llm(checkpoint, device=device, overlap=overlap)
    params = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    (output,) = llm.generate([prompts[5]], params, use_tqdm=False)
    assert [c.token_ids for c in output.outputs] == [expected[5]] * 3
    assert llm.cache.states.stats().num_copies == 2
    _assert_drained(llm)


def test_abort_returns_the_pages_and_the_state_slot(checkpoint, prompts, device):
    llm = _llm(checkpoint, device=device)
    request_id = llm.add_request(prompts[7], GREEDY)
    llm.step()
    assert llm.cache.states.num_free == 16 - 2  # its own, and a checkpoint after 40
    llm.abort(request_id)
    _assert_drained(llm)


@pytest.fixture(scope="module")
def shared_prefix(hf_model, checkpoint, device):
    """(4 prompts sharing a 21-token prefix, transformers' greedy continuation of each)."""
    rng = random.Random(1)
    shared = [rng.randrange(160) for _ in range(21)]
    prompts = [shared + [rng.randrange(160) for _ in range(k)] for k in (1, 4, 9, 12)]
    return prompts, _hf_greedy(hf_model, checkpoint, prompts, device)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_outputs_with_prefix_hits_from_checkpoints_equal_transformers(
        checkpoint, shared_prefix, device, overlap):
    prompts, expected = shared_prefix
    # one at a time: later prompts hit the checkpoints of earlier ones
    llm = _llm(checkpoint, max_num_seqs=1, mamba_checkpoint_slots=8, device=device,
               overlap=overlap)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected
    # a checkpoint after the first prompt's 16 tokens (a multiple of 8): the later prompts,
    # which share 21 tokens with it, resume there
    assert [o.num_cached_tokens for o in outputs] == [0, 16, 16, 16]
    _assert_drained(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_outputs_with_prefix_hits_survive_preemption(checkpoint, prompts, expected, device,
                                                           overlap):
    llm = _llm(checkpoint, num_pages=24, device=device, overlap=overlap)
    twice = prompts + prompts
    outputs = llm.generate(twice, GREEDY, use_tqdm=False)
    assert llm.stats().num_preemptions > 0 and llm.cache.stats().prefix_hit_tokens > 0
    assert _tokens(outputs) == expected + expected
    _assert_drained(llm)


def test_prefix_caching_off_keeps_no_checkpoints(checkpoint, prompts, device):
    llm = _llm(checkpoint, prefix_caching=False, device=device)
    llm.generate([prompts[7], prompts[7]], GREEDY, use_tqdm=False)
    assert llm.cache.prefix_cache is None and llm.stats().prefix_hit_rate == 0
    assert llm.cache.states.num_slots == 8 and len(llm.cache.state.checkpoints) == 0


def test_planned_pool_leaves_room_for_the_state_slots(checkpoint):
    llm = LLM(checkpoint, device="cpu", kv_cache_memory=2**20, max_num_seqs=4, page_size=4,
              prefix_caching=False)
    states = llm.cache.states.nbytes
    # each pool's reserved page (and padding slot, in `states`) comes out of the budget
    assert llm.cache.num_pages == (2**20 - states) // llm.cache.layout.bytes_per_page - 1


def test_state_slots_larger_than_the_budget_are_named(checkpoint):
    with pytest.raises(OutOfPages, match=r"after state slots of "):
        LLM(checkpoint, device="cpu", kv_cache_memory=2**12, max_num_seqs=4)


def test_fp8_pages_take_the_given_scales_and_generate(checkpoint, prompts, device):
    llm = _llm(checkpoint, kv_cache_dtype="fp8_e4m3", kv_scales=(0.5, 0.25), device=device)
    assert llm.cache.layout.dtype == torch.float8_e4m3fn
    assert llm.cache.pool.scales.tolist() == [[0.5, 0.25]]
    outputs = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert [len(t) for t in _tokens(outputs)] == [MAX_TOKENS] * 3
    _assert_drained(llm)


def test_checkpoints_saved_after_decode_steps_serve_a_later_prompt(checkpoint, hf_model):
    # One-token rows' checkpoints are copied by the runner after the forward (a CUDA graph
    # replay runs no Python); a prompt that continues a generated sequence starts from one.
    llm = _llm(checkpoint)
    llm.cache.state.track_interval = 8  # checkpoints every 8 tokens of output
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    first = llm.generate([[3, 4, 5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.cache.states.stats().num_copies == 3  # decode steps ending at 8, 16, 24 tokens
    prompt = [3, 4, 5, 6, 7] + first[:11] + [1, 2]
    out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.cache.stats().prefix_hit_tokens >= 16
    assert out == hf_greedy(hf_model, prompt, 20)
    _assert_drained(llm)


def test_an_on_step_that_raises_under_overlap_leaves_the_states_right(checkpoint, prompts,
                                                                      expected, device):
    """The step launched before on_step raised is recorded: the next step does not run its
    tokens through the Mamba states again, nor checkpoint such states for later prompts."""
    llm = _llm(checkpoint, device=device, overlap=True, max_num_batched_tokens=16)
    raised = []

    def on_step(record):
        if record.step in (1, 3):
            raised.append(record.step)
            raise RuntimeError("a callback failed")
    llm.on_step = on_step
    ids = [llm.add_request(p, GREEDY) for p in prompts[3:6]]
    done = {}
    while llm.has_unfinished():
        try:
            done.update((o.request_id, o) for o in llm.step() if o.finished)
        except RuntimeError:
            llm.check()
    assert raised == [1, 3]
    assert [done[i].outputs[0].token_ids for i in ids] == expected[3:6]
    llm.on_step = None
    assert _tokens(llm.generate(prompts[3:6], GREEDY, use_tqdm=False)) == expected[3:6]
    _assert_drained(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_forward_interrupted_half_way_fails_its_requests_and_keeps_no_checkpoint_of_them(
        checkpoint, prompts, expected, device, overlap):
    """A Ctrl-C in the last Mamba layer: the layers before it have run the step's tokens
    through their state slots, so those tokens cannot be computed again. The step's requests
    fail; the same prompts later (hitting the checkpoints kept) come out right."""
    llm = _llm(checkpoint, device=device, overlap=overlap, max_num_batched_tokens=16,
               mamba_checkpoint_slots=8)
    mixer = [layer.mamba for layer in llm.model.model.layers if hasattr(layer, "mamba")][-1]
    ids = [llm.add_request(p, GREEDY) for p in prompts[4:6]]  # 20 and 27 tokens: chunked
    llm.step()
    interrupt_once(mixer, "forward")
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    llm.check()
    assert not llm.has_unfinished() and not set(ids) & set(llm._requests)
    assert _tokens(llm.generate(prompts[4:6], GREEDY, use_tqdm=False)) == expected[4:6]
    _assert_drained(llm)


def test_an_interrupt_handing_out_a_steps_tokens_fails_the_step_run_over_it_too(
        checkpoint, prompts, expected, device):
    """With overlap, the forward of the next step has run through the Mamba states of each
    of its sequences before a Ctrl-C lands while the last step's tokens are handed out: the
    requests of both steps fail (a prompt half prefilled too), and no checkpoint of those
    states is kept; the same prompts later come out right."""
    llm = _llm(checkpoint, device=device, overlap=True, max_num_batched_tokens=8)
    ids = [llm.add_request(p, GREEDY) for p in (prompts[1], prompts[4])]  # 5 and 20 tokens
    llm.step()  # launches the first prompt and the second's first 3 tokens
    interrupt_once(llm.scheduler, "postprocess")
    with pytest.raises(KeyboardInterrupt):
        llm.step()  # runs the second prompt's tokens [3, 10), then hands out the first step's
    llm.check()
    assert not llm.has_unfinished() and not set(ids) & set(llm._requests)
    outputs = llm.generate([prompts[1], prompts[4]], GREEDY, use_tqdm=False)
    assert _tokens(outputs) == [expected[1], expected[4]]
    _assert_drained(llm)


def test_checkpoint_slots_where_no_checkpoint_is_taken_are_refused_by_name(checkpoint):
    with pytest.raises(ValueError, match="mamba_checkpoint_slots=4 hold a hybrid model's "
                                         "prefix checkpoints, but prefix_caching is off"):
        _llm(checkpoint, mamba_checkpoint_slots=4, prefix_caching=False)
    with pytest.raises(ValueError, match="but LlamaForCausalLM has no Mamba layers"):
        LLM("tiny", device="cpu", num_pages=16, mamba_checkpoint_slots=4)
