"""`kvpool bench` and `kvpool generate`: the seeded, long-tailed workload with shared system
prompts, the summary table, preemption on a small pool, the plot, streamed generation."""

import os
import re
import statistics
import sys

import pytest

from engine_probes import poison_sampling
from kvpool.cli.bench import (
    OUTPUT_LEN,
    PROMPT_LEN,
    BenchResult,
    RequestTiming,
    Workload,
    check_lengths,
    make_workload,
    summary_rows,
    write_plot,
)
from kvpool.cli.main import main
from kvpool.engine import LLM, EngineStats, SamplingParams
from kvpool.errors import StepFailed
from kvpool.formats import VISIBLE_CONTROLS

TINY_VOCAB = 258
# 8 short requests: 494 prompt tokens, 111 generated, 16 pages for the largest.
SMALL = ["--num-requests", "8", "--prompt-len", "16", "--output-len", "8"]
SMALL_WORKLOAD = Workload(8, PROMPT_LEN.with_median(16), OUTPUT_LEN.with_median(8))
ROWS = ["model", "requests", "prompt tokens", "generated tokens", "wall time", "generated tok/s",
        "total tok/s", "TTFT p50 / p99", "TPOT p50 / p99", "peak pages used", "pool pages",
        "KV utilization", "prefix hit rate", "tier pages", "preemptions"]


def bench_table(capsys, *argv: str) -> dict[str, str]:
    """Run `kvpool bench ARGV` (which must succeed); its table as {label: value}."""
    assert main(["bench", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines if "  " in line)


def poisoned_llm(*args, **kwargs) -> LLM:
    """An LLM whose requests of max_tokens 7 fail in their first step (engine_probes)."""
    llm = LLM(*args, **kwargs)
    poison_sampling(llm)
    return llm


def number(text: str) -> float:
    """The first number in a table value, e.g. 1234.5 from "1,234.5 / 2,000.0 ms"."""
    return float(re.match(r"[\d,.]+", text).group().replace(",", ""))


def user_lengths(workload: Workload) -> list[int]:
    return [len(r.prompt_token_ids) for r in make_workload(workload, TINY_VOCAB)]


def test_workload_is_seeded():
    assert make_workload(Workload(50, seed=3), 100) == make_workload(Workload(50, seed=3), 100)
    assert make_workload(Workload(50, seed=3), 100) != make_workload(Workload(50, seed=4), 100)


def test_workload_lengths_do_not_depend_on_the_vocabulary():
    small, large = make_workload(Workload(50), TINY_VOCAB), make_workload(Workload(50), 32000)
    assert [len(r.prompt_token_ids) for r in small] == [len(r.prompt_token_ids) for r in large]
    assert [r.max_tokens for r in small] == [r.max_tokens for r in large]
    assert max(t for r in small for t in r.prompt_token_ids) < TINY_VOCAB


def test_workload_prompt_lengths_are_long_tailed_and_capped():
    lengths = user_lengths(Workload(2000, shared_fraction=0.0))
    assert 85 <= statistics.median(lengths) <= 115
    assert statistics.mean(lengths) > 1.4 * statistics.median(lengths)
    assert statistics.quantiles(lengths, n=100)[98] > 8 * statistics.median(lengths)
    assert min(lengths) >= 1 and max(lengths) == PROMPT_LEN.maximum == 1000


def test_workload_output_lengths_are_long_tailed_and_capped():
    outputs = [r.max_tokens for r in make_workload(Workload(2000), TINY_VOCAB)]
    assert 42 <= statistics.median(outputs) <= 58
    assert statistics.mean(outputs) > 1.4 * statistics.median(outputs)
    assert min(outputs) >= 1 and max(outputs) == OUTPUT_LEN.maximum == 400


def test_workload_with_median_scales_the_cap():
    assert PROMPT_LEN.with_median(10).maximum == 100
    assert OUTPUT_LEN.with_median(5).maximum == 40


def test_about_30_percent_of_prompts_start_with_one_of_5_system_prompts():
    requests = make_workload(Workload(2000), TINY_VOCAB)
    shared = [r for r in requests if r.system_prompt is not None]
    assert 0.25 < len(shared) / len(requests) < 0.35
    assert {r.system_prompt for r in shared} == set(range(5))
    for index in range(5):
        prompts = [r.prompt_token_ids for r in shared if r.system_prompt == index]
        common = len(os.path.commonprefix(prompts))
        assert 64 <= common <= 256 + 2  # random user parts rarely share a first token


def test_workload_arrivals_all_at_zero_or_poisson():
    assert {r.arrival for r in make_workload(Workload(20), TINY_VOCAB)} == {0.0}
    arrivals = [r.arrival for r in make_workload(Workload(2000, request_rate=10.0), TINY_VOCAB)]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert 0.09 < arrivals[-1] / (len(arrivals) - 1) < 0.11


def test_bench_prints_every_row_with_plausible_numbers(capsys):
    table = bench_table(capsys, *SMALL, "--no-plot")
    assert list(table) == ROWS
    requests = make_workload(SMALL_WORKLOAD, TINY_VOCAB)
    assert table["requests"] == "8"
    assert number(table["prompt tokens"]) == sum(len(r.prompt_token_ids) for r in requests)
    assert number(table["generated tokens"]) == sum(r.max_tokens for r in requests) == 111
    assert number(table["wall time"]) > 0 and number(table["generated tok/s"]) > 0
    assert number(table["total tok/s"]) > number(table["generated tok/s"])
    for row in ("TTFT p50 / p99", "TPOT p50 / p99"):
        p50, p99 = (float(x.replace(",", "")) for x in re.findall(r"[\d,.]+", table[row])[:2])
        assert 0 < p50 <= p99
    assert table["pool pages"].startswith("384 x 16 tokens = 6,144 tokens")
    assert 0 < number(table["peak pages used"]) <= 384
    assert 0 < number(table["KV utilization"]) <= 100
    assert table["prefix hit rate"].endswith("looked-up prompt tokens)")
    assert table["preemptions"] == "0"


def test_bench_on_a_small_pool_preempts_and_still_generates_every_token(capsys, monkeypatch,
                                                                       tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    table = bench_table(capsys, *SMALL, "--num-pages", "20", "--no-prefix-caching",
                        "--plot", str(tmp_path / "pool.png"))
    assert number(table["preemptions"]) > 0
    assert number(table["generated tokens"]) == 111
    assert number(table["peak pages used"]) <= 20
    assert table["prefix hit rate"] == "off"
    assert table["tier pages"] == "off"
    assert table["plot"].startswith("pip install 'kvpool[plot]'")
    assert not (tmp_path / "pool.png").exists()


def test_bench_with_a_host_tier_counts_its_pages(capsys):
    table = bench_table(capsys, *SMALL, "--num-pages", "20", "--host-tier-memory", "4MiB",
                        "--no-plot")
    counts = {name: number(n) for n, name in re.findall(r"(\d[\d,]*) (\w+)",
                                                         table["tier pages"])}
    assert list(counts) == ["stored", "loaded", "missed", "dropped"]
    assert counts["stored"] > 0 and counts["dropped"] == 0
    assert table["tier pages"].endswith("(host_tier_memory)")
    assert table["prefix hit rate"].endswith("looked-up prompt tokens)")


def test_bench_with_fp8_pages_in_a_tier_takes_the_scales_given(capsys):
    """fp8 pages in a tier need scales given (a cache's first prefill would calibrate others
    than its peers'): --kv-scales gives them, one pair for every layer."""
    fp8_tier = [*SMALL, "--num-pages", "20", "--host-tier-memory", "4MiB", "--no-plot",
                "--kv-cache-dtype", "fp8_e4m3"]
    assert main(["bench", *fp8_tier]) == 2
    assert "fp8 pages in a tier need kv_scales given" in capsys.readouterr().err
    table = bench_table(capsys, *fp8_tier, "--kv-scales", "0.02,0.03")
    assert number(table["tier pages"]) > 0  # stored
    assert main(["bench", *fp8_tier, "--kv-scales", "0.02"]) == 2  # one number: MLA only
    assert "must be a (k_scale, v_scale) pair, got 0.02" in capsys.readouterr().err
    for bad in ("0.02,0.03,1", "k,v"):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", *fp8_tier, "--kv-scales", bad])
        assert exit_.value.code == 2
        assert f"expected K,V (two numbers) or one number, got '{bad}'" in capsys.readouterr().err


def test_bench_errors_are_one_line_on_stderr_with_exit_2(capsys):
    assert main(["bench", "--model", "no/such/folder", "--no-plot"]) == 2
    # eager: on CUDA the graph capture would draw its progress bar on stderr first
    assert main(["bench", *SMALL, "--num-pages", "4", "--no-plot", "--enforce-eager"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kvpool bench: error: no config at 'no/such/folder'")
    assert err[1].startswith("kvpool bench: error: prompt of 56 tokens + max_tokens 19: "
                             "74 tokens need 5 pages")
    assert len(err) == 2


def test_bench_refuses_a_request_the_pool_could_never_hold_before_the_run(capsys):
    """At 10 requests/s the second request (183 prompt tokens, max_tokens 2) arrives 15 ms
    after the first, which fits: it is refused before the run starts, not at its arrival."""
    assert main(["bench", *SMALL, "--request-rate", "10", "--num-pages", "10", "--no-plot"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("kvpool bench: error: prompt of 183 tokens + max_tokens 2: 184 "
                            "tokens need 12 pages of 16 tokens; the pool has 10\n")


def test_bench_refuses_a_plot_of_a_server_it_cannot_see(capsys, tmp_path):
    plot = tmp_path / "pool.png"
    assert main(["bench", "--url", "http://127.0.0.1:9", "--plot", str(plot)]) == 2
    assert capsys.readouterr().err.startswith(f"kvpool bench: error: --plot '{plot}': the plot "
                                              f"shows the pool over the engine's steps")
    assert not plot.exists()


@pytest.mark.parametrize(("variable", "flag", "sent"), [
    (" alpha , beta", None, "alpha"), ("alpha", None, "alpha"), ("", None, None),
    ("alpha,beta", "gamma", "gamma"),
], ids=["two-keys", "one-key", "set-empty", "the-flag"])
def test_bench_url_sends_the_first_key_of_kvpool_api_key_as_serve_reads_it(
        capsys, monkeypatch, variable, flag, sent):
    import kvpool.cli.http_bench

    keys = []

    async def bench_url(url, requests_for, *, api_key=None):
        keys.append(api_key)
        return "tiny", []

    monkeypatch.setattr(kvpool.cli.http_bench, "bench_url", bench_url)
    monkeypatch.setenv("KVPOOL_API_KEY", variable)
    assert main(["bench", "--url", "http://127.0.0.1:9",
                 *(["--api-key", flag] if flag else [])]) == 0
    capsys.readouterr()
    assert keys == [sent]


def test_bench_url_refuses_a_kvpool_api_key_without_a_key(capsys, monkeypatch):
    monkeypatch.setenv("KVPOOL_API_KEY", " , ")
    assert main(["bench", "--url", "http://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err == ("kvpool bench: error: KVPOOL_API_KEY holds no key, only "
                                       "commas and whitespace; unset it to serve without one\n")


@pytest.mark.parametrize(("name", "message"), [
    ("missing/pool.png", "--plot '{path}': no folder '{folder}/missing'"),
    ("pool", "--plot '{path}' is not the path of a .png file"),
    ("pool.txt", "--plot '{path}' is not the path of a .png file"),
    ("folder.png", "--plot '{path}' is a folder"),
], ids=["missing-folder", "no-suffix", "txt-suffix", "a-folder"])
def test_bench_refuses_a_plot_path_it_cannot_write_before_the_run(capsys, tmp_path, name,
                                                                  message):
    (tmp_path / "folder.png").mkdir()
    path = tmp_path / name
    assert main(["bench", *SMALL, "--plot", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before the run
    assert captured.err == (f"kvpool bench: error: "
                            f"{message.format(path=path, folder=tmp_path)}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.png"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_bench_refuses_a_plot_in_a_read_only_folder_before_the_run(capsys, tmp_path):
    tmp_path.chmod(0o555)
    try:
        assert main(["bench", *SMALL, "--plot", str(tmp_path / "pool.png")]) == 2
    finally:
        tmp_path.chmod(0o755)
    captured = capsys.readouterr()
    assert captured.out == "" and "is not writable" in captured.err
    assert not any(tmp_path.iterdir())


def test_workload_num_requests_is_bounded():
    with pytest.raises(ValueError, match=r"num_requests must be in \[1, 1000000\], got 1000001"):
        Workload(1_000_001)


def test_write_plot_draws_the_pool_over_the_steps(tmp_path):
    pytest.importorskip("matplotlib")
    steps = [EngineStats(0, 0, used, cached, 10 - used - cached, 0.5, 0.0, 0, i, 0, 0, 0.1)
             for i, (used, cached) in enumerate([(2, 0), (6, 1), (3, 4)])]
    path = tmp_path / "pool.png"
    write_plot(BenchResult([], steps), str(path), "test")
    assert path.read_bytes().startswith(b"\x89PNG")


def test_generate_streams_the_same_text_as_the_engine(capsys):
    assert main(["generate", "--model", "tiny", "Hello", "--max-tokens", "12",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    params = SamplingParams(max_tokens=12, temperature=0)
    text = LLM("tiny", num_pages=8).generate("Hello", params, use_tqdm=False)[0].outputs[0].text
    assert text and out == text.translate(VISIBLE_CONTROLS) + "\n"
    assert all(c.isprintable() for c in out[:-1])


def test_generate_on_fp8_pages_streams_the_engines_text_under_the_scales_given(capsys):
    fp8 = {"kv_cache_dtype": "fp8_e4m3", "kv_scales": (0.02, 0.03)}
    assert main(["generate", "--model", "tiny", "Hello", "--max-tokens", "12",
                 "--temperature", "0", "--kv-cache-dtype", "fp8_e4m3",
                 "--kv-scales", "0.02,0.03"]) == 0
    params = SamplingParams(max_tokens=12, temperature=0)
    with LLM("tiny", num_pages=8, **fp8) as llm:
        text = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].text
        assert llm.cache.pool.kv_scales(0) == pytest.approx((0.02, 0.03))
    assert capsys.readouterr().out == text.translate(VISIBLE_CONTROLS) + "\n"


def test_generate_of_a_request_the_engine_fails_prints_its_error_and_exits_1(capsys,
                                                                          monkeypatch):
    import kvpool.cli.main

    monkeypatch.setattr(kvpool.cli.main, "LLM", poisoned_llm)
    assert main(["generate", "Hi", "--max-tokens", "7"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "\n"
    assert captured.err == ("kvpool generate: error: request '0' failed while sampling: "
                            "RuntimeError: injected\n")


def test_bench_counts_failed_requests_in_a_row_of_their_own_and_exits_1(capsys, monkeypatch):
    """With seed 2 the third of the 8 requests (87 prompt tokens, max_tokens 7) fails in its
    first step: it has no first token, and its tokens stay out of the figures."""
    import kvpool.cli.bench

    monkeypatch.setattr(kvpool.cli.bench, "LLM", poisoned_llm)
    assert main(["bench", *SMALL, "--seed", "2", "--no-plot"]) == 1
    captured = capsys.readouterr()
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in captured.out.splitlines())
    assert list(table) == [*ROWS[:2], "failed requests", *ROWS[2:]]
    assert table["failed requests"] == "1 (not in the tokens, throughput, TTFT and TPOT)"
    assert number(table["prompt tokens"]) == 379 - 87
    assert table["generated tokens"] == f"{132 - 7}"
    assert captured.err.splitlines()[-1] == ("kvpool bench: 1 of 8 requests failed; the first: "
                                             "request '2' failed while sampling: RuntimeError: "
                                             "injected")


def test_generate_bad_model_is_one_line_with_exit_2(capsys):
    assert main(["generate", "--model", "no/such/folder", "Hi"]) == 2
    assert capsys.readouterr().err.startswith("kvpool generate: error: no config at")



@pytest.mark.parametrize("command", [["generate", "--model", "tiny", "Hi", "--max-tokens", "4"],
                                     ["bench", *SMALL, "--no-plot"]])
def test_no_overlap_turns_overlap_scheduling_off(command, capsys, monkeypatch):
    import kvpool.cli.bench
    import kvpool.cli.main

    overlaps = []

    def recording_llm(*args, **kwargs):
        # Keeps the setting, not the engine: on a GPU each run's engine plans its pool from
        # the memory left free, which a kept engine would still hold.
        llm = LLM(*args, **kwargs)
        overlaps.append(llm.config.overlap)
        return llm

    for module in (kvpool.cli.bench, kvpool.cli.main):
        monkeypatch.setattr(module, "LLM", recording_llm)
    assert main([*command, "--no-overlap"]) == 0
    assert main(command) == 0
    capsys.readouterr()
    assert overlaps == [False, None]


def test_a_workload_is_cut_to_the_models_context():
    """Medians that fit, tails that would not: every request is cut to max_model_len."""
    workload = Workload(300, PROMPT_LEN.with_median(400), OUTPUT_LEN.with_median(200))
    uncut = make_workload(workload, TINY_VOCAB)
    assert max(len(r.prompt_token_ids) + r.max_tokens for r in uncut) > 1024
    cut = make_workload(workload, TINY_VOCAB, 1024)
    assert max(len(r.prompt_token_ids) + r.max_tokens for r in cut) <= 1024
    assert all(r.max_tokens >= 1 and r.prompt_token_ids for r in cut)


def test_a_cut_request_loses_user_prompt_tokens_before_output_tokens():
    """A request whose drawn lengths pass max_model_len keeps its output where the prompt
    can give way: only the user prompt is cut then."""
    workload = Workload(300, PROMPT_LEN.with_median(400), OUTPUT_LEN.with_median(200))
    uncut = make_workload(workload, TINY_VOCAB)
    cut = make_workload(workload, TINY_VOCAB, 1024)
    # requests too long whose output leaves room for a system prompt (<= 256) and a user token
    shortened = [(u, c) for u, c in zip(uncut, cut, strict=True)
                 if len(u.prompt_token_ids) + u.max_tokens > 1024 and u.max_tokens <= 512]
    assert shortened
    for u, c in shortened:
        assert c.max_tokens == u.max_tokens
        assert len(c.prompt_token_ids) + c.max_tokens == 1024


def test_a_system_prompt_is_dropped_only_when_it_leaves_no_room_for_two_tokens():
    """A system prompt of 30 tokens leaves room for one user and one output token in 32, not
    in 31: there the requests go without it, and every request still fits."""
    workload = Workload(20, shared_fraction=1.0, num_system_prompts=1, system_prompt_len=(30, 30))
    for max_model_len, system in ((32, 0), (31, None)):
        requests = make_workload(workload, TINY_VOCAB, max_model_len)
        assert {r.system_prompt for r in requests} == {system}
        assert all(len(r.prompt_token_ids) + r.max_tokens <= max_model_len for r in requests)


def test_check_lengths_accepts_medians_that_fill_max_model_len_exactly():
    workload = Workload(1, PROMPT_LEN.with_median(96), OUTPUT_LEN.with_median(32))
    check_lengths(workload, 128)
    with pytest.raises(ValueError, match="--prompt-len 96 \\+ --output-len 32 = 128 tokens, "
                                         "over the model's max_model_len 127"):
        check_lengths(workload, 127)


def test_tpot_is_the_time_per_output_token_after_the_first_and_none_for_one_token():
    assert RequestTiming(0.0, 0.2, 0.6, 5).tpot == pytest.approx(0.1)
    assert RequestTiming(0.0, 0.2, 0.2, 1).tpot is None


def test_ttft_is_none_without_a_first_token():
    assert RequestTiming(0.5, None, 0.7, 0, StepFailed("failed")).ttft is None
    assert RequestTiming(0.5).ttft is None


def test_summary_leaves_the_tokens_and_times_of_a_request_failed_part_way_out():
    timings = [RequestTiming(0.0, 0.2, 0.6, 5),
               RequestTiming(0.0, 0.1, 0.4, 4, StepFailed("request '1' failed"))]
    requests = make_workload(Workload(2, PROMPT_LEN.with_median(4), OUTPUT_LEN.with_median(2)),
                             TINY_VOCAB)
    with LLM("tiny", num_pages=32) as llm:
        rows = dict(summary_rows(llm, requests, BenchResult(timings, [llm.stats()], 1.0)))
    assert rows["failed requests"] == "1 (not in the tokens, throughput, TTFT and TPOT)"
    assert rows["TTFT p50 / p99"] == "200.0 / 200.0 ms"
    assert rows["TPOT p50 / p99"] == "100.0 / 100.0 ms"
    assert rows["generated tokens"] == "5" and rows["generated tok/s"] == "5.0"
    assert number(rows["prompt tokens"]) == len(requests[0].prompt_token_ids)


def test_summary_times_ttft_from_arrival_and_tpot_over_the_later_tokens():
    timings = [RequestTiming(0.0, 0.2, 0.6, 5), RequestTiming(0.1, 0.5, 0.5, 1)]
    requests = make_workload(Workload(2, PROMPT_LEN.with_median(4), OUTPUT_LEN.with_median(2)),
                             TINY_VOCAB)
    with LLM("tiny", num_pages=32) as llm:
        rows = dict(summary_rows(llm, requests, BenchResult(timings, [llm.stats()], 1.0)))
    assert rows["TTFT p50 / p99"] == "300.0 / 398.0 ms"  # of 200 and 400 ms
    assert rows["TPOT p50 / p99"] == "100.0 / 100.0 ms"  # the one-token request has none
    assert rows["generated tokens"] == "6"


def test_bench_passes_its_engine_flags_to_the_engine(capsys, monkeypatch, tmp_path):
    import kvpool.cli.bench

    configs = []

    def recording_llm(*args, **kwargs):
        llm = LLM(*args, **kwargs)
        configs.append(llm.config)
        return llm

    monkeypatch.setattr(kvpool.cli.bench, "LLM", recording_llm)
    table = bench_table(capsys, *SMALL, "--no-plot", "--page-size", "8", "--max-num-seqs", "3",
                        "--enforce-eager", "--disk-tier", str(tmp_path),
                        "--disk-tier-memory", "1MiB")
    (config,) = configs
    assert (config.page_size, config.max_num_seqs, config.enforce_eager) == (8, 3, True)
    assert (config.disk_tier, config.disk_tier_memory) == (str(tmp_path), 2**20)
    assert table["pool pages"].startswith("384 x 8 tokens = 3,072 tokens")
    assert table["tier pages"].endswith("(disk_tier)")


def test_generate_passes_its_sampling_flags_and_the_default_max_tokens_on(capsys, monkeypatch):
    import kvpool.cli.main

    seen = []

    def recording_llm(*args, **kwargs):
        llm = LLM(*args, **kwargs)
        add_request = llm.add_request

        def recording_add_request(prompt, params):
            seen.append((llm.config.seed, params))
            return add_request(prompt, params)

        llm.add_request = recording_add_request
        return llm

    monkeypatch.setattr(kvpool.cli.main, "LLM", recording_llm)
    assert main(["generate", "Hi", "--temperature", "0.5", "--top-p", "0.75", "--top-k", "5",
                 "--seed", "7"]) == 0
    capsys.readouterr()
    ((seed, params),) = seen
    assert seed == 7
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == \
        (64, 0.5, 0.75, 5)
