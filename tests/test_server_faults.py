"""Admission control and engine faults: a full waiting queue answers 503 with Retry-After;
an exception inside a step fails the requests in flight with 500 (not those it finished) and
the server serves on; an engine process that dies, or a disaggregated engine's prefill side,
fails its requests, and later ones get 503; a call into the engine that does not pickle or
unpickle fails its caller alone; a shutdown ends an engine whose step never returns."""

import asyncio
import concurrent.futures
import importlib
import json
import multiprocessing.forkserver
import os
import pickle
import signal
import threading
import time
from functools import partial

import httpx
import pytest

from engine_probes import (
    check_cache,
    exit_engine,
    fail_an_update_after_a_finish,
    fail_next_forward,
    hang_in_the_next_forward,
    heal_sampling,
    notice_the_prefill_side_exited,
    num_steps,
    overlapping,
    poison_sampling,
    prefill_pid,
    raise_in_the_next_on_step,
    unpicklable_result,
    used_pages,
    worker_pid,
)
from kvpool.engine import LLM, DisaggregatedLLM, SamplingParams
from kvpool.engine.parallel import process_context
from kvpool.server import engine_loop
from kvpool.server.engine_loop import (
    EngineExited,
    EngineLoop,
    ServerBusy,
    _Engine,
    forkserver_ended,
)
from server_util import RunningServer, metrics, running_server

LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True,
        "stream": True}
INTERNAL = {"type": "internal_error", "param": None, "code": None,
            "message": "the engine failed: RuntimeError: injected"}


@pytest.fixture(scope="module")
def server(device):
    # One seat and one waiting place: a third request finds the queue full.
    with running_server(partial(LLM, "tiny", num_pages=256, max_num_seqs=1, device=device),
                        max_waiting=1) as server:
        yield server


def test_a_full_waiting_queue_answers_503_with_retry_after(server):
    with httpx.Client(base_url=server.url) as http, \
            http.stream("POST", "/v1/completions", json=LONG) as running:
        lines = running.iter_lines()  # kept: dropping it would close the connection
        next(lines)  # the first chunk: it holds the one seat
        with http.stream("POST", "/v1/completions", json=LONG) as waiting:
            assert waiting.status_code == 200  # taken: it waits for the seat
            refused = http.post("/v1/completions", json={**LONG, "stream": False})
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json() == {"error": {
        "message": "1 sequences wait already; this request's 1 would pass max_waiting 1",
        "type": "server_busy", "param": None, "code": "server_busy"}}
    server.wait_idle()  # the waiting stream notices its client left once it runs
    assert server.client().completions.create(model="tiny", prompt="x", max_tokens=2).choices


def test_a_request_of_n_samples_counts_n_sequences_against_max_waiting(device):
    llm = LLM("tiny", num_pages=64, max_num_seqs=4, device=device)
    engine = _Engine(llm, max_waiting=0, events=None)
    engine._add("three", [1, 2, 3], SamplingParams(n=3, max_tokens=2, ignore_eos=True), None)
    llm.step()
    assert (llm.stats().num_running, llm.stats().num_waiting) == (3, 0)
    with pytest.raises(ServerBusy, match="0 sequences wait already; this request's 2 would"):
        engine._add("two", [1, 2, 3], SamplingParams(n=2, max_tokens=1), None)
    engine._add("one", [1, 2, 3], SamplingParams(max_tokens=1), None)  # the last seat
    while llm.has_unfinished():
        llm.step()


def test_the_samples_of_a_request_not_yet_stepped_count_against_max_waiting(device):
    """Before its first step a request of n samples is one queued sequence in the scheduler;
    its n samples were counted as one, and a second request took seats it would need."""
    llm = LLM("tiny", num_pages=64, max_num_seqs=4, device=device)
    engine = _Engine(llm, max_waiting=0, events=None)
    engine._add("three", [1, 2, 3], SamplingParams(n=3, max_tokens=2, ignore_eos=True), None)
    assert (llm.stats().num_running, llm.stats().num_waiting) == (0, 3)
    with pytest.raises(ServerBusy, match="3 sequences wait already; this request's 2 would"):
        engine._add("two", [1, 2, 3], SamplingParams(n=2, max_tokens=1), None)
    engine._add("one", [1, 2, 3], SamplingParams(max_tokens=1), None)  # the last seat
    llm.step()  # both admitted: "one" finished on its prefill's token, "three" forked
    assert (llm.stats().num_running, llm.stats().num_waiting) == (3, 0)
    while llm.has_unfinished():
        llm.step()


def test_an_engine_failure_answers_500_and_the_server_serves_on(server):
    errors = "kvpool_requests_total", (("finish_reason", "error"),)
    before = metrics(server).get(errors, 0)
    server.on_engine(fail_next_forward)
    response = httpx.post(f"{server.url}/v1/completions",
                          json={"model": "tiny", "prompt": "Hello", "max_tokens": 4})
    assert response.status_code == 500
    assert response.json() == {"error": INTERNAL}
    assert metrics(server)[errors] - before == 1  # counted as an error, not an abort
    server.wait_idle()
    server.on_engine(check_cache)
    assert server.on_engine(used_pages) == 0
    assert server.client().completions.create(model="tiny", prompt="x", max_tokens=2).choices


def test_a_request_whose_sampling_fails_gets_500_with_the_message_and_the_next_is_served(
        server):
    server.on_engine(poison_sampling)
    try:
        failed = httpx.post(f"{server.url}/v1/completions",
                            json={"model": "tiny", "prompt": "Hello", "max_tokens": 7})
        served = httpx.post(f"{server.url}/v1/completions",
                            json={"model": "tiny", "prompt": "Hello", "max_tokens": 5,
                                  "ignore_eos": True})
    finally:
        server.on_engine(heal_sampling)
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "internal_error"
    assert error["message"].startswith("the request failed: ") and "injected" in error["message"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 5
    server.wait_idle(timeout=30)
    server.on_engine(check_cache)
    assert server.on_engine(used_pages) == 0


def test_an_engine_failure_mid_stream_ends_the_stream_with_an_error_event(server):
    steps = server.on_engine(num_steps)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG) as response:
        lines = response.iter_lines()
        next(lines)  # the first chunk: the request runs
        server.on_engine(fail_next_forward)
        rest = [line for line in lines if line]
    assert json.loads(rest[-2].removeprefix("data: ")) == {"error": INTERNAL}
    assert rest[-1] == "data: [DONE]"
    server.wait_idle()
    server.on_engine(check_cache)
    assert server.on_engine(num_steps) - steps < LONG["max_tokens"]  # ended there, not run on


def test_a_request_whose_steps_on_step_raised_is_answered_and_the_server_serves_on(server):
    """The LLM hands a step's requests to the next step when its on_step raised: the one
    finished there is answered as it ended, not failed."""
    client = server.client()
    server.on_engine(raise_in_the_next_on_step)
    finished = client.completions.create(model="tiny", prompt="Hello", max_tokens=1)
    assert finished.choices[0].finish_reason == "length"
    assert finished.usage.completion_tokens == 1
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices
    server.wait_idle()
    server.on_engine(check_cache)
    assert server.on_engine(used_pages) == 0


def test_a_step_that_raises_after_finishing_a_request_fails_only_the_others(device):
    """With overlap a step finishes the last step's requests before it records its own
    batch; a fault there fails the batch's requests, and the finished one is answered."""
    with running_server(partial(LLM, "tiny", num_pages=64, max_num_seqs=4, device=device,
                                overlap=True)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=LONG) as running:
        assert server.on_engine(overlapping)
        lines = running.iter_lines()
        next(lines)  # the first chunk: the request runs
        server.on_engine(fail_an_update_after_a_finish)
        finished = http.post("/v1/completions", json={**LONG, "stream": False, "max_tokens": 1})
        rest = [line for line in lines if line]
        assert finished.status_code == 200
        assert finished.json()["usage"]["completion_tokens"] == 1
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["type"] == "internal_error"
        assert error["message"].endswith("interrupted by RuntimeError: injected")
        assert server.client().completions.create(model="tiny", prompt="x", max_tokens=2).choices
        server.wait_idle()
        server.on_engine(check_cache)
        assert server.on_engine(used_pages) == 0


def test_a_call_that_does_not_pickle_fails_its_caller_and_the_engine_serves_on(server):
    with pytest.raises((pickle.PicklingError, AttributeError)):
        server.on_engine(lambda llm: llm.cache.stats())  # a lambda pickles by name: no
    assert server.on_engine(used_pages) == 0


def test_a_call_whose_result_does_not_pickle_fails_its_caller_and_the_engine_serves_on(server):
    with pytest.raises(RuntimeError, match="the engine's reply does not pickle"):
        server.on_engine(unpicklable_result)
    assert server.on_engine(used_pages) == 0


def test_a_call_the_engine_cannot_unpickle_fails_its_caller_and_the_engine_serves_on(
        server, tmp_path, monkeypatch):
    """A function of a module imported after the engine process started, from a folder its
    path lacks: it pickles here, by name, and cannot be unpickled there."""
    (tmp_path / "probe_of_a_late_module.py").write_text("def steps(llm):\n    return 0\n")
    monkeypatch.syspath_prepend(tmp_path)
    late = importlib.import_module("probe_of_a_late_module")
    with pytest.raises(RuntimeError, match="the engine cannot unpickle the call's function: "
                                           "ModuleNotFoundError: No module named "
                                           "'probe_of_a_late_module'"):
        server.on_engine(late.steps)
    assert server.engine.alive and server.on_engine(used_pages) == 0


def test_a_terminals_ctrl_c_reaches_the_server_and_not_its_engine_process(server):
    os.kill(server.engine.pid, signal.SIGINT)  # the engine shares the terminal's group
    out = server.client().completions.create(model="tiny", prompt="x", max_tokens=2)
    assert out.usage.completion_tokens == 2
    assert server.engine.alive and server.on_engine(used_pages) == 0


def test_a_call_in_flight_when_the_engine_process_dies_and_every_later_one_raise(device):
    with running_server(partial(LLM, "tiny", num_pages=64, device=device)) as server:
        for probe in (exit_engine, used_pages):
            call = asyncio.run_coroutine_threadsafe(server.engine.call(probe), server.loop)
            with pytest.raises(EngineExited, match="the engine process has exited"):
                call.result(10)
        assert not server.engine.alive


def test_a_shutdown_ends_an_engine_whose_step_never_returns(device, tmp_path, monkeypatch,
                                                            caplog):
    """Told to stop, the engine ends between two steps: one that never leaves its step (and
    ignores SIGTERM here) is terminated, then killed, and the server exits."""
    monkeypatch.setattr(engine_loop, "STOP_SECONDS", 0.2)
    entered = tmp_path / "entered"
    server = RunningServer(partial(LLM, "tiny", num_pages=64, device=device),
                           shutdown_timeout=0.1)
    server.start()
    try:
        server.on_engine(partial(hang_in_the_next_forward, str(entered)))
        with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG) as response:
            deadline = time.monotonic() + 30
            while not entered.exists():
                assert time.monotonic() < deadline, "the engine did not start its step in 30 s"
                time.sleep(0.02)
            server.stop()
            assert not server._thread.is_alive(), "the server still runs 30 s after its stop"
            assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"
        assert server.engine._process.exitcode == -signal.SIGKILL
        assert [r.message for r in caplog.records if r.name == engine_loop.__name__] == [
            "the engine process still ran 0.2 s after it was told to stop (in a step that "
            "does not return?): killed"]
    finally:
        server.engine._process.kill()  # on a failure: it would hang this process's exit


def test_an_engine_that_cannot_be_built_raises_its_error_and_leaves_no_process():
    engine = EngineLoop(partial(LLM, "tiny", max_num_seqs=0), max_waiting=0)
    with pytest.raises(ValueError, match=r"max_num_seqs must be in \[1, .*\], got 0"):
        engine.start()
    assert engine._process.exitcode == 0


def test_max_waiting_must_be_an_int_of_at_least_0():
    for bad in (-1, True, 1.0, "1", None):
        with pytest.raises(ValueError, match="max_waiting must be an int >= 0"):
            EngineLoop(partial(LLM, "tiny"), max_waiting=bad)
    assert EngineLoop(partial(LLM, "tiny"), max_waiting=0).max_waiting == 0


def test_forkserver_ended_leaves_a_forkserver_started_before_its_block_running():
    process_context()  # its preload list, for the tests after this one
    multiprocessing.forkserver.ensure_running()
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    with forkserver_ended():
        pass
    os.kill(pid, 0)  # it runs still: this raises ProcessLookupError else
    assert multiprocessing.forkserver._forkserver._forkserver_pid == pid


def test_an_engine_process_that_dies_fails_its_requests_and_later_ones_get_503(device):
    with running_server(partial(LLM, "tiny", num_pages=64, device=device)) as server, \
            httpx.stream("POST", f"{server.url}/v1/completions", json=LONG) as response:
        lines = response.iter_lines()
        next(lines)  # the first chunk: the request runs
        os.kill(server.engine.pid, signal.SIGKILL)
        rest = [line for line in lines if line]
        refused = httpx.post(f"{server.url}/v1/completions", json={**LONG, "stream": False})
        health, metrics = (httpx.get(f"{server.url}/{path}") for path in ("health", "metrics"))
    assert json.loads(rest[-2].removeprefix("data: ")) == {"error": {
        **INTERNAL, "message": "the engine process exited"}}
    assert rest[-1] == "data: [DONE]"
    # no retry will help, and a supervisor probing /health should restart the server
    for response in (refused, health, metrics):
        assert response.status_code == 503 and "retry-after" not in response.headers
        assert response.json()["error"] == {
            "message": "the engine process has exited", "type": "server_error",
            "param": None, "code": "engine_exited"}


EXITED = {"message": "the engine process has exited", "type": "server_error", "param": None,
          "code": "engine_exited"}


def until_exited(server, http) -> None:
    """Wait (30 s at most) until the engine process has ended and /health says so."""
    deadline = time.monotonic() + 30
    while server.engine.alive or http.get("/health").status_code != 503:
        assert time.monotonic() < deadline, "the engine process still runs 30 s later"
        time.sleep(0.05)


@pytest.mark.parametrize("when", ["idle", "running"])
def test_a_disaggregated_engine_whose_prefill_side_died_answers_503_as_exited(device, when):
    """A DisaggregatedLLM whose prefill side died serves nothing again: once the server sees
    it (idle, within a second; running, as a request fails with it or is refused), the engine
    process ends, and every later request and /health get 503 engine_exited, as if the engine
    process had died."""
    sides = {"num_pages": 64, "device": device}
    with running_server(partial(DisaggregatedLLM, "tiny", prefill=sides, decode=sides)) \
            as server, httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        pid = server.on_engine(prefill_pid)
        if when == "idle":  # no request meets it: a scrape, or the idle engine, sees it
            os.kill(pid, signal.SIGKILL)
            scrape = http.get("/metrics")
            assert scrape.status_code == 503 and scrape.json()["error"]["code"] == \
                "engine_exited"
            until_exited(server, http)
        else:  # a request running on the decode side goes on until a new one is refused
            with http.stream("POST", "/v1/completions", json=LONG) as running:
                lines = running.iter_lines()
                next(lines)  # the first chunk: the request runs on the decode side
                os.kill(pid, signal.SIGKILL)
                server.on_engine(notice_the_prefill_side_exited)
                refused = http.post("/v1/completions", json=body)
                rest = [line for line in lines if line]
            assert refused.status_code == 503 and "retry-after" not in refused.headers
            assert refused.json()["error"]["code"] == "engine_exited"
            assert "the prefill engine is gone" in refused.json()["error"]["message"]
            assert json.loads(rest[-2].removeprefix("data: ")) == {"error": {
                **INTERNAL, "message": "the engine process exited"}}
        later = http.post("/v1/completions", json=body)
        health = http.get("/health")
        for response in (later, health):
            assert response.status_code == 503 and response.json()["error"] == EXITED
        assert not server.engine.alive


@pytest.mark.parametrize("when", ["idle", "running"])
def test_a_tensor_parallel_engine_whose_worker_died_answers_503_as_exited(when):
    """A rank that died ends the engine: idle, within a second; running, at the step that
    finds it, which fails the request it ran (500). Then every later request and /health
    get 503. (Two ranks on the CPU, over gloo.)"""
    with running_server(partial(LLM, "tiny", num_pages=64, device="cpu",
                                tensor_parallel_size=2)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        pid = server.on_engine(worker_pid)
        if when == "idle":
            os.kill(pid, signal.SIGKILL)
            until_exited(server, http)
        else:
            with http.stream("POST", "/v1/completions", json=LONG) as running:
                lines = running.iter_lines()
                next(lines)
                os.kill(pid, signal.SIGKILL)
                last = [line for line in lines if line][-2]
            assert "rank 1" in json.loads(last.removeprefix("data: "))["error"]["message"]
        later = http.post("/v1/completions", json=body)
        health = http.get("/health")
        for response in (later, health):
            assert response.status_code == 503 and response.json()["error"] == EXITED


def test_a_prompt_is_tokenized_off_the_event_loop(server, monkeypatch):
    """A long text takes seconds to tokenize: meanwhile the server answers other clients."""
    tokenizer = server.app.state.server.info.tokenizer
    encode, tokenizing, release = type(tokenizer).encode, threading.Event(), threading.Event()

    def slow_encode(self, text, **options):
        tokenizing.set()
        release.wait(10)
        return encode(self, text, **options)
    monkeypatch.setattr(type(tokenizer), "encode", slow_encode)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=30)
        assert tokenizing.wait(30), "the prompt was not tokenized in 30 s"
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert not pending.done()
        release.set()
        assert pending.result().status_code == 200
