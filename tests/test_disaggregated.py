"""DisaggregatedLLM on the CPU with gloo: a prefill process hands each prompt's KV to the
decode engine, and greedy tokens are one engine's, with prefix hits, chunked prefill on the
prefill side, preemption on the decode side and aborts in flight; a prefill side that
refuses, dies or goes silent fails its requests with a clear error, never a hang."""

import functools
import os
import random
import re
import signal
import threading

import pytest

from hybrid_util import make_bamba
from kvpool.engine import disaggregated
from kvpool.engine.config import EngineConfig
from kvpool.engine.disaggregated import DisaggregatedLLM
from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.errors import EngineDied, InvalidPrompt, OutOfPages, SequenceTooLong, StepFailed
from kvpool.server.engine_loop import ServerBusy, _Engine
from models_util import make_hf_model, phi3_longrope, save_hf_model
from net_util import (
    assert_private_while_open,
    beyond_loopback,
    gloo_default_device_beyond_loopback,
    listening_addresses,
    record_private_directories,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PAGE_SIZE = 4
# The prefill side prefills in chunks of 16 tokens and takes prompts of 100 tokens at most;
# the decode side holds 40 pages of 4 tokens, so a batch of long prompts preempts there.
PREFILL = dict(page_size=PAGE_SIZE, num_pages=128, max_num_batched_tokens=16, max_model_len=100)
DECODE = dict(page_size=PAGE_SIZE, num_pages=40, max_num_seqs=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def prompts():
    return _prompts(seed=0)


def _prompts(seed: int) -> list[list[int]]:
    """12 prompts of 1 to 70 tokens; four share a 40-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(160) for _ in range(40)]
    out = [[7]] + [[rng.randrange(160) for _ in range(rng.randint(2, 70))] for _ in range(7)]
    out += [shared + [rng.randrange(160) for _ in range(k)] for k in (1, 5, 16, 23)]
    rng.shuffle(out)
    return out


@pytest.fixture(scope="module")
def reference(checkpoint, device):
    return LLM(checkpoint, device=device, page_size=PAGE_SIZE, num_pages=256)


@pytest.fixture(scope="module")
def expected(reference, prompts):
    return _tokens(reference.generate(prompts, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def llm(checkpoint, device):
    """The pair most tests share. Its prefill side is asked for overlap scheduling, which it
    runs without: it reads each prompt's KV between two steps, which overlap would run into
    each other."""
    with DisaggregatedLLM(checkpoint, prefill={**PREFILL, "device": device, "overlap": True},
                          decode={**DECODE, "device": device}) as llm:
        yield llm
    assert llm._process.poll() is not None


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _assert_drained(llm):
    """Every request finished on both sides: no page of the decode pool held, no request
    held there for KV that will never come."""
    llm.check()
    assert llm.cache.stats().num_used_pages == 0
    assert not llm.has_unfinished()
    assert not llm.decode._requests


def test_greedy_tokens_equal_one_engine_with_chunks_and_decode_preemption(llm, reference):
    # prompts no other test sends (none of their pages is cached on the decode side, whichever
    # tests ran before), each decoding long enough that the decode side holds several at once
    # however fast the prefill side hands them over: more than its 40 pages, so it preempts
    fresh, params = _prompts(seed=5), SamplingParams(max_tokens=40, temperature=0,
                                                      ignore_eos=True)
    expected = _tokens(reference.generate(fresh, params, use_tqdm=False))
    preemptions = llm.stats().num_preemptions
    assert _tokens(llm.generate(fresh, params, use_tqdm=False)) == expected
    assert llm.stats().num_preemptions > preemptions
    _assert_drained(llm)


def test_prompts_seen_before_hit_the_prefix_caches_and_keep_their_tokens(llm, prompts,
                                                                         expected):
    llm.generate(prompts, GREEDY, use_tqdm=False)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected
    assert llm.prefill_stats().prefix_hit_rate > 0  # the prefill side keeps its cache
    # The decode side's hits, and those alone: the KV handed over is no prefix hit. A prompt
    # no other test sends hits nothing at first, then its full pages but the last token's.
    fresh = [(3 * i + 1) % 150 for i in range(30)]
    hits = [llm.generate(fresh, GREEDY, use_tqdm=False)[0].num_cached_tokens
            for _ in range(2)]
    assert hits == [0, 28]
    _assert_drained(llm)


def test_seeded_samples_equal_one_engines(llm, reference, prompts):
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=2, ignore_eos=True)
    ours = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[:4], params,
                                                                      use_tqdm=False)]
    theirs = [[c.token_ids for c in o.outputs]
              for o in reference.generate(prompts[:4], params, use_tqdm=False)]
    assert ours == theirs
    _assert_drained(llm)


def test_aborts_in_flight_free_everything_and_the_others_finish(llm, prompts, expected):
    ids = [llm.add_request(prompt, GREEDY) for prompt in prompts]
    llm.step()
    aborted = ids[::3]
    for request_id in aborted:
        output = llm.abort(request_id)
        assert output.finished and output.outputs[0].finish_reason == "abort"
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert set(done) == set(ids) - set(aborted)
    for request_id, tokens in zip(ids, expected, strict=True):
        if request_id in done:
            assert done[request_id].outputs[0].token_ids == tokens
    _assert_drained(llm)
    # KV that arrived for aborted requests was taken off the group: the next run is whole
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("first", [0, 1], ids=["as-long", "longer"])
def test_an_id_reused_after_an_abort_never_gets_the_aborted_prompts_kv(llm, prompts,
                                                                       expected, first):
    """The prefill side's KV for an aborted request may be on its way when the id is used
    again: it is dropped, never given to the new request."""
    longer = prompts[1] + prompts[2]
    llm.add_request([prompts[2], longer][first], GREEDY, request_id="a")
    assert llm._conn.poll(30)  # the prefill side's answer is on its way
    llm.abort("a")
    llm.add_request(prompts[0], GREEDY, request_id="a")
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert done["a"].outputs[0].token_ids == expected[0]
    _assert_drained(llm)


def test_a_prompt_the_prefill_side_refuses_fails_alone(llm, prompts, expected):
    too_long = list(range(120))  # over the prefill side's max_model_len of 100
    outputs = llm.generate([too_long, *prompts[:3]], GREEDY, use_tqdm=False)
    assert isinstance(outputs[0].error, StepFailed)
    assert "prefill engine" in str(outputs[0].error) and "100" in str(outputs[0].error)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert _tokens(outputs[1:]) == expected[:3]
    _assert_drained(llm)


def test_a_refusal_read_while_asking_for_stats_comes_out_of_the_step_loop(llm):
    request_id = llm.add_request(list(range(120)), GREEDY)  # over the prefill side's 100
    llm.prefill_stats()  # reads the refusal, which was sent before the answer
    outputs = []
    while llm.has_unfinished():
        outputs += llm.step()
    assert [o.request_id for o in outputs] == [request_id]
    assert isinstance(outputs[0].error, StepFailed)
    _assert_drained(llm)


def test_requests_waiting_on_the_prefill_side_count_as_waiting_for_the_servers_limit(
        llm, prompts):
    """The server admits a request unless more than max_waiting sequences would wait for a
    seat: those on the prefill side wait too."""
    engine = _Engine(llm, max_waiting=1, events=None)
    longer = [prompt for prompt in prompts if len(prompt) > 1]
    for i in range(9):  # 8 seats (max_num_seqs) and 1 more waiting
        engine._add(f"w{i}", longer[i], GREEDY, None)
    assert llm.stats().num_waiting == 9  # no step yet: all on the prefill side
    with pytest.raises(ServerBusy, match="9 sequences wait already"):
        engine._add("w9", longer[9], GREEDY, None)
    while llm.has_unfinished():
        llm.step()
    _assert_drained(llm)


def test_generate_takes_one_prompt_of_token_ids_as_one_request(llm, prompts, expected):
    i = next(i for i, prompt in enumerate(prompts) if len(prompt) > 1)
    assert _tokens(llm.generate(prompts[i], GREEDY, use_tqdm=False)) == [expected[i]]
    _assert_drained(llm)


def test_generate_refuses_to_run_beside_unfinished_step_api_requests(llm, prompts, expected):
    request_id = llm.add_request(prompts[1], GREEDY)
    with pytest.raises(RuntimeError, match=r"generate\(\) serves only its own requests"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert list(done) == [request_id]
    assert done[request_id].outputs[0].token_ids == expected[1]
    _assert_drained(llm)


def test_generate_gives_a_prompt_the_decode_side_could_never_hold_its_error(llm, prompts,
                                                                           expected):
    too_long = [i % 150 + 1 for i in range(300)]  # over the decode side's max_model_len of 256
    too_big = too_long[:200]  # within it, over its 40 pages
    outputs = llm.generate([too_long, too_big, *prompts[:2]], GREEDY, use_tqdm=False)
    assert isinstance(outputs[0].error, SequenceTooLong)
    assert isinstance(outputs[1].error, OutOfPages)
    assert [o.outputs[0].finish_reason for o in outputs[:2]] == ["error", "error"]
    assert _tokens(outputs[2:]) == expected[:2]
    _assert_drained(llm)


def test_generate_that_raises_aborts_the_requests_it_added_first(llm, prompts):
    """Its first two prompts went to the prefill side before the third raised."""
    with pytest.raises(InvalidPrompt, match="at least one token"):
        llm.generate([prompts[1], prompts[2], []], GREEDY, use_tqdm=False)
    assert not llm.has_unfinished() and llm.stats().num_waiting == 0
    _assert_drained(llm)


def test_an_abort_of_a_request_on_the_prefill_side_ends_it_there_at_once(llm, prompts,
                                                                        expected):
    i = next(i for i, prompt in enumerate(prompts) if len(prompt) > 1)
    request_id = llm.add_request(prompts[i], GREEDY)
    assert llm.stats().num_waiting == 1
    assert llm.abort(request_id).outputs[0].finish_reason == "abort"
    assert not llm.has_unfinished() and llm.stats().num_waiting == 0
    # its KV, on its way, is dropped: the next run is whole
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    _assert_drained(llm)


def _fresh_prompt(seed: int, length: int) -> list[int]:
    """A prompt no other test sends: none of its pages is cached on either side."""
    rng = random.Random(seed)
    return [rng.randrange(160) for _ in range(length)]


def test_an_abort_reaches_the_prefill_side_before_it_computes_the_prompt(llm, monkeypatch):
    """A prompt aborted before the prefill side read it is never prefilled there: the side
    computes only the prompt added after it."""
    aborted, kept = _fresh_prompt(13, 61), _fresh_prompt(14, 9)
    before = llm.prefill_stats().num_prompt_tokens
    sent, send_bytes = threading.Semaphore(0), llm._conn.send_bytes
    monkeypatch.setattr(llm._conn, "send_bytes",
                        lambda message: send_bytes(message) or sent.release())
    os.kill(llm._process.pid, signal.SIGSTOP)
    try:  # both commands wait in the pipe: the prefill side reads them before a step
        llm.abort(llm.add_request(aborted, GREEDY))
        for command in ("add", "abort"):  # written by the writer thread, whenever it runs
            assert sent.acquire(timeout=30), f"the {command} was not sent in 30 s"
    finally:
        os.kill(llm._process.pid, signal.SIGCONT)
    llm.generate(kept, GREEDY, use_tqdm=False)  # prefilled after the aborted one would be
    assert llm.prefill_stats().num_prompt_tokens - before == len(kept) - 1
    _assert_drained(llm)


def test_prefill_stats_are_asked_for_anew_at_each_call(llm):
    before = llm.prefill_stats()
    llm.generate(_fresh_prompt(11, 21), GREEDY, use_tqdm=False)
    after = llm.prefill_stats()
    assert after.num_prompt_tokens == before.num_prompt_tokens + 20
    assert after.num_steps > before.num_steps


def test_the_prefill_side_shares_cached_pages_only_between_prompts_of_one_cache_salt(llm):
    """The salt goes with the prompt to the prefill side: another salt's prompt computes
    every token there again, the same salt's hits the pages the first one left."""
    prompt = _fresh_prompt(12, 33)  # 32 tokens prefilled: 8 full pages
    computed = []
    for salt in ("a", "b", "a"):
        before = llm.prefill_stats().num_prompt_tokens
        llm.add_request(prompt, GREEDY, cache_salt=salt)
        while llm.has_unfinished():
            llm.step()
        computed.append(llm.prefill_stats().num_prompt_tokens - before)
    assert computed[:2] == [32, 32] and computed[2] < 32
    _assert_drained(llm)


@pytest.fixture
def lone_llm(checkpoint):
    """A pair of its own, to kill or stop; a short timeout."""
    llm = DisaggregatedLLM(checkpoint, prefill={**PREFILL, "device": "cpu"},
                           decode={**DECODE, "device": "cpu"}, timeout=3.0)
    yield llm
    llm.close()
    assert llm._process.poll() is not None


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_dead_or_silent_prefill_side_fails_its_requests_then_refuses_new_ones(
        lone_llm, prompts, how):
    if how == "stopped":  # the silence it waits out, short now that the pair has started
        lone_llm.timeout = 0.2
    os.kill(lone_llm._process.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    outputs = lone_llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    for output in outputs:
        if len(output.prompt_token_ids) > 1:  # a one-token prompt never needs the other side
            assert isinstance(output.error, EngineDied)
            assert "prefill engine is gone" in str(output.error)
    for call in (lambda: lone_llm.add_request(prompts[0], GREEDY), lone_llm.prefill_stats):
        with pytest.raises(EngineDied, match="prefill engine is gone"):
            call()
    _assert_drained(lone_llm)


def test_a_burst_of_requests_before_a_step_never_waits_on_the_pipes(lone_llm, capfd):
    """The prefill side's messages are read only in step(), and it reads no command while its
    own pipe is full: here of the refusals of 1000 prompts too long for it (some 740 filled
    both pipes). Adding waits for neither; stepping then gets every refusal, and after a
    second burst, closing ends the prefill side quietly, though it waits to send."""
    too_long = list(range(120))
    for then in ("step", "close"):  # stepping leaves the pair as it was: one pair for both
        adding = threading.Thread(
            target=lambda: [lone_llm.add_request(too_long, GREEDY) for _ in range(1000)],
            daemon=True)
        adding.start()
        adding.join(10)
        hung = adding.is_alive()
        if hung:  # a send blocked on the pipe fails once the prefill process is gone
            lone_llm._process.kill()
            adding.join()
        assert not hung, f"add_request waited on a full pipe (then {then})"
        if then == "close":
            lone_llm.close()
            assert lone_llm._process.returncode == 0
            assert "Traceback" not in capfd.readouterr().err
        outputs = []
        while lone_llm.has_unfinished():
            outputs += lone_llm.step()
        assert len(outputs) == 1000
        assert all(isinstance(o.error, StepFailed if then == "step" else EngineDied)
                   for o in outputs)
        _assert_drained(lone_llm)


# Loaded first by the prefill process when its path holds it: the header of a prompt's KV is
# sent, then the process dies before sending the pages.
DIE_AFTER_A_HEADER = """
import os
import kvpool.engine.disaggregated as disaggregated

def _send_kv(llm, group, conn, request_id):
    kv = llm.read_prefilled(request_id)
    conn.send(("kv", request_id, kv.num_tokens,
               [(tuple(x.shape), str(x.dtype)) for x in kv.tensors], None))
    os._exit(3)

disaggregated._send_kv = _send_kv
"""


def test_a_prefill_side_dying_mid_transfer_fails_the_request_being_received(
        checkpoint, prompts, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(DIE_AFTER_A_HEADER)
    monkeypatch.syspath_prepend(tmp_path)  # the prefill process's path is this one
    with DisaggregatedLLM(checkpoint, prefill={**PREFILL, "device": "cpu"},
                          decode={**DECODE, "device": "cpu"}, timeout=3.0) as llm:
        outputs = llm.generate(prompts[:4], GREEDY, use_tqdm=False)
        for output in outputs:
            if len(output.prompt_token_ids) > 1:
                assert isinstance(output.error, EngineDied)
                assert "prefill engine is gone" in str(output.error)
        _assert_drained(llm)


# Loaded first by the prefill process when its path holds it: the first prompts' pages it
# hands over are of another dtype than the decode side's pool; sending the KV of the prompt
# after them raises.
HAND_OTHER_PAGES_THEN_RAISE = """
import kvpool.engine.disaggregated as disaggregated
import kvpool.engine.llm

read_prefilled = kvpool.engine.llm.LLM.read_prefilled
send_kv = disaggregated._send_kv
sent = []

def read_double(llm, request_id):
    kv = read_prefilled(llm, request_id)
    kv.pages = kv.pages.double()
    return kv

def _send_kv(llm, group, conn, request_id):
    sent.append(request_id)
    if len(sent) > 3:
        raise ZeroDivisionError("no KV today")
    return send_kv(llm, group, conn, request_id)

kvpool.engine.llm.LLM.read_prefilled = read_double
disaggregated._send_kv = _send_kv
"""


def test_kv_the_decode_side_refuses_fails_its_request_alone_and_a_raise_fails_the_side(
        checkpoint, prompts, device, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(HAND_OTHER_PAGES_THEN_RAISE)
    monkeypatch.syspath_prepend(tmp_path)  # the prefill process's path is this one
    handed = [i for i, prompt in enumerate(prompts) if len(prompt) > 1][:3]
    with DisaggregatedLLM(checkpoint, prefill={**PREFILL, "device": device},
                          decode={**DECODE, "device": device}) as llm:
        for i in handed:  # one at a time: the three KV handoffs the prefill side makes
            [output] = llm.generate(prompts[i], GREEDY, use_tqdm=False)
            assert isinstance(output.error, StepFailed)
            assert "the prefill engine's KV was refused" in str(output.error)
            assert "torch.float64" in str(output.error)
        llm.prefill_stats()  # the prefill side went on
        _assert_drained(llm)
        outputs = llm.generate(prompts[:4], GREEDY, use_tqdm=False)  # the fourth send raises
        errors = [o.error for o in outputs if len(o.prompt_token_ids) > 1]
        assert errors and all(isinstance(e, EngineDied) for e in errors)
        assert all("it raised: ZeroDivisionError: no KV today" in str(e) for e in errors)
        _assert_drained(llm)


def test_closing_with_prompts_on_the_prefill_side_ends_it_quietly(lone_llm, prompts, capfd):
    """The decode side drops its group before it says close: a send failing then is the
    end, not an error of the prefill side."""
    for i in range(6):
        lone_llm.add_request([(i * 7 + j) % 150 + 1 for j in range(60)], GREEDY)
    lone_llm.step()
    lone_llm.close()
    assert lone_llm._process.poll() == 0
    assert "Traceback" not in capfd.readouterr().err


def test_a_decode_side_closing_before_the_group_connects_ends_the_prefill_side_quietly(
        tmp_path):
    """Closed as soon as it started, the decode side may drop its group while the prefill
    side still connects its own: the prefill side ends as told, without saying it died. Here
    the decode side never joins, so the prefill side's connect fails (after 0.5 s) every
    time; the prefill side runs in a thread of this process."""
    path = str(tmp_path / "store")  # the group's store, which the decode side never joins
    down, up = os.pipe(), os.pipe()
    decode, prefill = disaggregated._Channel(up[0], down[1]), disaggregated._Channel(down[0], up[1])
    raised = []

    def prefill_side():
        try:
            disaggregated._prefill_main("tiny", {"device": "cpu", "num_pages": 16}, path, 0.5,
                                        prefill)
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=prefill_side)
    thread.start()
    assert decode.recv()[0] == "ready"
    decode.send(("join",))
    decode.send(("close",))
    thread.join(30)
    assert not thread.is_alive() and raised == []
    assert not decode.poll(0)  # no "died"
    for channel in (decode, prefill):
        channel.close_reader()
        channel.close_writer()


def test_no_socket_of_the_pair_listens_beyond_this_machine(checkpoint, monkeypatch):
    """The group meets at a store file in a directory of this user's alone, removed at close,
    and its gloo sockets listen on the loopback interface, even where gloo's default device
    is another interface."""
    gloo_default_device_beyond_loopback(monkeypatch)
    directories = record_private_directories(monkeypatch, disaggregated)
    with DisaggregatedLLM(checkpoint, prefill={**PREFILL, "device": "cpu"},
                          decode={**DECODE, "device": "cpu"}) as llm:
        [output] = llm.generate(list(range(1, 30)), GREEDY, use_tqdm=False)
        assert output.error is None
        listening = listening_addresses([os.getpid(), llm._process.pid])
        assert listening and not beyond_loopback(listening)
        [directory] = directories
        assert_private_while_open(directory)
    assert not os.path.exists(directory.name)


def test_a_hybrid_models_state_travels_with_its_pages(tmp_path, prompts, device):
    folder = save_hf_model(make_bamba("bamba"), tmp_path)
    options = dict(page_size=PAGE_SIZE, num_pages=128, device=device)
    expected = _tokens(LLM(folder, **options).generate(prompts, GREEDY, use_tqdm=False))
    with DisaggregatedLLM(folder, prefill=options, decode=options) as llm:
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        _assert_drained(llm)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A model of one pool of sliding-window layers, whose pages go back by default."""
    return save_hf_model(make_hf_model("mistral-window-8"), tmp_path_factory.mktemp("window"))


def test_a_model_whose_cache_gives_pages_back_is_refused_before_any_process(windowed):
    with pytest.raises(ValueError, match="one KV pool that keeps every page"):
        DisaggregatedLLM(windowed, prefill={"device": "cpu"}, decode={"device": "cpu"})


def test_a_prefill_side_whose_cache_gives_pages_back_is_refused_at_start_up(windowed, capfd):
    keeps = {"device": "cpu", "free_out_of_window": False}
    with pytest.raises(ValueError, match="the prefill engine's cache gives pages back out of "
                                         "the sliding window.*free_out_of_window=False"):
        DisaggregatedLLM(windowed, prefill={"device": "cpu"}, decode=keeps)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("other, pages", [
    ({"page_size": 8}, r"\(4, 2, 8, 2, 32\) torch\.float32"),
    ({"kv_cache_dtype": "fp8_e4m3", "kv_scales": (0.05, 0.04)},
     r"\(4, 2, 16, 2, 32\) torch\.float8_e4m3fn"),
], ids=["page size", "dtype"])
def test_a_prefill_side_of_other_pages_is_refused_and_ends_without_a_word(capfd, monkeypatch,
                                                                          other, pages):
    started = []
    start = disaggregated._start_prefill_process
    monkeypatch.setattr(disaggregated, "_start_prefill_process",
                        lambda: started.append(start()) or started[-1])
    message = (rf"the prefill engine's pages are {pages}, the decode engine's "
               rf"\(4, 2, 16, 2, 32\) torch\.float32")
    with pytest.raises(ValueError, match=message) as refused:
        DisaggregatedLLM("tiny", prefill={"device": "cpu", **other}, decode={"device": "cpu"})
    assert "give both sides the same page_size and kv_cache_dtype" in str(refused.value)
    # stopped as it was refused, not once the half-built pair is collected (the error held
    # here holds it)
    assert started[0][0].poll() == 0
    assert capfd.readouterr().err == ""  # the prefill process did not fail joining the group


def test_sides_whose_max_model_len_picks_other_longrope_factors_are_refused_before_any_process(
        monkeypatch, tmp_path):
    monkeypatch.setattr(disaggregated, "_start_prefill_process",
                        lambda: pytest.fail("a prefill process started"))
    folder = save_hf_model(make_hf_model("phi3", configs={"phi3": lambda: phi3_longrope(16)}),
                           tmp_path)
    with pytest.raises(ValueError, match="the prefill engine's max_model_len=16 and the decode "
                                         "engine's 64 pick different LongRoPE factors"):
        DisaggregatedLLM(folder, prefill={"device": "cpu", "max_model_len": 16},
                         decode={"device": "cpu", "max_model_len": 64})


def test_a_prefill_side_given_as_an_engine_config_takes_the_decode_sides_longrope_factors(
        tmp_path):
    folder = save_hf_model(make_hf_model("phi3", configs={"phi3": lambda: phi3_longrope(16)}),
                           tmp_path)
    decode = LLM(folder, device="cpu", max_model_len=16, num_pages=16)
    prefill = disaggregated._options(EngineConfig(device="cpu"))  # max_model_len None
    disaggregated._same_rope(prefill, decode)
    assert prefill["max_model_len"] == 16  # not the model's 256, whose factors are long


@pytest.mark.parametrize(("model", "max_model_len", "message"), [
    ("tiny", 0, "max_model_len must be in [1, 9223372036854775807], got 0"),
    ("phi3", 0, "max_model_len must be in [1, 9223372036854775807], got 0"),
    ("phi3", 257, "max_model_len 257 exceeds the model's max_position_embeddings 256"),
])
def test_a_prefill_sides_bad_max_model_len_is_refused_by_name_before_any_process(
        monkeypatch, tmp_path, model, max_model_len, message):
    monkeypatch.setattr(disaggregated, "_start_prefill_process",
                        lambda: pytest.fail("a prefill process started"))
    if model == "phi3":  # LongRoPE: the sides' factors are compared too
        model = save_hf_model(make_hf_model("phi3", configs={"phi3": lambda: phi3_longrope(16)}),
                              tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        DisaggregatedLLM(model, prefill={"device": "cpu", "max_model_len": max_model_len},
                         decode={"device": "cpu", "max_model_len": 64, "num_pages": 16})


def test_a_prefill_side_with_tensor_parallelism_is_refused_by_name_before_any_process():
    with pytest.raises(ValueError, match="the prefill engine runs on one rank; got "
                                         "tensor_parallel_size=2"):
        DisaggregatedLLM("tiny", prefill={"device": "cpu", "tensor_parallel_size": 2},
                         decode={"device": "cpu"})


def test_a_prefill_side_failing_to_start_is_reported_with_its_error():
    # a budget of one byte holds no page: only the prefill process finds out, planning
    with pytest.raises(EngineDied, match="the prefill engine failed to start: OutOfPages: "
                                         "the KV cache budget of 1 B on cpu"):
        DisaggregatedLLM("tiny", prefill={"device": "cpu", "kv_cache_memory": 1},
                         decode={"device": "cpu"})


def test_an_unknown_prefill_option_is_refused_before_any_process(monkeypatch):
    monkeypatch.setattr(disaggregated, "_start_prefill_process",
                        lambda: pytest.fail("a prefill process started"))
    with pytest.raises(TypeError, match="no_such_option"):
        DisaggregatedLLM("tiny", prefill={"device": "cpu", "no_such_option": 1},
                         decode={"device": "cpu"})


def test_fp8_pages_of_other_kv_scales_on_each_side_are_refused_before_any_process(
        monkeypatch):
    monkeypatch.setattr(disaggregated, "_start_prefill_process",
                        lambda: pytest.fail("a prefill process started"))
    fp8 = {"device": "cpu", "kv_cache_dtype": "fp8_e4m3", "num_pages": 64}
    with pytest.raises(ValueError, match="same kv_scales given to both sides"):
        DisaggregatedLLM("tiny", prefill={**fp8, "kv_scales": (0.05, 0.04)},
                         decode={**fp8, "kv_scales": (0.1, 0.1)})


@pytest.mark.parametrize("name, value, error", [("timeout", 0, ValueError),
                                                ("start_timeout", -1.0, ValueError),
                                                ("timeout", "60", TypeError)])
def test_timeouts_that_are_not_seconds_are_refused_by_name_before_any_process(
        monkeypatch, name, value, error):
    monkeypatch.setattr(disaggregated, "_start_prefill_process",
                        lambda: pytest.fail("a prefill process started"))
    with pytest.raises(error, match=f"^{name} must be a number of seconds"):
        DisaggregatedLLM("tiny", prefill={"device": "cpu"}, decode={"device": "cpu"},
                         **{name: value})


def test_fp8_pages_need_the_same_kv_scales_given_to_both_sides():
    fp8 = {"device": "cpu", "kv_cache_dtype": "fp8_e4m3", "num_pages": 64}
    with pytest.raises(ValueError, match="same kv_scales given to both sides"):
        DisaggregatedLLM("tiny", prefill=fp8, decode=fp8)
    given = {**fp8, "kv_scales": (0.05, 0.04)}
    prompt = [random.Random(3).randrange(258) for _ in range(40)]
    expected = _tokens(LLM("tiny", **given).generate([prompt], GREEDY, use_tqdm=False))
    with DisaggregatedLLM("tiny", prefill=given, decode=given) as llm:
        assert _tokens(llm.generate([prompt], GREEDY, use_tqdm=False)) == expected


def test_a_disaggregated_servers_metrics_show_each_sides_pool_prefix_cache_and_tier():
    pytest.importorskip("starlette", reason="the server extra is not installed")
    import httpx

    from server_util import metrics, running_server

    # the prefill side's 12 pages hold one prompt of 40 tokens: the next one evicts its
    # pages into the prefill side's tier, and the first, sent again, loads them back
    make_llm = functools.partial(
        DisaggregatedLLM, "tiny", decode={"device": "cpu", "page_size": 4, "num_pages": 40},
        prefill={"device": "cpu", "page_size": 4, "num_pages": 12, "host_tier_memory": 2**22})
    first, other = ([random.Random(seed).randrange(256) for _ in range(40)] for seed in (0, 1))
    with running_server(make_llm) as server:
        for prompt in (first, other, first):
            response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert response.status_code == 200, response.text
        values = metrics(server)
    prefill, decode = (("side", "prefill"),), (("side", "decode"),)
    assert values["kvpool_tier_stored_pages_total", prefill] > 0
    assert values["kvpool_tier_loaded_pages_total", prefill] > 0
    assert values["kvpool_prefix_cache_hits_total", prefill] > 0
    assert values["kvpool_tier_stored_pages_total", decode] == 0  # the decode side has none
    for side, num_pages in ((prefill, 12), (decode, 40)):
        assert sum(values[f"kvpool_pages_{kind}", side] for kind in ("used", "cached", "free")
                   ) == num_pages
    assert ("kvpool_pages_used", ()) not in values
