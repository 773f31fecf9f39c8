"""`kvpool serve` through the real openai client: completions and chat, whole and streamed,
n samples, seeds, stop strings, usage, greedy output equal to `LLM.generate`, logprobs in
both OpenAI forms, the models, health and metrics endpoints, and every bad request refused
with an OpenAI error body."""

import json
import re
from functools import partial

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.cli.http_bench import samples_by_name
from kvpool.cli.main import main
from kvpool.engine import LLM, EngineStats, SamplingParams
from kvpool.server.engine_loop import Sample, Update
from kvpool.server.generation import Generation
from kvpool.server.limits import ServerLimits
from kvpool.server.metrics import ChoiceTimes, EngineSnapshot, RequestTimes, ServerMetrics
from kvpool.server.protocol import RequestError, parse_chat, parse_completion
from models_util import make_hf_model, save_hf_model
from server_util import metrics, running_server

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPT = "The pool"


# The served engine (built in the engine process), and the one the tests compare it with.
ENGINE = partial(LLM, "tiny", num_pages=24, max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def llm(device):
    return ENGINE(device=device)


@pytest.fixture(scope="module")
def expected(llm):
    """LLM.generate's greedy text of PROMPT (32 tokens, EOS ignored), before serving."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def expected_logprobs(llm):
    """LLM.generate's greedy sample of PROMPT with 3 alternatives per token, before serving."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def server(device):
    with running_server(partial(ENGINE, device=device)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_greedy_completion_equals_llm_generate(client, expected):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, **GREEDY)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (9, 32)  # BOS + 8 bytes
    assert out.usage.total_tokens == 41


def test_a_prompt_of_token_ids_is_taken_as_is(client, expected):
    out = client.completions.create(model="tiny", prompt=[256, *PROMPT.encode()],
                                    max_tokens=32, **GREEDY)
    assert out.choices[0].text == expected.text


def test_stop_strings_on_a_model_without_a_tokenizer_are_refused_before_the_engine(tmp_path,
                                                                                 device):
    checkpoint = save_hf_model(make_hf_model("llama"), tmp_path)  # no tokenizer.json
    with running_server(partial(LLM, checkpoint, num_pages=16, device=device)) as server:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
        refused = httpx.post(f"{server.url}/v1/completions", json={**body, "stop": ["a"]})
        assert (refused.status_code, refused.json()) == (400, {"error": {
            "message": "this model has no tokenizer, so stop strings cannot match: use "
                       "stop_token_ids", "type": "invalid_request_error", "param": "stop",
            "code": "unsupported"}})
        assert metrics(server)["kvpool_prefix_cache_queries_total", ()] == 0  # never ran
        taken = httpx.post(f"{server.url}/v1/completions", json={**body, "stop_token_ids": [5]})
        assert taken.status_code == 200, taken.text


def test_chat_renders_the_fallback_template(client, llm):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}], max_tokens=12, **GREEDY)
    prompt = [256, *b"system: Be brief.\nuser: hi\nassistant:"]
    assert out.usage.prompt_tokens == len(prompt)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == _greedy_text(client, prompt, 12)


def test_streamed_completion_adds_up_to_the_whole_text(client, expected):
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=32, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    # Equal text also means no character was split: U+0640 (bytes 217, 128) comes whole.
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected.text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32


def test_chat_stream_is_role_chunk_deltas_finish_chunk_usage_done(server, expected):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": "length"}]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    assert all(e["usage"] is None for e in events[:-1])
    assert all("content" in e["choices"][0]["delta"] for e in events[1:-2])


def test_n_2_returns_two_choices_and_counts_both(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, n=2, seed=7,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text != out.choices[1].text
    assert out.usage.completion_tokens == 20


def _events(server, path, body):
    with httpx.stream("POST", f"{server.url}/v1/{path}", json=body, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_a_stream_of_n_2_carries_each_choice_under_its_own_index(server):
    chat = _events(server, "chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2,
        "max_tokens": 4, "stream": True, "seed": 1})
    assert sorted(c["index"] for e in chat for c in e["choices"]
                  if c["delta"].get("role") == "assistant") == [0, 1]
    body = {"model": "tiny", "prompt": PROMPT, "n": 2, "max_tokens": 6, "seed": 3,
            "ignore_eos": True}
    texts, finish_reasons = {0: "", 1: ""}, {}
    for event in _events(server, "completions", {**body, "stream": True}):
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"] is not None:
                finish_reasons[c["index"]] = c["finish_reason"]
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finish_reasons == {0: "length", 1: "length"}


def test_n_2_runs_until_both_choices_end(server):
    # stop tokens that one choice meets steps before the other
    body = {"model": "tiny", "prompt": PROMPT, "n": 2, "max_tokens": 30, "seed": 5,
            "stop_token_ids": list(range(0, 258, 9))}
    out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    assert [c["finish_reason"] for c in out["choices"]] == ["stop", "stop"]


def test_completion_logprobs_0_still_name_the_sampled_token_in_top_logprobs(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, logprobs=0,
                                    **GREEDY).choices[0].logprobs
    assert out.top_logprobs == [{t: v} for t, v in zip(out.tokens, out.token_logprobs,
                                                       strict=True)]


def test_chat_logprobs_without_top_logprobs_give_each_tokens_own(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(c.top_logprobs == [] for c in content)


def test_a_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16,
                                         seed=seed, extra_body={"ignore_eos": True}
                                         ).choices[0].text
    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


def test_a_stop_string_across_tokens_ends_the_choice_before_it(client, expected):
    stop = "\u066e{"  # bytes 217, 174, 123: three tokens, the first two one character
    cut = expected.text.index(stop)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, stop=[stop],
                                    **GREEDY)
    assert out.choices[0].text == expected.text[:cut]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 11  # the tokens up to the stop string's last
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32,
                                              stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == expected.text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def _text(token_id):
    return bytes([token_id]).decode(errors="replace") if token_id < 256 else ""


def _name(token_id):
    """How completions name a token: its text, unless that is no whole character."""
    text = _text(token_id)
    return text if text and "\ufffd" not in text else f"token_id:{token_id}"


def _offsets(token_ids):
    """Where each token starts in the text: after the characters its earlier bytes decode to,
    less the one its byte is part of when it adds no character of its own."""
    offsets, data = [], b""
    for token_id in token_ids:
        byte = bytes([token_id]) if token_id < 256 else b""
        before = len(data.decode(errors="replace"))
        grows = len((data + byte).decode(errors="replace")) > before
        offsets.append(before - (bool(byte) and not grows))
        data += byte
    return offsets


def test_completion_logprobs_are_the_engines_in_openai_form(client, expected_logprobs):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=3,
                                    **GREEDY)
    logprobs, entries = out.choices[0].logprobs, expected_logprobs.logprobs
    assert logprobs.tokens == [_name(e.token_id) for e in entries]
    assert logprobs.token_logprobs == [e.logprob for e in entries]
    # each position's top 3 by name, and the sampled token (here the most likely one)
    assert logprobs.top_logprobs == [{_name(t): v for t, v in e.top} for e in entries]
    assert logprobs.text_offset == _offsets([e.token_id for e in entries])
    text = out.choices[0].text
    assert max(logprobs.text_offset) <= len(text)
    # a token of whole characters starts on them, also after bytes that made no character
    # (the greedy text holds "\ufffd\x13": bytes E3 88, then 13)
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        if not token.startswith("token_id:"):
            assert text[offset:offset + len(token)] == token


def test_streamed_completion_logprobs_add_up_to_the_whole(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, logprobs=2,
                                      **GREEDY).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, logprobs=2, stream=True, **GREEDY)]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c.logprobs, field)] == getattr(whole, field)


def test_chat_logprobs_name_each_token_its_bytes_and_the_top_ones(client):
    hi = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model="tiny", messages=hi, max_tokens=12,
                                         logprobs=True, top_logprobs=2, **GREEDY)
    same = client.completions.create(model="tiny", prompt=[256, *b"user: hi\nassistant:"],
                                     max_tokens=12, logprobs=2, **GREEDY).choices[0].logprobs
    content = out.choices[0].logprobs.content
    texts = [_text(int(t.removeprefix("token_id:"))) if t.startswith("token_id:") else t
             for t in same.tokens]  # chat names every token by its text
    assert [c.token for c in content] == texts
    # the second request hits the first's prompt pages and computes its last prompt token
    # alone: another shape for the matrix products, so the logprobs may differ in the 6th digit
    assert [c.logprob for c in content] == pytest.approx(same.token_logprobs, abs=1e-4)
    assert [c.bytes for c in content] == [None if t == "\ufffd" else list(t.encode())
                                          for t in texts]
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, c.logprob)
    streamed = client.chat.completions.create(model="tiny", messages=hi, max_tokens=12,
                                              logprobs=True, top_logprobs=2, stream=True,
                                              **GREEDY)
    parts = [c.choices[0].logprobs for c in streamed]
    assert parts[0] is None  # the role chunk
    streamed_content = [x for p in parts if p for x in p.content]
    assert [c.token for c in streamed_content] == [c.token for c in content]
    assert ([c.logprob for c in streamed_content]
            == pytest.approx([c.logprob for c in content], abs=1e-4))


def test_logprobs_end_where_a_stop_string_ends_the_choice(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32,
                                    stop=["\u066e{"], logprobs=0, **GREEDY)
    assert len(out.choices[0].logprobs.tokens) == out.usage.completion_tokens == 11


def test_without_logprobs_choices_carry_none(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, **GREEDY)
    assert out.choices[0].logprobs is None


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client):
    prompt = list(range(40))  # two full pages of 16 tokens can be served the second time
    first, second = (client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
                     for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32


def test_models_lists_the_served_model_and_health_answers(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].max_model_len == 512
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_parse_and_counters_move_as_requests_complete(server, client):
    before = metrics(server)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7, **GREEDY)
    after = metrics(server)
    assert after["kvpool_requests_total", (("finish_reason", "length"),)] - before.get(
        ("kvpool_requests_total", (("finish_reason", "length"),)), 0) == 1
    assert after["kvpool_prompt_tokens_total", ()] - before["kvpool_prompt_tokens_total", ()] == 9
    assert (after["kvpool_generation_tokens_total", ()]
            - before["kvpool_generation_tokens_total", ()]) == 7
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        count = f"kvpool_{name}_count", ()
        assert after[count] - before[count] == 1
    assert after["kvpool_prefix_cache_queries_total", ()] > before[
        "kvpool_prefix_cache_queries_total", ()]
    assert after["kvpool_pages_used", ()] == 0
    assert after["kvpool_pages_used", ()] + after["kvpool_pages_cached", ()] + after[
        "kvpool_pages_free", ()] == 24
    for name in ("kv_utilization", "sequences_running", "sequences_waiting",
                 "preemptions_total", "prefix_cache_hits_total"):
        assert (f"kvpool_{name}", ()) in after


def test_metrics_record_each_value_where_it_belongs():
    server_metrics = ServerMetrics()
    # a request of n=2 whose first choice ended on a stop token after 5 tokens: 8 in all
    server_metrics.record(RequestTimes(arrival=10.0, scheduled=10.5, first_token=11.0,
                                       finish=13.0, choices=(ChoiceTimes(11.0, 13.0, 5),
                                                             ChoiceTimes(11.0, 11.6, 3))),
                          "stop", 9, 8)
    engine = EngineStats(num_running=0, num_waiting=0, num_used_pages=1, num_cached_pages=3,
                         num_free_pages=20, kv_utilization=0.5, prefix_hit_rate=0.25,
                         num_preemptions=0, num_steps=7, num_prompt_tokens=9,
                         num_generated_tokens=8, elapsed=1.0, prefix_query_tokens=64,
                         prefix_hit_tokens=16)
    text = server_metrics.render([EngineSnapshot(engine)]).decode()
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    assert values["kvpool_requests_total", (("finish_reason", "stop"),)] == 1
    assert ("kvpool_requests_total", (("finish_reason", "length"),)) not in values
    assert values["kvpool_generation_tokens_total", ()] == 8
    # 2 s / 4 tokens, and 0.6 s / 2 tokens
    assert values["kvpool_time_per_output_token_seconds_sum", ()] == pytest.approx(0.8)
    assert values["kvpool_time_per_output_token_seconds_count", ()] == 2
    assert values["kvpool_time_to_first_token_seconds_sum", ()] == 1.0
    assert (values["kvpool_pages_used", ()], values["kvpool_pages_cached", ()],
            values["kvpool_pages_free", ()]) == (1, 3, 20)
    assert values["kvpool_prefix_cache_queries_total", ()] == 64
    assert values["kvpool_prefix_cache_hits_total", ()] == 16


def test_a_pairs_engines_are_labelled_by_side_and_bench_adds_them():
    stats = [EngineStats(num_running=0, num_waiting=0, num_used_pages=1, num_cached_pages=3,
                         num_free_pages=20, kv_utilization=0.5, prefix_hit_rate=0.25,
                         num_preemptions=0, num_steps=steps, num_prompt_tokens=9,
                         num_generated_tokens=8, elapsed=1.0, prefix_query_tokens=64,
                         prefix_hit_tokens=hits) for steps, hits in ((3, 16), (7, 32))]
    text = ServerMetrics().render([EngineSnapshot(stats[0], "prefill"),
                                   EngineSnapshot(stats[1], "decode")]).decode()
    values = {(s.name, tuple(s.labels.items())): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    assert values["kvpool_prefix_cache_hits_total", (("side", "prefill"),)] == 16
    assert values["kvpool_prefix_cache_hits_total", (("side", "decode"),)] == 32
    assert ("kvpool_prefix_cache_hits_total", ()) not in values
    added = samples_by_name(text)
    assert (added["kvpool_prefix_cache_hits_total"], added["kvpool_engine_steps_total"]) == (
        48, 10)


def test_time_per_output_token_is_observed_per_choice_from_its_own_tokens():
    # n=2, a token every 10 ms: choice 0 ends on a stop string with its 3rd token, while
    # choice 1 runs on to its 6th
    generation = Generation("r", "m", num_prompt_tokens=1, n=2, stop=("X",), chat=False,
                            include_usage=False, logprobs=None, token_text=str)
    for step in range(1, 7):
        last = step == 6
        samples = [Sample(0, "aaX"[:step] + "a" * (step - 3), step, None, None),
                   Sample(1, "b" * step, step, "length" if last else None, None)]
        generation.update(Update("r", last, 0, 10.0, samples), now=10.0 + step / 100)
    server_metrics = ServerMetrics()
    server_metrics.record(generation.times(arrival=10.0, finish=10.07), "stop", 1, 9)
    value = server_metrics.registry.get_sample_value
    assert value("kvpool_time_per_output_token_seconds_count") == 2
    # (10.03 - 10.01) s / 2 tokens and (10.06 - 10.01) s / 5 tokens
    assert value("kvpool_time_per_output_token_seconds_sum") == pytest.approx(0.02)
    assert value("kvpool_time_to_first_token_seconds_sum") == pytest.approx(0.01)


def test_a_request_of_n_2_observes_a_time_per_output_token_for_each_choice(server, client):
    count = "kvpool_time_per_output_token_seconds_count", ()
    before = metrics(server)[count]
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, seed=1,
                              extra_body={"ignore_eos": True})
    assert metrics(server)[count] - before == 2


BAD_REQUESTS = [
    ("not json", "{", 400, None, None,
     "the request body is not valid JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)"),
    ("unknown model", {"model": "gpt-4", "prompt": "x"}, 400, "model", "model_not_found",
     "model 'gpt-4' does not exist; this server serves 'tiny'"),
    ("max_tokens of the wrong type", {"model": "tiny", "prompt": "x", "max_tokens": "5"},
     400, "max_tokens", None, "max_tokens must be an integer, got '5'"),
    ("max_tokens out of range", {"model": "tiny", "prompt": "x", "max_tokens": 0},
     400, "max_tokens", None, "max_tokens must be >= 1, got 0"),
    ("temperature out of range", {"model": "tiny", "prompt": "x", "temperature": 2.5},
     400, "temperature", None, "temperature must be in [0, 2], got 2.5"),
    ("top_p of zero", {"model": "tiny", "prompt": "x", "top_p": 0},
     400, "top_p", None, "top_p must be in (0, 1], got 0"),
    ("empty prompt", {"model": "tiny", "prompt": []}, 400, "prompt", None,
     "prompt must be a non-empty string or a non-empty list of token ids, got []"),
    ("token id outside the vocabulary", {"model": "tiny", "prompt": [1, 300]}, 400, "prompt",
     None, "prompt token ids must be ints in [0, 258), got 300"),
    ("negative token id", {"model": "tiny", "prompt": [1, -1]}, 400, "prompt", None,
     "prompt token ids must be ints in [0, 258), got -1"),
    ("token id past int64", {"model": "tiny", "prompt": [2**64]}, 400, "prompt", None,
     "prompt token ids must be ints in [0, 258), got 18446744073709551616"),
    ("stop token id past int64", {"model": "tiny", "prompt": "x", "stop_token_ids": [2**63]},
     400, "stop_token_ids", None,
     "stop_token_ids must be a list of token ids (ints in [0, 2**63)), got [9223372036854775808]"),
    ("seed past 64 bits", {"model": "tiny", "prompt": "x", "n": 2, "seed": 2**64}, 400,
     "seed", None, "seed must be <= 18446744073709551615, got 18446744073709551616"),
    ("prompt longer than max_model_len", {"model": "tiny", "prompt": [1] * 600},
     400, "prompt", "context_length_exceeded",
     "prompt of 600 tokens + max_tokens 16 = 616 tokens, over max_model_len 512"),
    ("a sample the pool can never hold", {"model": "tiny", "prompt": [1] * 100,
                                          "max_tokens": 300}, 400, "max_tokens", None,
     "prompt of 100 tokens + max_tokens 300: 399 tokens need 25 pages of 16 tokens; "
     "the pool has 24"),
    ("a prompt the pool can never hold", {"model": "tiny", "prompt": [1] * 400,
                                          "max_tokens": 1}, 400, "prompt",
     "context_length_exceeded",
     "prompt of 400 tokens + max_tokens 1: 400 tokens need 25 pages of 16 tokens; "
     "the pool has 24"),
    ("n beyond max_num_seqs", {"model": "tiny", "prompt": "x", "n": 9}, 400, "n", None,
     "n=9 samples exceed max_num_seqs 8"),
    # a 400, not a 503 with Retry-After: however long a client waits, it can never run
    ("n far beyond max_num_seqs", {"model": "tiny", "prompt": "x", "n": 10**6}, 400, "n",
     None, "n=1000000 samples exceed max_num_seqs 8"),
    ("logprobs over 20", {"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs",
     None, "logprobs must be <= 20, got 21"),
    ("top_logprobs in a completion", {"model": "tiny", "prompt": "x", "top_logprobs": 2},
     400, "top_logprobs", None,
     "top_logprobs is a chat completions field; completions take logprobs (an int)"),
    ("top_logprobs without logprobs", {"model": "tiny", "top_logprobs": 2,
                                       "messages": [{"role": "user", "content": "hi"}]},
     400, "top_logprobs", None, "top_logprobs (2) needs logprobs set to true"),
    ("echo", {"model": "tiny", "prompt": "x", "echo": True}, 400, "echo", "unsupported",
     "echo is not supported by this server, got True"),
    ("messages missing", {"model": "tiny"}, 400, "messages", None,
     "messages must be a non-empty list, got None"),
    ("logit_bias", {"model": "tiny", "prompt": "x", "logit_bias": {"65": 100}}, 400,
     "logit_bias", "unsupported", "logit_bias is not supported by this server, got {'65': 100}"),
    ("frequency_penalty", {"model": "tiny", "prompt": "x", "frequency_penalty": 0.5}, 400,
     "frequency_penalty", "unsupported",
     "frequency_penalty is not supported by this server, got 0.5"),
    ("presence_penalty", {"model": "tiny", "prompt": "x", "presence_penalty": -1}, 400,
     "presence_penalty", "unsupported",
     "presence_penalty is not supported by this server, got -1"),
    ("tools", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
               "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "unsupported", "tools is not supported by this server, got [{'type': 'function', "
                    "'function': {'name': 'f'}}]"),
    ("response_format", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                         "response_format": {"type": "json_object"}}, 400, "response_format",
     "unsupported",
     "response_format is not supported by this server, got {'type': 'json_object'}"),
    ("prompt_logprobs 0", {"model": "tiny", "prompt": "x", "prompt_logprobs": 0}, 400,
     "prompt_logprobs", "unsupported", "prompt_logprobs is not supported by this server, got 0"),
    ("include_stop_str_in_output", {"model": "tiny", "prompt": "x", "stop": "a",
                                    "include_stop_str_in_output": True}, 400,
     "include_stop_str_in_output", "unsupported",
     "include_stop_str_in_output is not supported by this server, got True"),
    ("chat_template_kwargs", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"enable_thinking": False}}, 400,
     "chat_template_kwargs", "unsupported",
     "chat_template_kwargs is not supported by this server, got {'enable_thinking': False}"),
    ("allowed_token_ids", {"model": "tiny", "prompt": "x", "allowed_token_ids": [65]}, 400,
     "allowed_token_ids", "unsupported",
     "allowed_token_ids is not supported by this server, got [65]"),
    ("bad_words", {"model": "tiny", "prompt": "x", "bad_words": ["a"]}, 400, "bad_words",
     "unsupported", "bad_words is not supported by this server, got ['a']"),
    ("a chat prompt that leaves no room, without max_tokens", {
        "model": "tiny", "messages": [{"role": "user", "content": "a" * 500}]}, 400,
     "messages", "context_length_exceeded",
     "prompt of 518 tokens leaves no room for a completion: a sequence holds at most 385 tokens"),
    ("a message's tool_calls", {"model": "tiny", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, 400,
     "messages[1].tool_calls", "unsupported",
     "messages[1].tool_calls is not supported by this server, got [{'id': '1'}]"),
    ("a lone surrogate in a prompt", {"model": "tiny", "prompt": "a\ud800"}, 400, "prompt",
     None, "prompt is not valid Unicode: it holds a lone surrogate (U+D800) at character 1"),
    ("a lone surrogate in a message", {"model": "tiny", "messages": [
        {"role": "user", "content": "\udfff"}]}, 400, "messages[0].content", None,
     "messages[0].content is not valid Unicode: it holds a lone surrogate (U+DFFF) at "
     "character 0"),
    ("a body nested 100,000 deep", "[" * 100_000 + "]" * 100_000, 400, None, None,
     "the request body is nested too deeply to parse"),
    ("too many stop strings", {"model": "tiny", "prompt": "x", "stop": ["a"] * 17}, 400,
     "stop", None, "stop holds 17 strings; this server takes 16 at most"),
    ("a stop string too long", {"model": "tiny", "prompt": "x", "stop": "a" * 257}, 400,
     "stop", None, "a stop string of 257 characters passes this server's limit of 256"),
    ("too many stop token ids", {"model": "tiny", "prompt": "x", "stop_token_ids": [5] * 257},
     400, "stop_token_ids", None, "stop_token_ids holds 257 ids; this server takes 256 at most"),
    ("an empty cache_salt", {"model": "tiny", "prompt": "x", "cache_salt": ""}, 400,
     "cache_salt", None, "cache_salt must be a non-empty string, got ''"),
    ("a batch of two prompts", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt", None,
     "prompt must be a non-empty string or a non-empty list of token ids, got ['a', 'b']"),
    ("a batch of two token lists", {"model": "tiny", "prompt": [[1, 2], [3]]}, 400, "prompt",
     None, "prompt must be a non-empty string or a non-empty list of token ids, got "
           "[[1, 2], [3]]"),
    ("booleans for token ids", {"model": "tiny", "prompt": [True, False]}, 400, "prompt", None,
     "prompt must be a non-empty string or a non-empty list of token ids, got [True, False]"),
    ("an empty prompt string", {"model": "tiny", "prompt": ""}, 400, "prompt", None,
     "prompt must not be empty"),
    ("a message's name", {"model": "tiny", "messages": [
        {"role": "user", "content": "hi", "name": "bob"}]}, 400, "messages[0].name",
     "unsupported", "messages[0].name is not supported by this server, got 'bob'"),
    ("a lone surrogate in a stop string", {"model": "tiny", "prompt": "x",
                                           "stop": ["a", "\ud800"]}, 400, "stop", None,
     "stop is not valid Unicode: it holds a lone surrogate (U+D800) at character 0"),
    ("an empty stop string", {"model": "tiny", "prompt": "x", "stop": ["a", ""]}, 400, "stop",
     None, "stop must be a non-empty string or a list of them, got ['a', '']"),
    ("a negative stop token id", {"model": "tiny", "prompt": "x", "stop_token_ids": [-1]},
     400, "stop_token_ids", None,
     "stop_token_ids must be a list of token ids (ints in [0, 2**63)), got [-1]"),
    ("top_k below -1", {"model": "tiny", "prompt": "x", "top_k": -2}, 400, "top_k", None,
     "top_k must be >= -1, got -2"),
    ("add_special_tokens of the wrong type", {"model": "tiny", "prompt": "x",
                                              "add_special_tokens": 0}, 400,
     "add_special_tokens", None, "add_special_tokens must be a boolean, got 0"),
]

# Each field the server cannot honour, with a value that asks for something.
UNSUPPORTED = {
    "echo": True, "suffix": "x", "best_of": 2, "logit_bias": {"65": 1},
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.1,
    "min_tokens": 2, "tools": [{"type": "function"}], "tool_choice": "required",
    "functions": [{"name": "f"}], "function_call": {"name": "f"},
    "response_format": {"type": "json_object"}, "prompt_logprobs": 0,
    "use_beam_search": True, "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a"], "guided_grammar": "root ::= 'a'",
    "structured_outputs": {"regex": "a"}, "prediction": {"type": "content"},
    "audio": {"voice": "x"}, "modalities": ["audio"], "include_stop_str_in_output": True,
    "truncate_prompt_tokens": 4, "add_generation_prompt": False,
    "continue_final_message": True, "chat_template_kwargs": {"x": 1},
    "skip_special_tokens": False, "length_penalty": 2, "spaces_between_special_tokens": False,
    "allowed_token_ids": [65], "bad_words": ["a"], "logits_processors": ["f"],
    "return_tokens_as_token_ids": True, "chat_template": "{{ messages[0]['content'] }}",
    "documents": [{"title": "t", "text": "x"}], "mm_processor_kwargs": {"num_crops": 4},
    "structural_tag": "{}", "prompt_embeds": "AAAA", "reasoning_effort": "high",
    "web_search_options": {},
}

# Fields that hold a neutral value's equal of another JSON type: asking for something else.
NEUTRAL_OF_ANOTHER_TYPE = {"best_of": True, "echo": 0, "frequency_penalty": False,
                           "skip_special_tokens": 1, "include_stop_str_in_output": 0}


@pytest.mark.parametrize("body, status, param, code, message",
                         [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_a_bad_request_gets_an_openai_error_and_the_server_still_answers(
        server, client, body, status, param, code, message):
    chat = isinstance(body, dict) and "prompt" not in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{server.url}{path}", content=content)
    assert response.status_code == status
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error",
                                         "param": param, "code": code}}
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).choices


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_an_unsupported_field_asking_for_something_is_refused(name):
    for parse, body in ((parse_completion, {"prompt": "x"}),
                        (parse_chat, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(RequestError) as info:
            parse({"model": "tiny", **body, name: UNSUPPORTED[name]}, "tiny", ServerLimits())
        assert (info.value.status, info.value.param, info.value.code) == (
            400, name, "unsupported")


@pytest.mark.parametrize("name", NEUTRAL_OF_ANOTHER_TYPE)
def test_a_neutral_value_of_another_type_is_refused(name):
    value = NEUTRAL_OF_ANOTHER_TYPE[name]
    with pytest.raises(RequestError) as info:
        parse_completion({"model": "tiny", "prompt": "x", name: value}, "tiny", ServerLimits())
    assert (info.value.param, info.value.code, info.value.message) == (
        name, "unsupported", f"{name} is not supported by this server, got {value!r}")


def test_add_special_tokens_false_leaves_the_bos_out_of_a_text_prompt(server, client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                    extra_body={**GREEDY["extra_body"],
                                                "add_special_tokens": False},
                                    temperature=0)
    assert out.usage.prompt_tokens == len(PROMPT)
    assert out.choices[0].text == _greedy_text(client, list(PROMPT.encode()), 8)


def test_add_special_tokens_in_a_chat_overrides_the_templates_choice(client):
    hi = [{"role": "user", "content": "hi"}]
    # the fallback template spells no BOS, so the tokenizer adds it unless told not to
    usage = [client.chat.completions.create(
        model="tiny", messages=hi, max_tokens=1, extra_body=extra).usage.prompt_tokens
        for extra in ({}, {"add_special_tokens": False}, {"add_special_tokens": True})]
    assert usage == [len(b"user: hi\nassistant:") + 1, len(b"user: hi\nassistant:"),
                     len(b"user: hi\nassistant:") + 1]


def test_stop_strings_and_stop_token_ids_up_to_the_limits_are_taken(server):
    limits = ServerLimits()
    for stop in ({"stop": ["a"] * limits.max_stop_strings},
                 {"stop": "a" * limits.max_stop_length},
                 {"stop_token_ids": list(range(limits.max_stop_token_ids))}):
        response = httpx.post(f"{server.url}/v1/completions", json={
            "model": "tiny", "prompt": "x", "max_tokens": 1, **stop})
        assert response.status_code == 200, response.text


def test_unsupported_fields_holding_their_neutral_values_are_accepted(server):
    neutral = {"echo": False, "best_of": 1, "frequency_penalty": 0, "presence_penalty": 0.0,
               "skip_special_tokens": True,
               "include_stop_str_in_output": False, "chat_template_kwargs": {},
               "prompt_logprobs": None, "max_tokens": 1}
    for path, body in (("completions", {"prompt": "x"}), ("chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True})):
        response = httpx.post(f"{server.url}/v1/{path}",
                              json={"model": "tiny", **body, **neutral})
        assert response.status_code == 200, response.text


def test_a_wrong_method_gets_405_with_the_allowed_methods(server):
    response = httpx.get(f"{server.url}/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["message"] == "Method Not Allowed"


def test_bench_url_reports_a_refusal_on_one_line(server, capsys):
    assert main(["bench", "--url", f"{server.url}/nowhere", "--num-requests", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool bench: error: GET /nowhere/v1/models: the server answered "
                          "404") and err.count("\n") == 1


def test_bench_url_sends_the_bench_workload_through_the_server(server, capsys):
    # the API root, as `kvpool serve` prints it (test_server_limits.py passes the server's)
    argv = ["bench", "--url", f"{server.url}/v1/", "--num-requests", "8", "--prompt-len", "16",
            "--output-len", "8"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines)
    assert list(table) == ["model", "url", "requests", "prompt tokens", "generated tokens",
                           "wall time", "generated tok/s", "total tok/s", "TTFT p50 / p99",
                           "TPOT p50 / p99", "prefix hit rate", "preemptions"]
    # the workload of `kvpool bench` with these options: 494 prompt tokens, 111 generated
    assert (table["model"], table["requests"], table["prompt tokens"]) == ("tiny", "8", "494")
    assert table["generated tokens"] == "111"


def _greedy_text(client, prompt, max_tokens):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                     **GREEDY).choices[0].text
