"""Handing a prompt's KV from one engine to another in one process (what DisaggregatedLLM
does across two): the receiving engine starts past the handed tokens, writes only the pages
past its own prefix hit, and recomputes them if preempted; greedy tokens are one engine's."""

import dataclasses
import random

import pytest
import torch

from hybrid_util import make_bamba
from kvpool.engine.disaggregated import PREFILL_PARAMS
from kvpool.engine.handoff import PrefilledKV
from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.errors import EngineStateError, StepFailed
from models_util import make_hf_model, save_hf_model
from test_windows import CONFIGS as WINDOWED

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "bamba"])
def checkpoint(request, tmp_path_factory):
    """A plain model, and a hybrid whose Mamba state is handed beside its pages."""
    make = make_bamba if request.param == "bamba" else make_hf_model
    return save_hf_model(make(request.param), tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    shared = [rng.randrange(160) for _ in range(24)]
    return [shared + [rng.randrange(160) for _ in range(k)] for k in (3, 10, 17)] + [
        [rng.randrange(160) for _ in range(30)]]


@pytest.fixture(scope="module")
def prefill(checkpoint, device):
    return LLM(checkpoint, device=device, page_size=4, num_pages=128, overlap=False)


def _prefilled(prefill, prompt):
    """The KV of the prompt but its last token, computed by `prefill`."""
    request_id = prefill.add_request(prompt[:-1], PREFILL_PARAMS)
    while not any(o.request_id == request_id for o in prefill.step()):
        pass
    kv = prefill.read_prefilled(request_id)
    prefill.abort(request_id)
    assert kv.num_tokens == len(prompt) - 1
    return kv


def _run(llm):
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    llm.check()
    return done


@pytest.mark.parametrize("num_pages", [128, 16], ids=["roomy", "preempting"])
def test_handed_kv_gives_one_engines_greedy_tokens(checkpoint, prefill, prompts, device,
                                                   num_pages):
    expected = [o.outputs[0].token_ids for o in LLM(
        checkpoint, device=device, page_size=4, num_pages=128).generate(prompts, GREEDY,
                                                                        use_tqdm=False)]
    decode = LLM(checkpoint, device=device, page_size=4, num_pages=num_pages)
    # the first prompt alone first: the others then hit its shared prefix on this side
    for batch in (prompts[:1], prompts[1:]):
        ids = []
        for prompt in batch:
            request_id, token_ids = decode.hold_request(prompt, GREEDY)
            assert token_ids == prompt
            decode.resume_request(request_id, _prefilled(prefill, prompt))
            ids.append(request_id)
        done = _run(decode)
        for request_id, prompt in zip(ids, batch, strict=True):
            assert done[request_id].outputs[0].token_ids == expected[prompts.index(prompt)]
    # a hybrid's receiving side has no state checkpoints of handed tokens: no hits there
    assert (decode.stats().prefix_hit_rate > 0) != decode.runner.has_states
    assert (decode.stats().num_preemptions > 0) == (num_pages == 16)


def test_handed_kv_shorter_than_the_receivers_prefix_hit_is_set_aside(checkpoint, prefill,
                                                                      prompts, device):
    """The receiving side's own hit (a hybrid's: a checkpoint, state included) covers more
    than the KV handed: it starts past its hit, keeping its pages and state."""
    expected = [o.outputs[0].token_ids for o in LLM(
        checkpoint, device=device, page_size=4, num_pages=128).generate(prompts[:2], GREEDY,
                                                                        use_tqdm=False)]
    decode = LLM(checkpoint, device=device, page_size=4, num_pages=128)
    decode.generate(prompts[:1], GREEDY, use_tqdm=False)  # caches the shared 24 tokens
    short = _prefilled(prefill, prompts[1][:6])  # 5 tokens
    hit = decode.cache.prefix_hit(prompts[1])
    assert hit > short.num_tokens
    request_id, _ = decode.hold_request(prompts[1], GREEDY)
    decode.resume_request(request_id, short)
    done = _run(decode)
    assert done[request_id].num_cached_tokens == hit
    assert done[request_id].outputs[0].token_ids == expected[1]


def test_handed_kv_never_rewrites_the_pages_the_prefix_cache_shares(checkpoint, prefill,
                                                                    prompts, device):
    """A salted hybrid request resumes from no checkpoint (salted ones keep none) while its
    KV pages match 24 cached tokens: the handed KV goes only into the pages past them."""
    decode = LLM(checkpoint, device=device, page_size=4, num_pages=128)
    first, _ = decode.hold_request(prompts[0], GREEDY, cache_salt="s")
    decode.resume_request(first, None)
    _run(decode)
    kv = _prefilled(prefill, prompts[1])
    kv.pages[:, :, :6] = 7.0  # the 24 shared tokens' pages, as another engine rounded them
    request_id, _ = decode.hold_request(prompts[1], GREEDY, cache_salt="s")
    before = decode.cache.pool.kv.clone()
    decode.resume_request(request_id, kv)
    decode.step()  # admitted: its handed KV written
    shared = decode.cache.pages(decode._requests[request_id].seqs[0].seq_id)[:6]
    assert torch.equal(decode.cache.pool.kv[:, :, shared], before[:, :, shared])
    _run(decode)


def test_fp8_pages_are_handed_only_between_engines_of_the_same_scales(checkpoint, prompts,
                                                                      device):
    fp8 = dict(device=device, page_size=4, num_pages=128, kv_cache_dtype="fp8_e4m3",
               overlap=False)
    prompt = prompts[3]
    calibrated = _prefilled(LLM(checkpoint, **fp8), prompt)  # scales from its first prefill
    decode = LLM(checkpoint, **fp8)
    request_id, _ = decode.hold_request(prompt, GREEDY)
    with pytest.raises(ValueError, match="give both engines the same kv_scales"):
        decode.resume_request(request_id, calibrated)
    given = {**fp8, "kv_scales": (0.05, 0.04)}
    expected = LLM(checkpoint, **given).generate([prompt], GREEDY, use_tqdm=False)
    decode = LLM(checkpoint, **given)
    request_id, _ = decode.hold_request(prompt, GREEDY)
    decode.resume_request(request_id, _prefilled(LLM(checkpoint, **given), prompt))
    assert _run(decode)[request_id].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_fp8_pages_are_refused_without_their_scales_or_by_an_engine_yet_to_calibrate(
        checkpoint, prompts, device):
    """Pages handed without the scales they were written with are refused like those of
    other scales; so are pages written under scales of 1.0 by an engine whose own scales,
    still 1.0, are not calibrated yet (its first prefill would set others)."""
    fp8 = dict(device=device, page_size=4, num_pages=128, kv_cache_dtype="fp8_e4m3",
               overlap=False)
    prompt = prompts[3]
    given = {**fp8, "kv_scales": (0.05, 0.04)}
    handed = _prefilled(LLM(checkpoint, **given), prompt)
    decode = LLM(checkpoint, **given)
    request_id, _ = decode.hold_request(prompt, GREEDY)
    with pytest.raises(ValueError, match="give both engines the same kv_scales"):
        decode.resume_request(request_id, dataclasses.replace(handed, scales=None))
    ones = _prefilled(LLM(checkpoint, **fp8, kv_scales=(1.0, 1.0)), prompt)
    uncalibrated = LLM(checkpoint, **fp8)
    assert not uncalibrated.cache.pool.scales_ready
    assert torch.equal(ones.scales, uncalibrated.cache.pool.scales.cpu())
    request_id, _ = uncalibrated.hold_request(prompt, GREEDY)
    with pytest.raises(ValueError, match="give both engines the same kv_scales"):
        uncalibrated.resume_request(request_id, ones)
    uncalibrated.resume_request(request_id, None)  # still held: computed here instead
    assert len(_run(uncalibrated)[request_id].outputs[0].token_ids) == GREEDY.max_tokens


def test_a_prefill_read_between_chunks_holds_the_pages_of_its_computed_tokens(checkpoint,
                                                                              device):
    """Read before its prompt is done (chunks of 8 tokens), a prefill holds the pages of the
    tokens computed so far, not every page the prompt was given."""
    llm = LLM(checkpoint, device=device, page_size=4, num_pages=64, overlap=False,
              max_num_batched_tokens=8)
    request_id = llm.add_request(list(range(1, 41)), PREFILL_PARAMS)
    assert not llm.step()  # the first chunk: 8 of the 40 tokens
    kv = llm.read_prefilled(request_id)
    assert (kv.num_tokens, kv.num_pages) == (8, 2)
    llm.abort(request_id)
    llm.check()


def test_reading_the_prefill_of_a_request_that_is_not_running_is_a_key_error(prefill, prompts):
    held, _ = prefill.hold_request(prompts[0], PREFILL_PARAMS)
    waiting = prefill.add_request(prompts[1], PREFILL_PARAMS)
    for request_id in (held, waiting, "unknown"):
        with pytest.raises(KeyError, match=f"request {request_id!r} is not running"):
            prefill.read_prefilled(request_id)
    prefill.abort(held)
    prefill.abort(waiting)
    prefill.check()


def test_a_held_request_can_be_aborted_or_failed_and_is_resumed_once(checkpoint, prefill,
                                                                     prompts, device):
    decode = LLM(checkpoint, device=device, page_size=4, num_pages=64)
    aborted, _ = decode.hold_request(prompts[0], GREEDY)
    failed, _ = decode.hold_request(prompts[1], GREEDY)
    decode.check()
    assert decode.abort(aborted).outputs[0].finish_reason == "abort"
    output = decode.fail_request(failed, StepFailed("the other side refused it"))
    assert output.error.args == ("the other side refused it",) and output.finished
    assert decode.fail_request(failed, StepFailed("twice")) is None
    for error in (None, "boom", ValueError("not kvpool's")):
        with pytest.raises(TypeError, match="error must be a KVPoolError"):
            decode.fail_request(aborted, error)
    with pytest.raises(ValueError, match="is not held"):
        decode.resume_request(aborted, None)
    request_id, _ = decode.hold_request(prompts[2], GREEDY)
    decode.resume_request(request_id, None)  # nothing handed: computed here
    decode.check()
    with pytest.raises(ValueError, match="is not held"):
        decode.resume_request(request_id, None)
    assert len(_run(decode)[request_id].outputs[0].token_ids) == GREEDY.max_tokens


def _broken(kv: PrefilledKV, prompt_len: int) -> dict[str, tuple[PrefilledKV, str]]:
    """KV that does not fit the prompt or the pool, each with the error it gets."""
    n, pages = kv.num_tokens, kv.pages
    state = [x[..., :1] for x in kv.state] or [torch.zeros(1)]
    return {
        "whole prompt": (PrefilledKV(prompt_len, pages, kv.state),
                         f"of {prompt_len} tokens for a prompt of {prompt_len}"),
        "negative": (PrefilledKV(-1, pages, kv.state), "of -1 tokens"),
        "a float count": (PrefilledKV(float(n), pages, kv.state), rf"of {float(n)} tokens"),
        "too few pages": (PrefilledKV(n, pages[:, :, :-1], kv.state),
                          rf"of {n} tokens must be .* pages of shape"),
        "another page size": (PrefilledKV(n, pages[:, :, :, :2], kv.state),
                              "pages of shape"),
        "another dtype": (PrefilledKV(n, pages.double(), kv.state), "torch.float64"),
        "another state": (PrefilledKV(n, pages, tuple(state)), "prefilled state must be"),
        "another state dtype": (PrefilledKV(n, pages, tuple(x.double() for x in kv.state)
                                            or (torch.zeros(1).double(),)),
                                r"prefilled state must be .* got \[\(torch\.float64"),
        "not KV": ([n, pages], "must be a PrefilledKV"),
        "pages not a tensor": (PrefilledKV(n, pages.tolist(), kv.state),
                               "pages must be a torch.Tensor, got list"),
        "state not tensors": (PrefilledKV(n, pages, (None,)),
                              r"state must hold torch.Tensors, got \['NoneType'\]"),
    }


@pytest.mark.parametrize("case", ["whole prompt", "negative", "a float count", "too few pages",
                                  "another page size", "another dtype", "another state",
                                  "another state dtype", "not KV", "pages not a tensor",
                                  "state not tensors"])
def test_handed_kv_that_does_not_fit_is_refused_and_the_request_stays_held(
        checkpoint, prefill, prompts, device, case):
    decode = LLM(checkpoint, device=device, page_size=4, num_pages=64)
    prompt = prompts[3]
    kv = _prefilled(prefill, prompt)
    request_id, _ = decode.hold_request(prompt, GREEDY)
    broken, message = _broken(kv, len(prompt))[case]
    error = TypeError if "not" in case.split() else ValueError
    with pytest.raises(error, match=message):
        decode.resume_request(request_id, broken)
    decode.check()
    decode.resume_request(request_id, kv)  # still held: the right KV is taken
    assert len(_run(decode)[request_id].outputs[0].token_ids) == GREEDY.max_tokens


def test_a_cache_that_gives_pages_back_takes_no_handed_kv(tmp_path, prompts, device):
    folder = save_hf_model(make_hf_model("mistral-window-8"), tmp_path)
    windowed = LLM(folder, device=device, page_size=4, num_pages=64)
    assert not windowed.takes_prefilled
    request_id, _ = windowed.hold_request(prompts[0], GREEDY)
    kv = PrefilledKV(len(prompts[0]) - 1, torch.zeros(0))  # refused before it is read
    with pytest.raises(ValueError, match="one pool that keeps every page"):
        windowed.resume_request(request_id, kv)
    windowed.resume_request(request_id, None)  # still held: computed here instead
    assert len(_run(windowed)[request_id].outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("name", ["mistral-window-8", "gemma3"])
def test_reading_a_prefill_of_a_cache_that_may_give_pages_back_or_has_two_pools_is_refused(
        tmp_path, device, name):
    """Only a cache of one pool that keeps every page holds a prompt's KV whole: a windowed
    one gives its first pages back as the prompt goes by, Gemma 3's keeps half the layers in
    a second pool."""
    hf = make_hf_model(name, configs=WINDOWED) if name in WINDOWED else make_hf_model(name)
    folder = save_hf_model(hf, tmp_path)
    for keeps in (False, True):
        llm = LLM(folder, device=device, page_size=4, num_pages=64, overlap=False,
                  max_num_batched_tokens=8, free_out_of_window=not keeps)
        assert llm.takes_prefilled == keeps
        request_id = llm.add_request(list(range(1, 41)), PREFILL_PARAMS)
        while not llm.step():  # chunks of 8 tokens: the first pages go back meanwhile
            pass
        if keeps:
            assert llm.read_prefilled(request_id).num_tokens == 40
        else:
            with pytest.raises(EngineStateError, match=r"one pool that keeps every page.*"
                                                       r"free_out_of_window=False"):
                llm.read_prefilled(request_id)
        llm.abort(request_id)
        llm.check()


def test_reading_a_prefill_needs_an_engine_without_overlap(checkpoint, device):
    llm = LLM(checkpoint, device=device, page_size=4, num_pages=32, overlap=True)
    request_id = llm.add_request([5, 6, 7], PREFILL_PARAMS)
    llm.step()
    with pytest.raises(EngineStateError, match="overlap=False"):
        llm.read_prefilled(request_id)


def test_handed_kv_of_no_tokens_is_taken_and_the_prompt_is_computed_here(checkpoint, prefill,
                                                                        prompts, device):
    """The KV of 0 to all but the last prompt token fits: handed none (no pages, a hybrid's
    state before any token), the receiving side computes the whole prompt."""
    prompt = prompts[3]
    expected = LLM(checkpoint, device=device, page_size=4, num_pages=64).generate(
        [prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    kv = _prefilled(prefill, prompt)
    none = PrefilledKV(0, kv.pages[:, :, :0], tuple(torch.zeros_like(x) for x in kv.state))
    decode = LLM(checkpoint, device=device, page_size=4, num_pages=64)
    request_id, _ = decode.hold_request(prompt, GREEDY)
    decode.resume_request(request_id, none)
    assert _run(decode)[request_id].outputs[0].token_ids == expected
