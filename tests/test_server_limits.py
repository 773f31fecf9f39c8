"""What one client may do to a server: bodies over the size limit (413) or too slow (408),
headers that never end, requests without the API key (401), prefixes of other keys and
salts (never shared), `n` past max_num_seqs; and what a SIGTERM does to requests in flight.
"""

import argparse
import hashlib
import json
import logging
import socket
import threading
import time
from collections import abc
from functools import partial

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from kvpool.cli.main import main
from kvpool.cli.serve import API_KEY_ENV, add_arguments, api_keys
from kvpool.engine import LLM
from kvpool.server.auth import ApiKeyMiddleware, check_keys, key_salt
from kvpool.server.limits import ServerLimits
from server_util import running_server

KEY_A, KEY_B = "key-a", "key-b"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
LIMITS = ServerLimits(max_body_bytes=64 * 1024, header_timeout=0.5, body_timeout=0.5)
# 16 pages of 16 tokens: one sequence holds 257 tokens at most, fewer than max_model_len.
ENGINE = partial(LLM, "tiny", num_pages=16, max_model_len=512, max_num_seqs=4)


@pytest.fixture(scope="module")
def server():
    with running_server(ENGINE, limits=LIMITS, api_keys=(KEY_A, KEY_B),
                        prefix_isolation="per-key", max_waiting=0) as server:
        yield server


@pytest.fixture
def errors_logged():
    """The records of ERROR or worse that uvicorn and the engine loop log meanwhile."""
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "kvpool")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


def post(server, body, headers=A, path="/v1/completions", **kwargs):
    content = body if isinstance(body, str | bytes | abc.Iterator) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30,
                      **kwargs)


def prompt_tokens_cached(server, prompt, headers, **fields):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, **fields}
    return post(server, body, headers).json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_an_idle_server_with_max_waiting_0_takes_a_request(server):
    response = post(server, {"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 200


def test_a_body_over_the_size_limit_gets_413_as_declared_or_as_read(server):
    body = {"model": "tiny", "prompt": "x" * (LIMITS.max_body_bytes + 1)}
    declared = post(server, body)
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "request_too_large"
    chunk = b" " * 8192
    streamed = post(server, (chunk for _ in range(9)))  # chunked: no Content-Length
    assert streamed.status_code == 413
    assert streamed.json()["error"]["message"] == (
        "the request body of 73728 bytes or more passes the limit of 65536 bytes")
    assert post(server, {"model": "tiny", "prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_a_body_of_exactly_the_size_limit_is_taken_as_declared_or_as_read(server):
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 1}).encode()
    body = body.ljust(LIMITS.max_body_bytes)  # JSON may end in white space
    assert post(server, body).status_code == 200
    assert post(server, iter([body[:8192], body[8192:]])).status_code == 200  # chunked


def test_a_declared_oversize_body_gets_413_before_it_is_sent(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a"
                     b"\r\nContent-Length: 1000000000\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413 ")  # not a 408 once the body timeout passes


def test_a_body_that_stalls_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a"
                     b"\r\nContent-Length: 100\r\n\r\n{\"model\":")
        start = time.monotonic()
        reply = b""
        while chunk := sock.recv(4096):  # until the server closes the idle connection
            reply += chunk
    assert time.monotonic() - start < 5  # body_timeout is 0.5 s
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b'"code": "request_timeout"' in reply


def test_a_connection_that_stalls_in_its_headers_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        assert sock.recv(4096) == b""  # closed by the server
    assert time.monotonic() - start < 5


def test_a_kept_alive_connection_that_stalls_in_its_next_headers_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        start = time.monotonic()
        assert sock.recv(4096) == b""  # closed by the server
    assert time.monotonic() - start < 5


def test_requests_without_a_valid_key_get_401_and_health_and_metrics_stay_open(server):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY_A}):
        refused = post(server, body, headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=B).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


@pytest.mark.parametrize("header", [
    f"Bearer {KEY_A[:-1]}", "Bearer k", f"Bearer {KEY_A}-extra", f"Basic {KEY_A}",
    f"Token {KEY_A}"])
def test_only_the_whole_key_under_the_bearer_scheme_is_taken(header):
    app = Starlette(routes=[Route("/v1/models", lambda request: Response("ok"))])
    app.add_middleware(ApiKeyMiddleware, keys=(KEY_A, KEY_B))
    with TestClient(app) as client:
        assert client.get("/v1/models", headers={"Authorization": header}).status_code == 401
        for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive
            accepted = client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY_A}"})
            assert accepted.text == "ok"


def test_a_key_salt_names_the_key_without_holding_it():
    salt = key_salt("sk-very-secret")
    assert salt == "key:" + hashlib.sha256(b"sk-very-secret").hexdigest()
    assert "sk-very-secret" not in salt
    assert key_salt(KEY_A) != key_salt(KEY_B)


def test_a_closed_health_route_needs_the_key_too():
    app = Starlette(routes=[Route("/health", lambda request: Response("ok"))])
    app.add_middleware(ApiKeyMiddleware, keys=(KEY_A,), open_paths=frozenset())
    with TestClient(app) as client:
        assert client.get("/health").status_code == 401
        assert client.get("/health", headers=A).text == "ok"


def test_keys_come_from_the_flag_or_else_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "k1,k2")
    assert api_keys(None) == ("k1", "k2")
    assert api_keys(["flag"]) == ("flag",)
    monkeypatch.delenv(API_KEY_ENV)
    assert api_keys(None) == ()


def test_keys_lose_the_whitespace_around_them(monkeypatch):
    # a space after a comma, a newline as a file ends, a piece of spaces alone
    monkeypatch.setenv(API_KEY_ENV, "alpha, beta\n,  ,")
    assert api_keys(None) == ("alpha", "beta")
    assert api_keys([" k1", "k2\r\n"]) == ("k1", "k2")


def test_a_key_variable_of_commas_and_whitespace_alone_is_refused_not_read_as_no_key(
        monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, " , ,")
    with pytest.raises(ValueError, match=f"{API_KEY_ENV} holds no key, only commas"):
        api_keys(None)
    monkeypatch.setenv(API_KEY_ENV, "")  # set empty: no key, as unset
    assert api_keys(None) == ()


@pytest.mark.parametrize("key, held", [
    ("two words", "U+0020"), ("tab\there", "U+0009"), ("nul\x00", "U+0000"),
    ("zero\u200bwidth", "U+200B")])
def test_a_key_holding_whitespace_or_a_control_character_is_refused(key, held):
    with pytest.raises(ValueError) as info:
        check_keys((KEY_A, key))
    assert str(info.value) == ("api keys must hold no whitespace or control characters; "
                               f"key 2 of 2 holds {held}")


def test_prefixes_are_isolated_per_key_and_per_salt(server):
    prompt = list(range(40))  # two full pages are served from the prefix cache
    assert prompt_tokens_cached(server, prompt, A) == 0
    assert prompt_tokens_cached(server, prompt, A) == 32
    assert prompt_tokens_cached(server, prompt, B) == 0  # the other key sees no hit
    assert prompt_tokens_cached(server, prompt, A, cache_salt="s") == 0
    assert prompt_tokens_cached(server, prompt, A, cache_salt="s") == 32
    assert prompt_tokens_cached(server, prompt, B, cache_salt="s") == 0  # one salt, two keys


def test_unencodable_text_and_deep_json_are_400s_with_nothing_logged(server, errors_logged):
    surrogate = post(server, '{"model": "tiny", "prompt": "\\ud800"}')
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "prompt"
    chat = post(server, '{"model": "tiny", "messages": [{"role": "user", "content": '
                        '"\\ud800"}]}', path="/v1/chat/completions")
    assert chat.status_code == 400
    deep = post(server, "[" * 30_000 + "]" * 30_000)
    assert deep.status_code == 400
    unknown = httpx.get(f"{server.url}/nowhere", headers=A)
    assert (unknown.status_code, unknown.json()["error"]["message"]) == (404, "Not Found")
    assert errors_logged == []


def test_chat_without_max_tokens_gets_the_room_the_pool_leaves(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "ignore_eos": True}
    response = post(server, body, path="/v1/chat/completions")
    assert response.status_code == 200
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 257


def test_chat_max_completion_tokens_wins_over_max_tokens_unless_null(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "ignore_eos": True, "max_tokens": 2}
    for extra, expected in (({"max_completion_tokens": 3}, 3),
                            ({"max_completion_tokens": None}, 2)):
        response = post(server, {**body, **extra}, path="/v1/chat/completions")
        assert response.json()["usage"]["completion_tokens"] == expected


def test_sigterm_ends_streams_with_an_error_and_done_and_whole_requests_with_503(
        errors_logged):
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True}
    with running_server(partial(LLM, "tiny", num_pages=256, max_model_len=4096),
                        shutdown_timeout=0.3) as server:
        whole: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: whole.append(post(server, long, {})))
        with httpx.stream("POST", f"{server.url}/v1/completions",
                          json={**long, "stream": True}, timeout=30) as stream:
            lines = stream.iter_lines()
            next(lines)  # the first chunk: it runs
            waiter.start()
            deadline = time.monotonic() + 10
            while server.engine.num_requests < 2:
                assert time.monotonic() < deadline, "the whole request did not start"
                time.sleep(0.01)
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            rest = [line for line in lines if line]
        waiter.join(30)
        stopper.join(30)
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"] == {
        "message": "the server is shutting down", "type": "server_busy", "param": None,
        "code": "server_shutting_down"}
    assert whole[0].status_code == 503
    assert whole[0].json()["error"]["code"] == "server_shutting_down"
    assert errors_logged == []



def test_a_drain_lets_requests_in_flight_finish_and_refuses_new_ones_on_open_connections():
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with running_server(partial(LLM, "tiny", num_pages=256, max_model_len=4096),
                        shutdown_timeout=30) as server, \
            httpx.Client(base_url=server.url, timeout=30) as kept:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long,
                          timeout=30) as held, \
                httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                             json={**long, "max_tokens": 64}) as finishing:
            held_lines = held.iter_lines()  # kept: dropping it would close the connection
            next(held_lines)
            lines = finishing.iter_lines()
            next(lines)  # both run
            assert kept.get("/health").status_code == 200  # its connection stays open
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            deadline = time.monotonic() + 10
            while True:  # the listener closes first
                try:
                    httpx.get(f"{server.url}/health", timeout=30)  # a slow answer is no failure
                except httpx.ConnectError:
                    break
                assert time.monotonic() < deadline, "the server still takes connections"
                time.sleep(0.01)
            late = kept.post("/v1/completions",
                             json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            rest = [line for line in lines if line]
        # the held stream's client left: the drain has nothing more to wait for
        stopper.join(30)
    assert late.status_code == 503
    assert late.json()["error"]["message"] == "the server is shutting down"
    assert late.json()["error"]["code"] == "server_shutting_down"  # as for a request it ends
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
    assert not any("error" in event for event in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert not stopper.is_alive()


@pytest.mark.parametrize("timeout", ["header_timeout", "body_timeout"])
@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (float("inf"), ValueError),
                                              (float("nan"), ValueError), (True, TypeError),
                                              ("30", TypeError)])
def test_a_timeout_that_is_not_seconds_up_to_a_year_is_refused(timeout, value, error):
    with pytest.raises(error, match=f"{timeout} must be a number of seconds"):
        ServerLimits(**{timeout: value})


def test_the_serve_flags_default_to_the_server_limits_defaults():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert ServerLimits(args.max_body_size, args.max_stop_strings, args.max_stop_length,
                        args.max_stop_token_ids, args.header_timeout,
                        args.body_timeout) == ServerLimits()


def test_bench_url_sends_the_api_key(server, capsys):
    argv = ["bench", "--url", server.url, "--num-requests", "2", "--prompt-len", "8",
            "--output-len", "4"]
    assert main(argv) == 2
    assert "the server answered 401" in capsys.readouterr().err
    assert main([*argv, "--api-key", KEY_A]) == 0
    assert "requests" in capsys.readouterr().out
