"""The engine end to end on a small random Llama checkpoint: greedy outputs equal
transformers' whatever the pool size, prefix caching or chunking; seeded sampling; n
samples sharing pages; abort; refused requests; stats."""

import collections
import contextlib
import copy
import inspect
import itertools
import random
import re
import shutil
import sys
import threading
import time

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel

from engine_probes import raise_in_the_next_on_step
from kvpool.engine import llm as llm_module
from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.errors import InvalidPrompt, OutOfPages, SequenceTooLong, StepFailed
from kvpool.planning import planner
from models_util import interrupt_once

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def checkpoint(hf_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts():
    """16 prompts of 2 to 70 tokens; four share a 40-token prefix."""
    rng = random.Random(0)
    shared = [rng.randrange(128) for _ in range(40)]
    out = [[rng.randrange(128) for _ in range(rng.randint(2, 70))] for _ in range(12)]
    out += [shared + [rng.randrange(128) for _ in range(k)] for k in (1, 5, 16, 23)]
    rng.shuffle(out)
    return out


@pytest.fixture(scope="module")
def expected(hf_model, prompts, device):
    """transformers' greedy continuation of each prompt, run alone without padding."""
    out = []
    hf_model = copy.deepcopy(hf_model).to(device)
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
            out.append(gen[0, len(prompt):].tolist())
    return out


def _llm(checkpoint, *, device, **options):
    return LLM(checkpoint, device=device, **{"num_pages": 128, **options})


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _assert_drained(llm):
    """Every request finished: invariants hold and only prefix-cached pages remain."""
    llm.check()
    stats = llm.cache.stats()
    assert stats.num_used_pages == 0 and stats.num_sequences == 0
    assert not llm.has_unfinished()


# ---- greedy equals transformers ----------------------------------------------------------

@pytest.mark.parametrize("options", [
    {},
    {"prefix_caching": False},
    {"max_num_batched_tokens": 16, "max_num_seqs": 8},
    {"max_num_batched_tokens": 7, "max_num_seqs": 4, "page_size": 4},
], ids=["roomy", "no-prefix-caching", "chunked-16", "chunked-7"])
def test_greedy_outputs_equal_transformers(checkpoint, prompts, expected, options, device):
    llm = _llm(checkpoint, **options, device=device)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert [o.prompt_token_ids for o in outputs] == prompts
    _assert_drained(llm)


def test_token_granular_pages_give_the_greedy_outputs_of_16_token_pages(checkpoint, prompts,
                                                                         expected, device):
    outputs = {}
    for page_size in (1, 16):  # the same memory either way; later prompts hit earlier ones
        llm = _llm(checkpoint, page_size=page_size, num_pages=2048 // page_size, max_num_seqs=4,
                   device=device)
        outputs[page_size] = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        assert llm.cache.stats().prefix_hit_tokens > 0
        _assert_drained(llm)
    assert outputs[1] == outputs[16] == expected


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_outputs_survive_preemption(checkpoint, prompts, expected, prefix_caching, device):
    llm = _llm(checkpoint, num_pages=12, page_size=8, prefix_caching=prefix_caching, device=device)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    assert _tokens(outputs) == expected
    _assert_drained(llm)


def _shared_prefix_group(prompts):
    """The four prompts that share a 40-token prefix, and the others."""
    prefix = collections.Counter(tuple(p[:40]) for p in prompts).most_common(1)[0][0]
    shared = [p for p in prompts if tuple(p[:40]) == prefix]
    assert len(shared) == 4
    return shared, [p for p in prompts if tuple(p[:40]) != prefix]


def test_greedy_outputs_with_prefix_hits_equal_transformers(checkpoint, prompts, expected, device):
    llm = _llm(checkpoint, max_num_seqs=4,
               device=device)  # later prompts find earlier ones' pages cached
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.cache.stats().prefix_hit_tokens > 0
    assert _tokens(outputs) == expected
    _assert_drained(llm)


def test_prefix_cache_serves_prompts_seen_before(checkpoint, prompts, expected, device):
    _, distinct = _shared_prefix_group(prompts)
    want = [e for p, e in zip(prompts, expected, strict=True) if p in distinct]
    llm = _llm(checkpoint, device=device)
    llm.generate(distinct, GREEDY, use_tqdm=False)
    before = llm.stats()
    again = llm.generate(distinct, GREEDY, use_tqdm=False)  # their full pages are cached
    after = llm.stats()
    assert _tokens(again) == want
    assert after.prefix_hit_rate > before.prefix_hit_rate
    computed = after.num_prompt_tokens - before.num_prompt_tokens
    # only the tokens after each prompt's last full page (never its last token) are computed
    assert computed == sum(len(p) - (len(p) - 1) // 16 * 16 for p in distinct)


def test_prefix_cache_shares_a_prefix_between_requests_of_later_steps(checkpoint, prompts, device):
    shared, _ = _shared_prefix_group(prompts)
    llm = _llm(checkpoint, max_num_seqs=1, device=device)  # one request at a time
    llm.generate(shared, GREEDY, use_tqdm=False)
    # the first prompt is computed in full; the others reuse its two full pages of 16
    assert llm.cache.stats().prefix_hit_tokens == 32 * (len(shared) - 1)


# ---- sampling ----------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_alone_or_batched(checkpoint, prompts, device):
    llm = _llm(checkpoint, device=device)
    seeded = SamplingParams(max_tokens=8, seed=11, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=8, ignore_eos=True), SamplingParams(seed=3)] * 3
    batch = llm.generate(prompts[1:7] + [prompts[0]], [*others, seeded], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=8, seed=12, ignore_eos=True)
    assert llm.generate([prompts[0]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_each_token_is_sampled_with_its_own_position(checkpoint, prompts, device):
    # a row's noise is keyed by the position of the token it samples: the same position at
    # every step would draw the same noise every step
    llm = _llm(checkpoint, device=device)
    positions, sample = [], llm.sampler.__call__
    def spy(logits, params, streams, at):
        positions.append(list(at))
        return sample(logits, params, streams, at)
    llm.sampler = spy
    params = SamplingParams(max_tokens=4, seed=3, ignore_eos=True)
    llm.generate(prompts[0], params, use_tqdm=False)
    assert positions == [[len(prompts[0]) + i] for i in range(4)]


def test_n_samples_fork_after_prefill_and_share_the_prompt_pages(checkpoint, device):
    llm = _llm(checkpoint, device=device, overlap=False)  # each step returns its own tokens
    prompt = list(range(40))  # two full pages and a partial one
    request_id = llm.add_request(prompt, SamplingParams(n=4, max_tokens=6, seed=0,
                                                        ignore_eos=True))
    (output,) = llm.step()  # prefill, fork, first token of each sample
    assert [len(c.token_ids) for c in output.outputs] == [1, 1, 1, 1]
    seq_ids = llm.cache.sequences()
    tables = [llm.cache.pages(s) for s in seq_ids]
    assert len(seq_ids) == 4 and all(t == tables[0] for t in tables) and len(tables[0]) == 3
    assert [len(llm.cache.owners(p)) for p in tables[0]] == [4, 4, 4]
    # A page's count is its holders: every sample's page table lists all three pages.
    refcounts = [llm.cache.allocator.refcount(p) for p in tables[0]]
    assert refcounts == [4, 4, 4]
    while llm.has_unfinished():
        outputs = llm.step()
    (final,) = outputs
    assert final.request_id == request_id and final.finished
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    samples = [tuple(c.token_ids) for c in final.outputs]
    assert all(len(s) == 6 for s in samples) and len(set(samples)) > 1
    assert llm.stats().num_generated_tokens == 24
    _assert_drained(llm)


def test_n_greedy_samples_are_identical(checkpoint, prompts, expected, device):
    i = next(i for i, p in enumerate(prompts) if len(p) % 16)  # a partial last page
    llm = _llm(checkpoint, device=device)
    params = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    (output,) = llm.generate([prompts[i]], params, use_tqdm=False)
    assert [c.token_ids for c in output.outputs] == [expected[i]] * 3
    assert llm.cache.stats().num_cow_copies == 2  # the last sample writes in place


def test_stop_token_ends_a_sample(checkpoint, prompts, expected, device):
    llm = _llm(checkpoint, device=device)
    stop = expected[0][4]
    first = expected[0].index(stop)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=(stop,))
    (output,) = llm.generate([prompts[0]], params, use_tqdm=False)
    assert output.outputs[0].token_ids == expected[0][:first + 1]
    assert output.outputs[0].finish_reason == "stop"


# ---- step API, abort, refusals -----------------------------------------------------------

@pytest.mark.parametrize(("request_id", "error", "message"), [
    (5, TypeError, "request_id must be a str or None, got int"),
    (["a"], TypeError, "request_id must be a str or None, got list"),
    ("a", ValueError, "request id 'a' is already in use"),
])
def test_a_request_id_that_is_not_a_str_or_in_use_is_refused(checkpoint, prompts, device,
                                                             request_id, error, message):
    llm = _llm(checkpoint, device=device)
    llm.add_request(prompts[0], request_id="a")
    with pytest.raises(error, match=re.escape(message)):
        llm.add_request(prompts[1], request_id=request_id)
    assert llm.stats().num_waiting == 1
    llm.check()


def test_a_generated_request_id_skips_the_ids_callers_chose(checkpoint, prompts, device):
    llm = _llm(checkpoint, device=device)
    assert llm.add_request(prompts[0], request_id="1") == "1"
    assert [llm.add_request(prompts[i]) for i in (1, 2)] == ["0", "2"]
    llm.check()


@pytest.mark.parametrize(("options", "message"), [
    ({"sampling_params": {"max_tokens": 3}}, "sampling_params must be SamplingParams, got dict"),
    ({"cache_salt": 5}, "cache_salt must be a str or None, got int"),
])
def test_add_request_with_params_or_a_salt_of_the_wrong_type_queues_nothing(
        checkpoint, prompts, device, options, message):
    llm = _llm(checkpoint, device=device)
    with pytest.raises(TypeError, match=message):
        llm.add_request(prompts[0], **options)
    with pytest.raises(TypeError, match=message):
        llm.hold_request(prompts[0], **options)
    assert not llm.has_unfinished() and not llm._requests
    llm.check()


def test_a_fresh_engine_reports_zero_tokens_per_second(checkpoint, device):
    stats = _llm(checkpoint, device=device).stats()
    assert (stats.num_steps, stats.elapsed, stats.tokens_per_second) == (0, 0.0, 0.0)

def test_abort_frees_the_pages_at_once(checkpoint, prompts, device):
    llm = _llm(checkpoint, device=device)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    keep = llm.add_request(prompts[0], params)
    drop = llm.add_request(prompts[1], params, request_id="drop")
    llm.step()
    llm.step()
    used = llm.cache.stats().num_used_pages
    dropped_pages = -(-(len(prompts[1]) + 1) // 16)
    output = llm.abort(drop)
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert llm.cache.stats().num_used_pages == used - dropped_pages
    assert len(llm.cache.sequences()) == 1
    assert llm.abort(drop) is None  # already gone
    while llm.has_unfinished():
        finished = [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == [keep]
    _assert_drained(llm)


def test_abort_of_a_waiting_request(checkpoint, prompts, device):
    llm = _llm(checkpoint, device=device)
    request_id = llm.add_request(prompts[0], SamplingParams(n=2))
    output = llm.abort(request_id)
    assert output.finished and [c.finish_reason for c in output.outputs] == ["abort"] * 2
    assert not llm.has_unfinished()


def test_impossible_requests_get_an_error_and_the_others_complete(checkpoint, expected,
                                                                  prompts, device):
    llm = _llm(checkpoint, num_pages=8, max_model_len=200, device=device)  # 8 pages: 128 tokens
    too_long = SamplingParams(max_tokens=190, ignore_eos=True)
    too_big = SamplingParams(max_tokens=120, ignore_eos=True)
    params = [GREEDY, too_long, too_big, GREEDY]
    outputs = llm.generate([prompts[0], prompts[1], prompts[2], prompts[3]], params,
                           use_tqdm=False)
    assert _tokens(outputs[::3]) == [expected[0], expected[3]]
    assert isinstance(outputs[1].error, SequenceTooLong) and "200" in str(outputs[1].error)
    assert isinstance(outputs[2].error, OutOfPages) and "pool has 8" in str(outputs[2].error)
    for refused in outputs[1:3]:
        assert refused.finished and refused.outputs[0].finish_reason == "error"
    with pytest.raises(SequenceTooLong):
        llm.add_request(prompts[1], too_long)
    _assert_drained(llm)


def test_request_output_reports_cached_prompt_tokens_and_admission_time(checkpoint, device):
    llm = _llm(checkpoint, device=device)
    prompt = list(range(40))  # 2 full pages of 16 can be served next time
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert first.scheduled_time < second.scheduled_time


def test_a_request_never_admitted_reports_no_cached_tokens(checkpoint, prompts, device):
    llm = _llm(checkpoint, device=device, max_model_len=100)
    too_long = SamplingParams(max_tokens=150, ignore_eos=True)
    (refused,) = llm.generate([prompts[0]], too_long, use_tqdm=False)
    aborted = llm.abort(llm.add_request(prompts[0], GREEDY))
    for output in (refused, aborted):
        assert output.finished and output.num_cached_tokens == 0


def test_a_cache_salt_shares_prefix_pages_only_with_prompts_of_the_same_salt(checkpoint,
                                                                             device):
    llm = _llm(checkpoint, device=device)
    prompt = list(range(40))  # 2 full pages of 16 can be served next time

    def run(salt):
        request_id = llm.add_request(prompt, GREEDY, cache_salt=salt)
        outputs = {}
        while llm.has_unfinished():
            outputs.update((o.request_id, o) for o in llm.step())
        return outputs[request_id].num_cached_tokens

    assert [run("alice"), run("bob"), run(None), run("alice"), run("bob")] == [0, 0, 0, 32, 32]

def test_bad_prompts_raise_before_anything_runs(checkpoint, device):
    llm = _llm(checkpoint, device=device)
    with pytest.raises(InvalidPrompt, match="at least one token"):
        llm.generate([[1, 2], []], use_tqdm=False)
    with pytest.raises(InvalidPrompt, match=r"\[0, 128\)"):
        llm.generate([[1, 128]], use_tqdm=False)
    with pytest.raises(InvalidPrompt, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    for bad in (-1, True, 2.0):  # one prompt of ids with a bad one, not a batch of prompts
        with pytest.raises(InvalidPrompt, match=rf"\[0, 128\), got {bad!r}"):
            llm.generate([5, bad], use_tqdm=False)
    with pytest.raises(InvalidPrompt, match="a str or a list of token ids, got int 5"):
        llm.generate([[1, 2], 5], use_tqdm=False)
    assert not llm.has_unfinished()


def test_prompts_of_token_ids_may_be_tuples(checkpoint, prompts, expected, device):
    llm = _llm(checkpoint, device=device)
    batch = llm.generate([tuple(prompts[0]), tuple(prompts[1])], GREEDY, use_tqdm=False)
    (one,) = llm.generate(tuple(prompts[2]), GREEDY, use_tqdm=False)
    assert _tokens([*batch, one]) == expected[:3]
    assert [o.prompt_token_ids for o in (*batch, one)] == prompts[:3]


def test_a_list_of_sampling_params_of_another_length_than_the_prompts_is_refused(
        checkpoint, prompts, device):
    llm = _llm(checkpoint, device=device)
    with pytest.raises(ValueError, match="got 2 sampling_params for 3 prompts"):
        llm.generate(prompts[:3], [GREEDY, GREEDY], use_tqdm=False)
    assert not llm.has_unfinished() and llm.cache.sequences() == []

def test_step_returns_the_requests_that_advanced(checkpoint, prompts, expected, device):
    llm = _llm(checkpoint, max_num_batched_tokens=40, device=device)
    a = llm.add_request(prompts[0], GREEDY)
    b = llm.add_request(prompts[1], GREEDY)
    seen = {a: [], b: []}
    while llm.has_unfinished():
        for output in llm.step():
            seen[output.request_id].append(len(output.outputs[0].token_ids))
    assert seen[a] == seen[b] == list(range(1, MAX_TOKENS + 1))


# ---- text, options, stats ----------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
def test_each_steps_text_grows_into_the_decode_of_the_finished_tokens(device, overlap):
    # The tiny model's random weights sample bytes that are seldom valid UTF-8: characters
    # left incomplete, then completed or found invalid, with the end of EOS and stop tokens.
    llm = LLM("tiny", num_pages=64, device=device, overlap=overlap)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=2)
    request_id = llm.add_request("Hé, 世界", params)
    texts: dict[int, list[str]] = {0: [], 1: []}
    while llm.has_unfinished():
        for output in llm.step():
            for sample in output.outputs:
                texts[sample.index].append(sample.text)
    for sample in output.outputs:
        ids = sample.token_ids[:-1] if sample.finish_reason == "stop" else sample.token_ids
        assert sample.text == llm.tokenizer.decode(ids)
        for earlier, later in itertools.pairwise(texts[sample.index]):
            assert later.startswith(earlier)
    assert output.request_id == request_id and output.finished
    llm.check()

def test_tiny_model_generates_text_from_strings(device):
    llm = LLM("tiny", num_pages=32, device=device)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outputs = llm.generate(["Hello", "The pool"], params, use_tqdm=False)
    assert [o.prompt for o in outputs] == ["Hello", "The pool"]
    assert outputs[0].prompt_token_ids == [256, *b"Hello"]
    for o in outputs:
        token_ids = o.outputs[0].token_ids
        assert len(token_ids) == 5 and o.outputs[0].text == llm.tokenizer.decode(token_ids)
    (single,) = llm.generate("Hello", params, use_tqdm=False)  # one prompt alone
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    first = single.outputs[0].token_ids[0]
    stop = SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(first,))
    (stopped,) = llm.generate("Hello", stop, use_tqdm=False)
    assert stopped.outputs[0].token_ids == [first] and stopped.outputs[0].text == ""


def test_the_text_of_a_sample_reads_on_from_its_prompts_last_token(checkpoint, tmp_path,
                                                                    device):
    # A Metaspace tokenizer drops the space before a text's first word: the output's first
    # word follows the prompt's, so its space is kept, while streaming and once finished.
    shutil.copytree(checkpoint, tmp_path, dirs_exist_ok=True)
    tokenizer = Tokenizer(WordLevel({f"\u2581w{i}": i for i in range(128)}, unk_token="\u2581w0"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    llm = _llm(tmp_path, device=device)
    request_id = llm.add_request("w4 w9", GREEDY)
    (output,) = llm.step()
    assert output.request_id == request_id and not output.finished
    assert output.outputs[0].text == f" w{output.outputs[0].token_ids[0]}"
    llm.abort(request_id)
    (output,) = llm.generate("w4 w9", GREEDY, use_tqdm=False)
    assert output.outputs[0].text == "".join(f" w{t}" for t in output.outputs[0].token_ids)

def test_num_pages_is_planned_from_the_kv_cache_memory_budget(checkpoint):
    llm = LLM(checkpoint, kv_cache_memory=2**20, page_size=16, device="cpu")
    # 2 layers x K and V x 2 heads x 16 dims x 4 bytes = 512 bytes per token
    assert llm.cache.allocator.num_pages == 2**20 // (16 * 512) - 1  # and the reserved page


def host_with(monkeypatch, total: int, available: int, *, loading_takes_ram: bool) -> None:
    """Fake the host's RAM: `total` bytes, `available` of them free, less the bytes of the
    weights loaded since when `loading_takes_ram` (as reading a checkpoint into RAM does)."""
    ram = [available]
    monkeypatch.setattr(planner, "host_memory", lambda: (total, ram[0]))
    load = llm_module.load_model

    def load_model(*args, **kwargs):
        loaded = load(*args, **kwargs)
        if loading_takes_ram:
            ram[0] -= sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        return loaded

    monkeypatch.setattr(llm_module, "load_model", load_model)


def test_the_pool_does_not_shrink_because_loading_the_weights_took_ram(monkeypatch, checkpoint):
    options = dict(device="cpu", memory_fraction=1.0, kv_cache_memory=2**30)
    host_with(monkeypatch, 8 * 2**20, 8 * 2**20, loading_takes_ram=False)
    untouched = LLM(checkpoint, **options).cache.stats().num_pages
    host_with(monkeypatch, 8 * 2**20, 8 * 2**20, loading_takes_ram=True)
    assert LLM(checkpoint, **options).cache.stats().num_pages == untouched


def test_the_pool_gets_the_share_left_after_others_weights_activations_and_workspace(
        monkeypatch, checkpoint):
    host_with(monkeypatch, 10 * 2**20, 8 * 2**20, loading_takes_ram=True)
    llm = LLM(checkpoint, device="cpu", memory_fraction=0.8, kv_cache_memory=2**30)
    weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    activations = llm.model_config.estimate_activation_bytes(
        torch.float32, max_num_batched_tokens=2048, max_num_seqs=64)
    share = 8 * 2**20 - 2 * 2**20  # 80% of the total, less what others hold
    budget = share - weights - activations - llm.workspace.nbytes
    assert llm.cache.stats().num_pages == budget // (16 * 512) - 1  # and the reserved page


def test_a_budget_a_byte_short_of_a_page_and_the_reserved_one_names_the_exact_bytes(checkpoint):
    page = 16 * 512
    with pytest.raises(OutOfPages, match=rf"budget of {2 * page - 1:,} B \(16.00 KiB\) on cpu "
                                         rf"holds no page of {page:,} B \(8.00 KiB\) beside "
                                         rf"the pool's 1 reserved one, which need {2 * page:,} B"):
        LLM(checkpoint, device="cpu", kv_cache_memory=2 * page - 1)


def test_a_share_too_small_for_the_model_fails_before_loading(monkeypatch, checkpoint):
    host_with(monkeypatch, 2**20, 2**20, loading_takes_ram=True)
    monkeypatch.setattr(llm_module, "load_model", None)  # reaching it would be a TypeError
    with pytest.raises(OutOfPages, match=r"holds no page of 8,192 B \(8.00 KiB\) .*\(weights "
                                         r".* exceed 90% of 1.00 MiB"):
        LLM(checkpoint, device="cpu")


def test_options_are_validated(checkpoint, device):
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(checkpoint, max_num_seqs=0, device=device)
    with pytest.raises(ValueError, match="max_model_len 1000 exceeds"):
        LLM(checkpoint, max_model_len=1000, device=device)
    with pytest.raises(TypeError, match="unexpected keyword"):
        LLM(checkpoint, num_blocks=10, device=device)


def test_stats_and_step_records_account_for_every_page_and_token(checkpoint, prompts, device):
    records = []
    llm = LLM(checkpoint, num_pages=24, page_size=8, on_step=records.append, device=device)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_generated_tokens == MAX_TOKENS * len(prompts)
    assert stats.num_steps == len(records)
    assert stats.num_used_pages + stats.num_cached_pages + stats.num_free_pages == 24
    assert (stats.num_running, stats.num_waiting, stats.num_used_pages) == (0, 0, 0)
    assert all(r.num_used_pages + r.num_cached_pages + r.num_free_pages == 24 for r in records)
    assert max(r.num_batched_tokens for r in records) <= 2048
    prefill = sum(r.num_batched_tokens - r.num_decode_tokens for r in records)
    assert prefill == stats.num_prompt_tokens
    assert [r.step for r in records] == list(range(len(records)))
    assert records[-1].num_preemptions == stats.num_preemptions
    # the time spent in steps, and the time since the first began (the gaps between included)
    durations = sum(r.duration for r in records)
    assert stats.elapsed == pytest.approx(durations, rel=1e-9)
    assert stats.tokens_per_second == stats.num_generated_tokens / stats.elapsed
    times = [r.time for r in records]
    assert times == sorted(times) and times[-1] >= durations * (1 - 1e-9)
    # one seat: the first prompt runs, the other two wait
    records.clear()
    llm = LLM(checkpoint, num_pages=24, page_size=8, max_num_seqs=1, on_step=records.append,
              device=device)
    llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert (records[0].num_running, records[0].num_waiting) == (1, 2)
    assert (records[-1].num_running, records[-1].num_waiting) == (0, 0)


def test_stats_count_every_sample_of_a_request_and_held_requests_as_waiting(checkpoint,
                                                                            prompts, device):
    """A request of n samples is one sequence in the scheduler until its prompt is
    prefilled and the samples fork; it takes n seats all the same, and a server's admission
    counts them."""
    records = []
    llm = _llm(checkpoint, device=device, on_step=records.append)
    llm.add_request(prompts[0], SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    held, _ = llm.hold_request(prompts[1], SamplingParams(n=2, max_tokens=2))
    assert (llm.stats().num_running, llm.stats().num_waiting) == (0, 5)
    llm.step()  # the prompt prefilled and forked: three samples run
    assert (records[0].num_running, records[0].num_waiting) == (3, 2)
    llm.abort(held)
    assert (llm.stats().num_running, llm.stats().num_waiting) == (3, 0)
    while llm.has_unfinished():
        llm.step()
    llm.check()


def test_a_token_an_abort_dropped_is_not_counted_as_generated(checkpoint, prompts, device):
    # with overlap, the step launched before the abort still samples the aborted request's
    # token: the abort drops it, and the counters leave it out
    llm = _llm(checkpoint, device=device, overlap=True)
    keep = llm.add_request(prompts[0], GREEDY)
    drop = llm.add_request(prompts[1], GREEDY)
    for _ in range(3):
        llm.step()
    dropped = llm.abort(drop).outputs[0].token_ids
    outputs = {}
    while llm.has_unfinished():
        outputs.update((o.request_id, o) for o in llm.step())
    assert 0 < len(dropped) < MAX_TOKENS
    assert len(outputs[keep].outputs[0].token_ids) == MAX_TOKENS
    assert llm.stats().num_generated_tokens == MAX_TOKENS + len(dropped)


def test_stats_give_the_pools_utilization_and_the_workspace_the_steps_used(checkpoint,
                                                                           device):
    llm = _llm(checkpoint, device=device, page_size=8)
    llm.add_request(list(range(20)), GREEDY)
    llm.step()
    stats = llm.stats()
    # the prompt's 20 tokens in 3 pages of 8
    assert stats.kv_utilization == llm.cache.stats().kv_utilization == 20 / 24
    assert 0 < stats.workspace_peak_bytes < stats.workspace_bytes == llm.workspace.nbytes
    assert stats.workspace_peak_bytes == llm.workspace.peak


# ---- reliability: bad params, aborts during generate, generate's contract ------------------

def test_a_seed_past_64_bits_is_refused_when_params_are_made():
    with pytest.raises(ValueError, match=r"seed must be in \[0, 18446744073709551615\], "
                                         r"got 18446744073709551616"):
        SamplingParams(seed=2**64, n=2)
    assert SamplingParams(seed=2**64 - 1, n=2).seed == 2**64 - 1


def test_ignore_eos_must_be_a_bool():
    with pytest.raises(TypeError, match="ignore_eos must be a bool, got 'no'"):
        SamplingParams(ignore_eos="no")


def test_largest_seeds_generate_with_n_samples(checkpoint, prompts, device):
    llm = _llm(checkpoint, device=device)
    params = SamplingParams(max_tokens=3, seed=2**64 - 1, n=3, ignore_eos=True)
    (output,) = llm.generate([prompts[0]], params, use_tqdm=False)
    assert [len(c.token_ids) for c in output.outputs] == [3, 3, 3]
    _assert_drained(llm)


def test_an_int_temperature_past_int64_samples_alone_and_after_its_neighbour_finishes(
        checkpoint, prompts, device):
    """10**20 is finite in float32: accepted, it samples every token whether its batch holds
    a float temperature (until that request finishes) or not."""
    llm = _llm(checkpoint, device=device)
    hot = SamplingParams(max_tokens=6, temperature=10**20, ignore_eos=True)
    mild = SamplingParams(max_tokens=2, temperature=0.7, ignore_eos=True)
    for batch in ([hot], [hot, mild]):
        outputs = llm.generate(prompts[:len(batch)], batch, use_tqdm=False)
        assert [(o.error, len(o.outputs[0].token_ids)) for o in outputs] == [
            (None, p.max_tokens) for p in batch]
    _assert_drained(llm)


def test_generate_with_a_bad_second_request_queues_nothing(checkpoint, prompts, device):
    llm = _llm(checkpoint, max_num_seqs=2, device=device)
    with pytest.raises(ValueError, match="n=3 samples exceed max_num_seqs 2"):
        llm.generate([prompts[0], prompts[1]], [GREEDY, SamplingParams(n=3)], use_tqdm=False)
    assert not llm.has_unfinished() and llm.cache.sequences() == []


def test_generate_that_raises_mid_run_aborts_its_requests(checkpoint, prompts, expected, device):
    def interrupt(record):
        if record.step == 2:
            raise KeyboardInterrupt

    llm = _llm(checkpoint, on_step=interrupt, device=device)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts[:4], GREEDY, use_tqdm=False)
    _assert_drained(llm)
    llm.on_step = None
    assert _tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == expected[:2]


def test_the_next_step_after_a_generate_that_raised_returns_only_its_own_requests(
        checkpoint, prompts, device):
    # generate's requests were aborted as it raised: their held-back outputs are not the
    # step API's to hand out
    llm = _llm(checkpoint, on_step=_raise_keyboard_interrupt, device=device, overlap=False)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    llm.on_step = None
    request_id = llm.add_request(prompts[3], GREEDY)
    assert [o.request_id for o in llm.step()] == [request_id]


def test_generate_of_no_prompts_returns_no_outputs(checkpoint, device):
    llm = _llm(checkpoint, device=device)
    assert llm.generate([], use_tqdm=False) == []
    assert llm.stats().num_steps == 0 and not llm.has_unfinished()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("where", ["update", "sampler", "postprocess"])
def test_a_step_interrupted_half_way_fails_its_requests_and_the_engine_goes_on(
        checkpoint, prompts, expected, device, where, overlap):
    # A Ctrl-C while a step records its tokens computed, samples, or hands out its tokens:
    # its requests end with "error" and give their pages back; a request added later runs
    # as if nothing happened.
    llm = _llm(checkpoint, device=device, overlap=overlap)
    first = llm.add_request(prompts[0], GREEDY)
    llm.step()
    interrupt_once(llm if where == "sampler" else llm.scheduler, where)
    with pytest.raises(KeyboardInterrupt):
        while llm.has_unfinished():
            llm.step()
    llm.check()
    assert llm.cache.sequences() == [] and not llm.has_unfinished()
    assert first not in llm._requests
    second = llm.add_request(prompts[1], GREEDY)
    outputs = {}
    while llm.has_unfinished():
        outputs.update((o.request_id, o) for o in llm.step())
    assert _tokens([outputs[second]]) == expected[1:2]
    _assert_drained(llm)


def test_requests_an_interrupted_overlapped_step_finished_are_handed_out_by_the_next(
        checkpoint, prompts, expected, device):
    # With overlap a step finishes the last one's requests before it records its own: a
    # Ctrl-C after that fails the step's requests, and the next call hands out the finished.
    llm = _llm(checkpoint, device=device, overlap=True)
    short = llm.add_request(prompts[0], SamplingParams(max_tokens=1, temperature=0,
                                                       ignore_eos=True))
    llm.add_request(prompts[1], GREEDY)
    llm.step()  # launches both prefills; the short request's one token is still sampled
    interrupt_once(llm.scheduler, "update")
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    outputs = {o.request_id: o for o in llm.step()}
    assert outputs[short].finished and _tokens([outputs[short]]) == [expected[0][:1]]
    llm.check()
    _assert_drained(llm)


def test_a_step_interrupted_while_it_records_its_tokens_fails_its_requests_and_goes_on(
        checkpoint, prompts, expected, device):
    # A Ctrl-C after the step recorded the first of its sequences computed, while it forks
    # that one's second sample: every request of the step ends with "error", the half made
    # sample too, and the engine goes on.
    llm = _llm(checkpoint, device=device, overlap=False)
    ids = [llm.add_request(prompts[0], SamplingParams(n=2, max_tokens=MAX_TOKENS)),
           llm.add_request(prompts[1], GREEDY)]
    interrupt_once(llm.cache, "fork")
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    llm.check()
    assert llm.cache.sequences() == [] and not llm.has_unfinished()
    assert not set(ids) & set(llm._requests)
    assert _tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == expected[:2]
    _assert_drained(llm)


def _interrupt_preempting(llm):
    """Make a Ctrl-C land in the step that grows four running sequences one by one (pages
    run short): when the first, placed in no queue yet, has preempted the newest, and the
    two between are not reached yet."""
    real = llm.cache.can_append  # asked only of sequences grown one by one
    calls = []

    def can_append(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            llm.cache.can_append = real
            assert not llm.scheduler.running and len(llm.scheduler.waiting) == 1
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    llm.cache.can_append = can_append


def _preempting_llm(checkpoint, device):
    """An engine whose four short prompts outgrow its pool in one step, all four running."""
    return _llm(checkpoint, device=device, overlap=False, page_size=4, num_pages=16)


def _short_prompts(prompts):
    return sorted(prompts, key=len)[:4]


def test_a_step_interrupted_while_preempting_loses_no_sequence(checkpoint, prompts, expected,
                                                              device):
    # Each running sequence goes back where the cache holds it: running, or preempted to
    # wait first in line; every request then runs to its tokens.
    llm = _preempting_llm(checkpoint, device)
    short = _short_prompts(prompts)
    ids = [llm.add_request(prompt, GREEDY) for prompt in short]
    _interrupt_preempting(llm)
    with pytest.raises(KeyboardInterrupt):
        while llm.has_unfinished():
            llm.step()
    llm.check()
    assert sorted(llm._requests) == sorted(ids)
    outputs = {}
    while llm.has_unfinished():
        outputs.update((o.request_id, o) for o in llm.step())
    assert _tokens([outputs[i] for i in ids]) == [expected[prompts.index(p)] for p in short]
    _assert_drained(llm)


def test_generate_interrupted_while_preempting_aborts_its_requests(checkpoint, prompts,
                                                                  expected, device):
    llm = _preempting_llm(checkpoint, device)
    short = _short_prompts(prompts)
    _interrupt_preempting(llm)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(short, GREEDY, use_tqdm=False)
    _assert_drained(llm)
    assert _tokens(llm.generate(short, GREEDY, use_tqdm=False)) == [
        expected[prompts.index(p)] for p in short]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_outputs_of_a_step_whose_on_step_raised_come_with_the_next_step(
        checkpoint, prompts, expected, device, overlap):
    llm = _llm(checkpoint, device=device, overlap=overlap, on_step=_raise_keyboard_interrupt)
    request_id = llm.add_request(prompts[0], GREEDY)
    while llm.has_unfinished():
        # with overlap, the first step finishes none and calls no on_step
        with contextlib.suppress(KeyboardInterrupt):
            assert llm.step() == []
    llm.on_step = None
    outputs = {o.request_id: o for o in llm.step()}  # the last step's, held back
    assert outputs[request_id].finished
    assert _tokens([outputs[request_id]]) == expected[:1]
    _assert_drained(llm)


def test_a_request_held_back_by_a_raising_on_step_comes_once_with_the_next_steps_tokens(
        checkpoint, prompts, device):
    raised = []

    def raise_once(record):
        if not raised:
            raised.append(record.step)
            raise KeyboardInterrupt

    llm = _llm(checkpoint, device=device, overlap=False, on_step=raise_once)
    request_id = llm.add_request(prompts[0], GREEDY)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    (output,) = llm.step()  # the held-back request advanced again: one output, not two
    assert output.request_id == request_id and len(output.outputs[0].token_ids) == 2

def _raise_keyboard_interrupt(record):
    raise KeyboardInterrupt


@pytest.mark.parametrize("taken", [False, True])
def test_a_prompt_whose_admission_raises_stays_queued(checkpoint, prompts, expected, device,
                                                      taken):
    # A tier load that raises inside add_sequence, or a Ctrl-C there or just after the cache
    # took the sequence (`taken`), must not lose the request: it waits, holding nothing,
    # and runs once admission succeeds.
    llm = _llm(checkpoint, device=device, overlap=False)
    request_id = llm.add_request(prompts[0], GREEDY)
    real = llm.cache.add_sequence

    def failing(*args, **kwargs):
        llm.cache.add_sequence = real
        if taken:
            real(*args, **kwargs)
        raise KeyboardInterrupt

    llm.cache.add_sequence = failing
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    llm.check()
    assert llm.has_unfinished() and llm.cache.sequences() == []
    outputs = {}
    while llm.has_unfinished():
        outputs.update((o.request_id, o) for o in llm.step())
    assert _tokens([outputs[request_id]]) == expected[:1]
    _assert_drained(llm)


def test_request_aborted_from_on_step_while_waiting_finishes_generate(checkpoint, prompts,
                                                                      expected, device):
    llm = _llm(checkpoint, max_num_seqs=1, device=device)  # the second prompt waits for the first
    llm.on_step = lambda record: llm.abort("1") if record.step == 0 else None
    outputs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert _tokens(outputs[:1]) == expected[:1]
    assert outputs[1].finished and outputs[1].outputs[0].finish_reason == "abort"
    assert outputs[1].outputs[0].token_ids == []
    _assert_drained(llm)


def test_request_aborted_from_on_step_while_running_finishes_generate(checkpoint, prompts, device):
    llm = _llm(checkpoint, device=device)
    llm.on_step = lambda record: llm.abort("0") if record.step == 3 else None
    (output,) = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    assert output.outputs[0].finish_reason == "abort"
    assert 0 < len(output.outputs[0].token_ids) < MAX_TOKENS
    _assert_drained(llm)


def test_request_aborted_from_another_thread_finishes_generate(checkpoint, prompts, expected,
        device):
    stepped = threading.Event()
    llm = _llm(checkpoint, max_num_seqs=1, on_step=lambda record: stepped.set(), device=device)
    params = [GREEDY, SamplingParams(max_tokens=200, ignore_eos=True)]
    aborter = threading.Thread(target=lambda: stepped.wait() and llm.abort("1"))
    aborter.start()
    outputs = llm.generate(prompts[:2], params, use_tqdm=False)
    aborter.join()
    assert _tokens(outputs[:1]) == expected[:1]
    assert outputs[1].outputs[0].finish_reason == "abort"
    _assert_drained(llm)


def test_stats_from_another_thread_waits_for_the_step_in_progress(checkpoint, prompts, device):
    in_step, events = threading.Event(), []

    def on_step(record):
        in_step.set()
        time.sleep(0.2)  # the other thread asks for stats meanwhile
        events.append("step")

    llm = _llm(checkpoint, on_step=on_step, device=device)
    asker = threading.Thread(target=lambda: in_step.wait() and events.append(llm.stats()))
    asker.start()
    llm.add_request(prompts[0], GREEDY)
    llm.step()
    asker.join()
    assert events[0] == "step" and events[1].num_steps == 1


def test_a_sleep_from_another_thread_waits_for_the_step_that_checked_it_was_awake(
        checkpoint, prompts, device):
    llm = _llm(checkpoint, device=device)
    llm.add_request(prompts[0], GREEDY)
    check_awake, sleepers = llm._check_awake, []

    def checked_then_asked_to_sleep():
        check_awake()
        if not sleepers:  # the step's check: now another thread asks the engine to sleep
            sleepers.append(threading.Thread(target=lambda: llm.abort("0") and llm.sleep()))
            sleepers[0].start()
            sleepers[0].join(0.5)

    llm._check_awake = checked_then_asked_to_sleep
    assert [output.request_id for output in llm.step()] == ["0"]
    sleepers[0].join()
    assert llm.sleeping


def _in_another_thread(call):
    """Run `call` in another thread and wait for it (a hang fails the test); its result."""
    results = []
    thread = threading.Thread(target=lambda: results.append(call()), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"{call} still waits after 60 s"
    return results[0]


def _finish_from(finish, llm, request_id):
    """`llm.abort` or `llm.fail_request` of the request: its final output."""
    if finish == "abort":
        return llm.abort(request_id)
    return llm.fail_request(request_id, StepFailed("failed from another thread"))


@pytest.mark.parametrize(("finish", "reason"), [("abort", "abort"), ("fail_request", "error")])
def test_a_request_finished_from_another_thread_as_a_step_ends_comes_back_finished_once(
        checkpoint, prompts, device, finish, reason):
    # The other thread takes the engine the moment the step lets go of it: the step's
    # outputs were built before, as the step left the request (running, every sample).
    llm = _llm(checkpoint, device=device, overlap=False)  # the first step hands out its own
    request_id = llm.add_request(prompts[0], SamplingParams(max_tokens=5, n=2))
    step, finals = llm._step, []

    def step_then_finish(*args):
        outputs = step(*args)
        finals.append(_in_another_thread(lambda: _finish_from(finish, llm, request_id)))
        return outputs

    llm._step = step_then_finish
    (output,) = llm.step()
    assert not output.finished
    assert [c.finish_reason for c in output.outputs] == [None, None]
    assert finals[0].finished
    assert [c.finish_reason for c in finals[0].outputs] == [reason] * 2
    assert llm.step() == []
    _assert_drained(llm)


@pytest.mark.parametrize("finish", ["abort", "fail_request"])
def test_a_request_held_back_by_a_raising_on_step_and_finished_then_comes_back_once(
        checkpoint, prompts, device, finish):
    llm = _llm(checkpoint, device=device, overlap=False)
    request_id = llm.add_request(prompts[0], GREEDY)
    raise_in_the_next_on_step(llm)
    with pytest.raises(RuntimeError, match="injected"):
        llm.step()
    final = _in_another_thread(lambda: _finish_from(finish, llm, request_id))
    assert final.finished
    assert llm.step() == []  # abort or fail_request handed it out, not the step
    _assert_drained(llm)


def test_a_request_aborted_from_on_step_comes_back_from_abort_only(checkpoint, prompts, device):
    finals = []
    llm = _llm(checkpoint, device=device, overlap=False,
               on_step=lambda record: finals.append(llm.abort("0")))
    llm.add_request(prompts[0], GREEDY, "0")
    other = llm.add_request(prompts[1], GREEDY)
    assert [o.request_id for o in llm.step()] == [other]
    assert finals[0].finished and finals[0].outputs[0].finish_reason == "abort"


@pytest.mark.parametrize("interrupted", ["call", "step"])
def test_a_ctrl_c_anywhere_in_a_call_or_step_holds_up_no_call_or_step_after_it(
        checkpoint, prompts, device, interrupted):
    # A KeyboardInterrupt raised at each point in turn where a Ctrl-C can land in a call
    # (`stats()`) or in a step's taking its turn (before the step proper): as a function of
    # the engine, or one it calls (contextlib's, threading's), begins, and as a call of a C
    # function there returns. Before, one there could lose a count of the waiting calls or
    # leave a lock held, and every later step waited forever.
    llm = _llm(checkpoint, device=device)
    llm.add_request(prompts[0], SamplingParams(max_tokens=150, ignore_eos=True))
    if interrupted == "call":
        run, is_engine = llm.stats, lambda code: code.co_filename == llm_module.__file__
    else:
        run, is_engine = llm.step, lambda code: code is LLM._step.__code__

    def interrupted_at(point):
        """Run `run` with a KeyboardInterrupt at its `point`-th such point; whether it was
        interrupted (False: it has fewer)."""
        count = 0

        def profile(frame, kind, arg):
            nonlocal count
            begins = kind == "call" and not frame.f_code.co_flags & inspect.CO_GENERATOR
            if not (begins or kind == "c_return"):  # a generator resuming checks for none
                return
            if is_engine(frame.f_code) or frame.f_back and is_engine(frame.f_back.f_code):
                count += 1
                if count == point:
                    raise KeyboardInterrupt

        sys.setprofile(profile)
        try:
            run()
        except KeyboardInterrupt:
            return True
        finally:
            sys.setprofile(None)
        return False

    point = 1
    while interrupted_at(point):
        _in_another_thread(llm.step)
        _in_another_thread(llm.stats)
        llm.check()
        point += 1
    assert point > 1
    llm.abort("0")
    _assert_drained(llm)


def test_calls_from_two_threads_back_to_back_delay_the_steps_but_never_hold_them_off(
        checkpoint, prompts, expected, device):
    llm = _llm(checkpoint, device=device)
    done, calls = threading.Event(), [0, 0]

    def call_back_to_back(i):
        while not done.is_set():
            llm.stats()
            calls[i] += 1

    callers = [threading.Thread(target=call_back_to_back, args=(i,), daemon=True)
               for i in range(2)]
    for caller in callers:
        caller.start()
    try:
        outputs = _in_another_thread(lambda: llm.generate(prompts[:2], GREEDY, use_tqdm=False))
    finally:
        done.set()
    for caller in callers:
        caller.join(60)
        assert not caller.is_alive()
    assert _tokens(outputs) == expected[:2]
    assert all(calls)
    _assert_drained(llm)


def test_generate_refuses_while_step_api_requests_are_unfinished(checkpoint, prompts,
                                                                  expected, device):
    llm = _llm(checkpoint, device=device)
    rid = llm.add_request(prompts[0], GREEDY)
    llm.step()
    with pytest.raises(RuntimeError, match=r"1 request\(s\) of add_request are unfinished"):
        llm.generate([prompts[1]], GREEDY, use_tqdm=False)
    finished = []
    while llm.has_unfinished():
        finished += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == [rid]
    assert finished[0].outputs[0].token_ids == expected[0]
    assert _tokens(llm.generate([prompts[1]], GREEDY, use_tqdm=False)) == [expected[1]]


def test_add_request_hold_request_resume_request_and_step_are_refused_while_generate_runs(
        checkpoint, prompts, device):
    # a held request would run in generate's steps, its output handed out by nobody
    refusals = []
    meddling = (lambda: llm.add_request(prompts[1]), lambda: llm.hold_request(prompts[1]),
                lambda: llm.resume_request("0", None), lambda: llm.step())

    def meddle(record):
        for call in meddling:
            with pytest.raises(RuntimeError, match="generate") as error:
                call()
            refusals.append(str(error.value))

    llm = _llm(checkpoint, on_step=meddle, device=device)
    (output,) = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == MAX_TOKENS
    assert len(refusals) == len(meddling) * llm.stats().num_steps
    _assert_drained(llm)


def test_output_prompt_token_ids_are_the_callers_copy(checkpoint, prompts, expected, device):
    llm = _llm(checkpoint, device=device, overlap=False)  # each step returns its own tokens
    rid = llm.add_request(prompts[0], GREEDY)
    (output,) = llm.step()
    output.prompt_token_ids[:] = [0] * len(prompts[0])
    while llm.has_unfinished():
        outputs = llm.step()
    assert outputs[0].request_id == rid and outputs[0].prompt_token_ids == prompts[0]
    assert outputs[0].outputs[0].token_ids == expected[0]


def test_cuda_device_without_cuda_is_a_clear_error(checkpoint, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda' needs CUDA, and this machine has no CUDA"):
        LLM(checkpoint, device="cuda")
    with pytest.raises(ValueError, match="device 'gpu' is not a torch device"):
        LLM(checkpoint, device="gpu")


def test_engine_seed_must_fit_a_generator(checkpoint, device):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\), "
                                         r"got 18446744073709551616"):
        LLM(checkpoint, seed=2**64, device=device)
