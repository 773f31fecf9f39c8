"""Tensor parallelism on the CPU with gloo, 2 ranks: the greedy tokens of small random Llama,
Qwen2 (one KV head, replicated), Qwen3, OLMo 2 (two KV heads or one), OLMo 3, Ernie 4.5,
GLM-4, EXAONE 4, Phi-3, Qwen3-MoE, Mixtral, GraniteMoeShared, DeepSeek-V3, GLM-4.5, Ernie 4.5
MoE, Gemma 3 (a full and a window pool) and GPT-OSS checkpoints equal transformers' (and so
one rank's) through preemption, prefix hits, chunks, copy-on-write and window drops;
per-rank planning; a dead or stuck worker fails the engine with an error naming it."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import queue
import re
import signal
import time
import types
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hybrid_util import BAMBA_CONFIGS
from kvpool.cache import HOLE, KVCache
from kvpool.cache.tiers import ROOT_KEY, HostTier, PageKey
from kvpool.cli.main import main
from kvpool.engine import LLM, SamplingParams, parallel
from kvpool.engine.config import EngineConfig
from kvpool.engine.handoff import PrefilledKV
from kvpool.engine.runner import StepLayout
from kvpool.errors import CheckpointError, ConfigError, RankFailed
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import pages_within
from kvpool.models import load_model
from kvpool.models.config import ModelConfig
from kvpool.models.parallel import TensorParallel
from kvpool.planning.planner import plan_memory
from models_util import (
    CONFIGS,
    SMALL,
    EngineCase,
    engine_case,
    fresh_process_output,
    make_hf_model,
    phi3_longrope,
    save_hf_model,
)
from net_util import (
    assert_private_while_open,
    beyond_loopback,
    gloo_default_device_beyond_loopback,
    listening_addresses,
    record_private_directories,
)
from test_deepseek import CONFIGS as DEEPSEEK_CONFIGS
from test_families import CONFIGS as FAMILIES
from test_gpt_oss import gpt_oss
from test_granite_hybrid import CONFIGS as GRANITE_HYBRID
from test_granite_moe import CONFIGS as GRANITE_MOE
from test_moe_families import CONFIGS as MOE_FAMILIES
from test_qwen3_moe import CONFIGS as QWEN3_MOE_CONFIGS
from test_qwen3_moe import MIXTRAL
from test_windows import GEMMA, GEMMA2

RANKS = 2
MAX_TOKENS = 6  # the longest request then needs 47 of the 64 slots: the batch preempts
PARITY = {
    "llama": CONFIGS["llama"],  # 4 heads, 2 KV heads: one each
    "qwen2-one-kv-head": lambda: transformers.Qwen2Config(**{**SMALL,
                                                            "num_key_value_heads": 1}),
    "qwen3": CONFIGS["qwen3"],
    # q and k normed across the heads of both ranks: each rank's sums of squares all-reduced
    "olmo2": CONFIGS["olmo2"],
    # ... with the one KV head on both ranks: its squares counted twice, over twice its width
    "olmo2-one-kv-head": lambda: transformers.Olmo2Config(**{**SMALL, "num_key_value_heads": 1},
                                                         attention_bias=True),
    # OLMo 2's norms across both ranks' heads, a window layer then a full one
    "olmo3": lambda: transformers.Olmo3Config(**SMALL, sliding_window=8, attention_bias=True,
                                              layer_types=["sliding_attention",
                                                           "full_attention"]),
    # each rank's q/k rows read each head's even rows, then its odd ones
    "ernie4_5": lambda: transformers.Ernie4_5Config(**SMALL, head_dim=16, use_bias=True),
    # ... of each head's rotated half only; four norms a layer, the fused gate/up split
    "glm4": lambda: transformers.Glm4Config(**SMALL, head_dim=16),
    # OLMo 2's layers with q/k normed per head on each rank, a window layer with RoPE then a
    # full one without
    "exaone4": lambda: transformers.Exaone4Config(**SMALL, sliding_window=8,
                                                  layer_types=["sliding_attention",
                                                               "full_attention"]),
    # each rank's rows of the fused q/k/v and gate/up; LongRoPE's short factors on every
    # rank, as the engine's max_model_len (ENGINE's) stays within the trained 64 positions
    "phi3": lambda: phi3_longrope(64, sliding_window=8, attention_bias=True),
    "qwen3-moe": QWEN3_MOE_CONFIGS["qwen3-moe"],
    "mixtral": MIXTRAL["mixtral-window-8"],  # experts under Mixtral's checkpoint names
    # each rank's rows of every expert's gate and up, read from the layer's stacked experts
    "granitemoe-shared": GRANITE_MOE["granitemoe-shared"],
    "deepseek-v3": DEEPSEEK_CONFIGS["v3-yarn"],
    # each rank's rows of every expert and of the shared experts, q/k normed per head
    "glm4-moe": MOE_FAMILIES["glm4-moe"],
    # each rank's q/k rows in Ernie 4.5's order, its rows of every expert and shared expert;
    # the router's [1, experts] bias whole
    "ernie4_5-moe": MOE_FAMILIES["ernie4_5-moe"],
    # test_windows' Gemma 3 in 2 layers, a window layer then a full one: a pool of each
    "gemma3": lambda: transformers.Gemma3TextConfig(**{**GEMMA, "num_hidden_layers": 2},
                                                   sliding_window_pattern=2),
    # Gemma 2 alike: each rank caps its heads' scores, the gathered logits are capped
    "gemma2": lambda: transformers.Gemma2Config(**{**GEMMA2, "num_hidden_layers": 2}),
    # each rank's heads' sinks, and its columns of every expert's interleaved gate and up;
    # a window of 16 tokens (of 4, too few pages stay held for the batch to preempt)
    "gpt-oss": lambda: gpt_oss(16),
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# 16 pages of 4 tokens and 16-token chunks: the batches preempt, hit prefixes and chunk
ENGINE = dict(num_pages=16, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64, tensor_parallel_size=RANKS)


def cpu_only(device: torch.device) -> None:
    if device.type != "cpu":
        pytest.skip("the tensor-parallel tests run 2 ranks on the CPU (gloo)")


@pytest.fixture(scope="module")
def cases(tmp_path_factory, device):
    """The EngineCase of a PARITY config by name, made at its first use: the module's tests
    of one config share its checkpoint and transformers' tokens."""
    made = {}

    def case(name: str) -> EngineCase:
        if name not in made:
            made[name] = engine_case(name, PARITY, tmp_path_factory.mktemp(name), device,
                                     MAX_TOKENS)
        return made[name]
    return case


@pytest.fixture(scope="module", params=list(PARITY))
def engine(request, cases, device):
    """(case, LLM of 2 ranks) for one config: 16 pages of 4 tokens, 16-token chunks; closed
    after the module's tests of that config."""
    cpu_only(device)
    case = cases(request.param)
    llm = LLM(case.folder, device=device, **ENGINE)
    yield case, llm
    llm.close()


def test_greedy_tokens_equal_one_rank_through_preemption_prefix_hits_and_chunks(engine):
    case, llm = engine
    outputs = llm.generate(case.batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == case.expected
    assert llm.stats().num_preemptions > 0
    assert llm.cache.stats().prefix_hit_tokens > 0
    llm.check()


def test_forked_samples_copy_their_shared_page_on_every_rank(engine):
    """n=2 greedy samples share the prompt's last page until each copies it (copy-on-write);
    a worker whose pool missed the copy would read another sample's K/V."""
    case, llm = engine
    before = llm.cache.stats().num_cow_copies
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(case.batch[:2], params, use_tqdm=False)
    assert llm.cache.stats().num_cow_copies > before
    for output, expected in zip(outputs, case.expected[:2], strict=True):
        assert [sample.token_ids for sample in output.outputs] == [expected] * 2


def test_each_rank_pool_holds_its_share_of_the_kv_heads(engine):
    case, llm = engine
    heads = llm.model_config.num_kv_heads
    for pool in llm.cache.kv_pools.pools:  # Gemma 3: the full and the window pool
        assert pool.layout.num_kv_heads == max(1, heads // RANKS)


@pytest.mark.parametrize("engine", ["gemma3"], indirect=True)
def test_window_drops_copy_the_same_pages_on_every_rank(engine):
    """A sequence leaving the window gives its first pages back, copying those the prefix
    cache holds to fresh pages of the window pool first; a worker whose window pool missed
    the copies would read other bits there."""
    case, llm = engine
    copied: list[int] = []
    window_pool = llm.cache.kv_pools.pools[1]
    window_pool.copy_listeners.append(lambda src, dst: copied.extend(dst))
    ids = [llm.add_request(prompt, GREEDY) for prompt in case.batch]
    outputs, dropped = {}, 0
    try:
        while llm.has_unfinished():
            for out in llm.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            dropped += sum(HOLE in llm.cache.pages(s, 1) for s in llm.cache.sequences())
    finally:
        window_pool.copy_listeners.pop()
    assert copied and dropped
    assert [outputs[i] for i in ids] == case.expected
    llm.check()


@pytest.mark.parametrize("engine", ["olmo2", "olmo2-one-kv-head"], indirect=True)
def test_olmo2_logprobs_equal_transformers_with_its_qk_norms_spanning_both_ranks(engine):
    """Each generated token's 5 likeliest log-probabilities equal transformers' within 1e-4:
    a mean square of q or k off by any factor, which may leave greedy tokens as they are,
    moves them."""
    case, llm = engine
    hf = transformers.AutoModelForCausalLM.from_pretrained(case.folder,
                                                           attn_implementation="eager")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outputs = llm.generate(case.batch, params, use_tqdm=False)
    for prompt, output in zip(case.batch, outputs, strict=True):
        sample = output.outputs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + sample.token_ids[:-1]])).logits[0]
        expected = logits[len(prompt) - 1:].log_softmax(dim=-1)
        for position, entry in enumerate(sample.logprobs):
            assert [token for token, _ in entry.top] == expected[position].topk(5).indices.tolist()
            for token, logprob in entry.top:
                assert logprob == pytest.approx(expected[position, token].item(), abs=1e-4)


@pytest.mark.parametrize("engine", ["llama"], indirect=True)
def test_kv_computed_elsewhere_is_refused_since_the_workers_would_not_get_it(engine):
    case, llm = engine
    request_id, _ = llm.hold_request(case.batch[0], GREEDY)
    assert not llm.takes_prefilled
    prefilled = PrefilledKV(1, torch.zeros(0), ())
    with pytest.raises(ValueError, match="on one rank.*tensor_parallel_size 2"):
        llm.resume_request(request_id, prefilled)
    llm.abort(request_id)


def test_each_rank_stores_and_loads_its_share_of_a_page_in_its_host_tier(cases, device):
    """The batch twice through 16 pages: the first run's prefix pages are evicted to the
    tiers (rank 0's share to its tier, the worker's to its own), the second run loads them
    back into the same pages on both ranks; a worker that missed either would compute with
    other K/V for its heads."""
    cpu_only(device)
    case = cases("llama")
    with LLM(case.folder, device=device, host_tier_memory=2**16, **ENGINE) as llm:
        for _ in range(2):
            outputs = llm.generate(case.batch, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == case.expected
        stats = llm.stats()
        assert stats.num_tier_stores > 0 and stats.num_tier_loads > 0
        llm.check()


def test_a_load_that_fails_on_rank_0_leaves_the_workers_next_load_right(cases, monkeypatch,
                                                                       device):
    """Rank 0's first load of the second run fails (a miss: computed again); the worker,
    which fetched its share of those pages, must not write them into the next load's."""
    cpu_only(device)
    case = cases("llama")
    with LLM(case.folder, device=device, host_tier_memory=2**16, **ENGINE) as llm:
        llm.generate(case.batch, GREEDY, use_tqdm=False)
        pool, loads = llm.cache.page_groups[0].pool, []
        write_pages = pool.write_pages

        def failing_once(pages, data):
            loads.append(len(pages))
            if len(loads) == 1:
                raise RuntimeError("out of memory")
            write_pages(pages, data)
        monkeypatch.setattr(pool, "write_pages", failing_once)
        with pytest.warns(RuntimeWarning, match="from the tier failed"):
            outputs = llm.generate(case.batch, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == case.expected
        assert len(loads) > 1
        llm.check()


# --- failures -------------------------------------------------------------------------------

def test_a_killed_worker_fails_the_next_step_naming_its_rank(monkeypatch, device):
    """Rank 0 finds the dead worker before the step: at once, without waiting for a report
    that a killed worker never sends."""
    cpu_only(device)
    monkeypatch.setattr(parallel, "REPORT_SECONDS", 30.0)
    with LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS) as llm:
        worker = llm.peers.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        start = time.monotonic()
        with pytest.raises(RankFailed, match=rf"rank 1 \(pid {worker.pid}\) exited with code -9"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert time.monotonic() - start < 10
        with pytest.raises(RankFailed, match="rank 1"):  # and every step after it
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not multiprocessing.active_children()


def test_no_socket_of_the_group_listens_beyond_this_machine(monkeypatch, device):
    """The ranks meet at a store file in a directory of this user's alone, removed at close,
    and the group's gloo sockets listen on the loopback interface, even where gloo's default
    device is another interface."""
    cpu_only(device)
    gloo_default_device_beyond_loopback(monkeypatch)
    directories = record_private_directories(monkeypatch, parallel)
    with LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS) as llm:
        [output] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert output.error is None
        listening = listening_addresses([os.getpid()] + [w.pid for w in llm.peers.workers])
        assert listening and not beyond_loopback(listening)
        [directory] = directories
        assert_private_while_open(directory)
    assert not os.path.exists(directory.name)


def test_a_worker_that_fails_before_joining_the_group_fails_the_engine_at_once(device):
    """A worker that raises before it reaches rank 0's store (here: sent to a CUDA device
    this machine lacks) fails the group with its report, instead of leaving rank 0 waiting
    for the group until the startup timeout."""
    cpu_only(device)
    if torch.cuda.is_available():
        pytest.skip("the failure is a CUDA device that does not exist")
    # A CPU build of torch says it was not compiled with CUDA, a CUDA build that no driver
    # is there.
    with pytest.raises(RankFailed, match="rank 1 failed while starting: .*(CUDA|_cuda|NVIDIA)"):
        parallel.TensorParallelGroup(RANKS, torch.device("cuda"), timeout=5.0)
    assert not multiprocessing.active_children()


def test_a_stuck_worker_fails_the_step_within_the_timeout_but_idle_time_is_not_bounded(
        monkeypatch, device):
    """The timeout bounds a collective, not the engine's idle time between steps. A worker
    that stops answering (SIGSTOP) leaves rank 0 in a collective: the step fails after
    tensor_parallel_timeout seconds instead of hanging, and close kills the worker."""
    cpu_only(device)
    # a stopped worker never reports: the failed step need not wait long for its report
    monkeypatch.setattr(parallel, "REPORT_SECONDS", 0.1)
    timeout = 1.0
    llm = LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS,
              tensor_parallel_timeout=timeout)
    worker = llm.peers.workers[0]
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    time.sleep(timeout + 0.5)  # the workers idle past the timeout, waiting for a step
    assert llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids == first
    os.kill(worker.pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(RankFailed, match=r"rank\(s\) 1 alive but a collective got no "
                                             r"answer within 1 s"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert time.monotonic() - start < timeout + 10
    finally:
        llm.close()
    assert not worker.is_alive()
    assert not multiprocessing.active_children()


def test_a_step_interrupted_by_ctrl_c_stops_the_group_and_later_steps_fail_at_once(
        monkeypatch, device):
    cpu_only(device)
    with LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS) as llm:
        forward = llm.runner.model.forward

        def interrupted(*args):  # Ctrl-C inside a step: where, rank 0 cannot tell
            forward(*args)
            raise KeyboardInterrupt

        monkeypatch.setattr(llm.runner.model, "forward", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert not multiprocessing.active_children()  # stopped then, not at close
        monkeypatch.undo()
        start = time.monotonic()
        with pytest.raises(RankFailed, match="interrupted .KeyboardInterrupt.: the "
                                             "tensor-parallel ranks may be out of step"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert time.monotonic() - start < 5
    assert not multiprocessing.active_children()


def test_one_engine_of_several_ranks_per_process_and_a_failed_build_stops_its_workers(
        tmp_path, device):
    """A build failing after the workers started stops them at once, even while its error is
    held (as a REPL holds the last one), so that a retry starts. A second engine would take
    the first one's process group: it is refused, and the first serves on."""
    cpu_only(device)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    broken = save_hf_model(make_hf_model("llama"), tmp_path)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)  # found wrong once the workers started
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight has shape") as held:
        LLM(broken, num_pages=32, device=device, tensor_parallel_size=RANKS)
    assert held.value is not None and not multiprocessing.active_children()
    with LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS) as retry:
        with pytest.raises(ValueError, match="torch.distributed is initialized already"):
            LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS)
        assert len(retry.generate([[1, 2, 3]], greedy, use_tqdm=False)[0]
                   .outputs[0].token_ids) == 4
        worker = retry.peers.workers[0]
        os.kill(worker.pid, signal.SIGINT)  # Ctrl-C at an idle prompt
        wait_until_delivered(worker.pid, signal.SIGINT)
        assert len(retry.generate([[1, 2, 3]], greedy, use_tqdm=False)[0]
                   .outputs[0].token_ids) == 4


def wait_until_delivered(pid: int, signum: int, timeout: float = 10.0) -> None:
    """Wait until process `pid` holds `signum` pending no more: it ran its handler, or it
    ignores the signal (then the kernel discarded it at once). Without /proc, half a second."""
    if not Path(f"/proc/{pid}/status").exists():
        time.sleep(0.5)
        return
    bit = 1 << (signum - 1)
    deadline = time.monotonic() + timeout
    while True:
        status = dict(line.split(":", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines())
        if not (int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)) & bit:
            return
        assert time.monotonic() < deadline, f"signal {signum} still pending in {pid}"
        time.sleep(0.01)


def test_tier_pages_wider_than_a_step_message_and_more_than_one_holds_reach_the_workers(
        cases, device):
    """A tier entry (a page's id, two chain keys and page_size ids) may be wider than the
    largest step: the step channel holds one all the same, and a prompt's pages fetched from
    the tier in a message each are each loaded into its page."""
    cpu_only(device)
    folder = cases("llama").folder
    options = dict(num_pages=4, page_size=64, max_num_seqs=1, max_num_batched_tokens=16,
                   host_tier_memory=2**26, device=device)
    # the first back from the tier: 2 pages, in 2 FETCH messages
    prompts = [[i + 1] * 130 for i in range(4)] + [[1] * 130]
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    expected = LLM(folder, **options).generate(prompts, greedy, use_tqdm=False)
    with LLM(folder, tensor_parallel_size=RANKS, **options) as llm:
        step = llm.runner.max_step  # a step message: its lengths and its metadata
        assert 2 * step.num_seqs + 1 + step.size < options["page_size"] + 1
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        assert llm.stats().num_tier_stores > 0 and llm.stats().num_tier_loads == 2
    assert [o.outputs[0].token_ids for o in outputs] == \
        [o.outputs[0].token_ids for o in expected]


def test_a_timeout_past_a_year_or_under_a_second_is_refused(device):
    """Under a second, the ranks' groups could fail to connect as they form (1 ms did)."""
    for timeout in (math.inf, 1e15, 0.999, 0.001):
        with pytest.raises(ValueError, match=r"tensor_parallel_timeout must be a number of "
                                             r"seconds in \[1, 31536000\] \(a year\), got "
                                             + re.escape(repr(timeout))):
            LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS,
                tensor_parallel_timeout=timeout)


def test_a_worker_that_raises_in_a_step_fails_it_with_its_report_and_stops_the_group(device):
    """The worker's error (here: a copy into a pool it does not have) comes out of rank 0's
    step with the worker's own message and where it was raised; the group is stopped at once,
    the engine still open."""
    cpu_only(device)
    with LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS,
             tensor_parallel_timeout=10.0) as llm:
        llm.peers._pending.append((parallel.COPY, 7, [[0, 1]]))  # sent before the next step
        with pytest.raises(RankFailed, match=r"rank 1 failed: IndexError: list index out of "
                                             r"range \(.*parallel\.py:\d+\)"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert not multiprocessing.active_children()
        assert not torch.distributed.is_initialized()


def test_rank_0s_own_error_in_a_step_names_rank_0_and_kills_the_worker_at_once(monkeypatch,
                                                                              device):
    """An error of rank 0's own forward is named as rank 0's, and the worker it left in a
    collective is killed at once (a STOP it would not read would wait out the timeout)."""
    cpu_only(device)
    monkeypatch.setattr(parallel, "REPORT_SECONDS", 0.1)  # the worker has nothing to report
    with LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS,
             tensor_parallel_timeout=5.0) as llm:
        def broken(*args):
            raise ValueError("rank 0's forward broke")

        monkeypatch.setattr(llm.runner.model, "forward", broken)
        start = time.monotonic()
        with pytest.raises(RankFailed, match="tensor-parallel rank 0 failed: ValueError: rank "
                                             "0's forward broke"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert time.monotonic() - start < 4
        assert not multiprocessing.active_children()


def test_workers_that_do_not_reach_the_store_fail_the_start_after_the_startup_timeout(
        monkeypatch, device):
    """Rank 0 waits for the workers to reach its store for the startup timeout (at least
    STARTUP_SECONDS), then fails and stops them; here rank 0 looks for a key they never set."""
    cpu_only(device)
    monkeypatch.setattr(parallel, "STARTUP_SECONDS", 0.5)
    monkeypatch.setattr(parallel, "connected_key", lambda rank: f"never/{rank}")  # rank 0's
    start = time.monotonic()
    with pytest.raises(RankFailed, match="tensor-parallel workers did not start within 0.5 s"):
        parallel.TensorParallelGroup(RANKS, device, timeout=0.1)
    assert time.monotonic() - start < 10
    assert not multiprocessing.active_children()
    assert not torch.distributed.is_initialized()


def worker_spec(model: str) -> parallel.WorkerSpec:
    """What a worker builds: `model` with 8 pages of 4 tokens, steps of 2 tokens at most."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                      page_size=4)
    return parallel.WorkerSpec(model, None, layout, 8, None, 0, StepLayout(1, 2, 1, 1))


def test_a_worker_that_fails_to_build_its_part_fails_the_start_with_its_report(tmp_path,
                                                                               device):
    """The worker's error comes out of `start` (here: a model folder that is not there),
    and the workers and the group are stopped."""
    cpu_only(device)
    spec = worker_spec(str(tmp_path / "no-such-model"))
    group = parallel.TensorParallelGroup(RANKS, device, timeout=5.0)
    try:
        with pytest.raises(RankFailed, match="rank 1 failed while loading: .*no-such-model"):
            group.start(spec, KVCache(spec.layout, spec.num_pages, device=device))
        assert not multiprocessing.active_children()
        assert not torch.distributed.is_initialized()
    finally:
        group.close()


def test_a_worker_stuck_building_its_part_fails_the_start_after_the_startup_timeout(
        monkeypatch, device):
    """A worker alive but never done building (here: stopped) fails `start` once the
    startup timeout has passed, naming its rank, and the workers and the group are stopped."""
    cpu_only(device)
    spec = worker_spec("tiny")
    group = parallel.TensorParallelGroup(RANKS, device, timeout=1.0)
    try:
        monkeypatch.setattr(parallel, "STARTUP_SECONDS", 0.5)
        os.kill(group.workers[0].pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailed, match=r"tensor-parallel rank\(s\) 1 did not finish "
                                             r"loading within 1 s"):
            group.start(spec, KVCache(spec.layout, spec.num_pages, device=device))
        assert time.monotonic() - start < 10
        assert not multiprocessing.active_children()
        assert not torch.distributed.is_initialized()
    finally:
        group.close()


# --- what does not split: refused before any process starts ----------------------------------

def test_kv_heads_that_do_not_split_are_refused(device):
    with pytest.raises(ValueError, match="2 KV heads do not split evenly across 3"):
        LLM("tiny", num_pages=32, device=device, tensor_parallel_size=3)


def test_a_disk_or_redis_tier_is_refused_with_tensor_parallelism(tmp_path, device):
    with pytest.raises(ValueError, match="host tier only.*would have disk_tier"):
        LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS,
            disk_tier=tmp_path)
    with pytest.raises(ValueError, match="host tier only.*would have redis_tier"):
        LLM("tiny", num_pages=32, device=device, tensor_parallel_size=RANKS,
            redis_tier="redis://127.0.0.1:1/0")


def test_on_cuda_rank_0_is_cuda_0_and_every_rank_needs_a_device_of_its_own(monkeypatch):
    """Refused before any process starts (the CUDA devices counted here, none needed)."""
    config = EngineConfig(tensor_parallel_size=RANKS)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: RANKS)
    for device in (torch.device("cuda"), torch.device("cuda", 0)):
        parallel.check_tensor_parallel(config, device)
    with pytest.raises(ValueError, match="rank 0 runs on cuda:0, not cuda:1"):
        parallel.check_tensor_parallel(config, torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: RANKS - 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 CUDA devices, this "
                                         "machine has 1"):
        parallel.check_tensor_parallel(config, torch.device("cuda", 0))

def test_a_rank_loads_only_its_part_of_each_weight(tmp_path, device):
    hf = make_hf_model("llama")
    folder = save_hf_model(hf, tmp_path)
    whole = hf.state_dict()
    part = load_model(folder, device=device, tp=TensorParallel(1, RANKS)).model.state_dict()
    attn = "model.layers.0.self_attn."
    assert torch.equal(part[attn + "q_proj.weight"].cpu(), whole[attn + "q_proj.weight"][32:])
    assert torch.equal(part[attn + "k_proj.weight"].cpu(), whole[attn + "k_proj.weight"][16:])
    assert torch.equal(part[attn + "o_proj.weight"].cpu(), whole[attn + "o_proj.weight"][:, 32:])
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(part[down].cpu(), whole[down][:, 48:])
    assert torch.equal(part["model.embed_tokens.weight"].cpu(),
                       whole["model.embed_tokens.weight"][80:])


@pytest.mark.parametrize("rank", range(RANKS))
@pytest.mark.parametrize("name, grow", [
    ("model.embed_tokens.weight", (8, 0)),  # more vocabulary rows than the config's
    ("model.layers.0.self_attn.q_proj.weight", (16, 0)),  # split by rows
    ("model.layers.0.self_attn.o_proj.weight", (0, 16)),  # split by columns
])
def test_a_weight_larger_than_the_config_is_refused_on_every_rank(tmp_path, device, rank,
                                                                  name, grow):
    """Each rank's part of a larger tensor has the shape the rank holds: the whole is checked."""
    folder = save_hf_model(make_hf_model("llama"), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    rows, cols = tensors[name].shape
    tensors[name] = torch.zeros(rows + grow[0], cols + grow[1], dtype=tensors[name].dtype)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape(
            f"{name} has shape {(rows + grow[0], cols + grow[1])} in the checkpoint, the "
            f"config needs {(rows, cols)}")):
        load_model(folder, device=device, tp=TensorParallel(rank, RANKS))


def test_a_model_that_does_not_split_is_refused_by_plan_and_engine_before_any_process(
        capsys, device):
    assert main(["plan", "Qwen2.5-7B", "--device-memory", "80GiB",
                 "--tensor-parallel-size", "8"]) == 2
    assert "num_attention_heads 28 does not split across 8" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="vocab_size 258 does not split across 4"):
        LLM("tiny", num_pages=32, device=device, tensor_parallel_size=4)


def test_ranks_on_the_cpu_share_the_hosts_memory_in_the_plan():
    one = plan_memory(ModelConfig.from_hf("Llama-3-8B"), None, device="cpu")
    two = plan_memory(ModelConfig.from_hf("Llama-3-8B"), None, device="cpu",
                      tensor_parallel_size=2)
    assert two.device_memory == one.device_memory // 2


def test_a_dimension_that_does_not_split_names_itself(tmp_path, device):
    folder = save_hf_model(make_hf_model("llama"), tmp_path)
    with pytest.raises(ConfigError, match="vocab_size 160 does not split across 3 "
                                          "tensor-parallel ranks"):
        load_model(folder, device=device, tp=TensorParallel(0, 3))


# --- planning ------------------------------------------------------------------------------

def test_a_rank_plans_half_the_kv_heads_in_the_budget_its_weights_leave():
    model = ModelConfig.from_hf("Llama-3-8B")
    one = plan_memory(model, 80 * 2**30)
    rank = plan_memory(model, 80 * 2**30, tensor_parallel_size=2)
    assert rank.layout.num_kv_heads == 4 and one.layout.num_kv_heads == 8
    assert rank.layout.bytes_per_token * 2 == one.layout.bytes_per_token
    assert rank.budget_bytes == one.budget_bytes + one.weight_bytes - rank.weight_bytes
    assert rank.num_pages == pages_within(rank.layout, rank.budget_bytes)


# PARITY's models and others whose ranks hold whole tensors: row-parallel biases (Llama's,
# Granite's, Seed-OSS's, the experts' and shared experts' down projections), an ungated MLP
# (Arcee's), Qwen2-MoE's shared gate, MLA without q_lora_rank (V2-Lite) and with biases, and
# hybrids' Mamba mixers (B/C groups fewer than the ranks: replicated)
RANK_BYTES = {
    **PARITY,
    "llama-biases": CONFIGS["llama-rope-llama3-biases"],
    "granite": CONFIGS["granite"],
    "smollm3": CONFIGS["smollm3"],
    "seed-oss": FAMILIES["seed-oss"],
    "arcee": FAMILIES["arcee"],
    "qwen2-moe": QWEN3_MOE_CONFIGS["qwen2-moe"],
    "deepseek-v2-lite": DEEPSEEK_CONFIGS["v2-lite"],
    "deepseek-v3-biases": DEEPSEEK_CONFIGS["v3-biases-norm-eps"],
    "bamba": BAMBA_CONFIGS["bamba-biases-tied-two-attention"],
    "granite-hybrid": GRANITE_HYBRID["granite-hybrid"],
}


@pytest.mark.parametrize("name", list(RANK_BYTES))
def test_a_rank_plans_the_bytes_of_the_weights_it_loads(tmp_path, name):
    """Split tensors' parts and replicated ones whole, float32 routers and sinks at 4 bytes:
    the plan's weight bytes are those of rank 0's loaded tensors."""
    folder = save_hf_model(make_hf_model(name, configs=RANK_BYTES), tmp_path)
    loaded = load_model(folder, dtype=torch.bfloat16, device="cpu", tp=TensorParallel(0, RANKS))
    held = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
    plan = plan_memory(loaded.config, 2**40, dtype=torch.bfloat16, tensor_parallel_size=RANKS)
    assert plan.weight_bytes == held


@pytest.mark.parametrize(("preset", "ranks", "weight_bytes"), [
    ("Llama-3-8B", 8, 2_008_031_232),  # norms and one KV head of 8 whole on every rank
    ("Gemma-3-4B", 8, 1_015_274_496),  # 4 KV heads: one replicated on 2 ranks each
    ("Qwen3-235B-A22B", 8, 58_959_617_024),  # and 94 routers of 128 experts
])
def test_a_rank_of_a_published_model_plans_what_its_part_holds(preset, ranks, weight_bytes):
    plan = plan_memory(ModelConfig.from_hf(preset), 2**44, tensor_parallel_size=ranks)
    assert plan.weight_bytes == weight_bytes


def test_fewer_kv_heads_than_ranks_replicate_one_head_per_rank():
    layout = KVLayout(4, 2, 64)
    assert layout.per_rank(4).num_kv_heads == 1
    assert layout.per_rank(2).num_kv_heads == 1
    with pytest.raises(ValueError, match="2 KV heads do not split evenly across 3"):
        layout.per_rank(3)


def test_an_mla_latent_is_whole_on_every_rank():
    config = ModelConfig.from_hf(DEEPSEEK_CONFIGS["v3-yarn"]().to_dict())
    layout = config.kv_layout()
    assert layout.per_rank(2) == layout


def test_kvpool_plan_shows_one_ranks_share(capsys):
    assert main(["plan", "Llama-3-8B", "--device-memory", "80GiB",
                 "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert ("2 ranks: each holds its part of the weights (the replicated ones whole), 4 of 8 "
            "KV heads") in out
    assert "KV bytes per token  65,536" in out


@pytest.mark.parametrize("command", [["bench"], ["generate", "hi"], ["chat"], ["serve"],
                                     ["plan", "tiny"]])
def test_every_engine_command_takes_the_flag(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--tensor-parallel-size", "0"])
    assert "--tensor-parallel-size: expected an int >= 1, got 0" in capsys.readouterr().err


def test_processes_start_from_the_forkserver_or_by_spawn_where_there_is_none(monkeypatch):
    """The workers and the server's engine processes: forked by a forkserver that imported
    the engine once; spawned on a platform without one (Windows)."""
    context = parallel.process_context()
    assert context.get_start_method() == "forkserver"
    monkeypatch.setattr(parallel.mp, "get_all_start_methods", lambda: ["spawn"])
    assert parallel.process_context().get_start_method() == "spawn"


def test_what_the_forkserver_imports_reaches_no_cuda_driver_and_starts_no_threads():
    """Every process the forkserver forks inherits what it imported: had an import reached
    the CUDA driver there, no engine or worker forked from it could use CUDA; had it run a
    torch op, OpenMP's threads would be lost in the fork, and a forked process could hang
    in its first parallel op. In a fresh process, each way torch reaches the driver is
    trapped, and the threads counted, while WORKER_MODULES import."""
    code = ("import importlib, os, torch\n"
            "threads = len(os.listdir('/proc/self/task'))\n"
            "calls = []\n"
            "def trap(owner, name):\n"
            "    def called(*args, **kwargs):\n"
            "        calls.append(name)\n"
            "        return 0\n"
            "    if hasattr(owner, name):\n"
            "        setattr(owner, name, called)\n"
            "for name in ('is_available', 'device_count', 'init', '_lazy_init', "
            "'mem_get_info', 'get_device_properties', 'current_device'):\n"
            "    trap(torch.cuda, name)\n"
            "trap(torch._C, '_cuda_getDeviceCount')\n"
            "from kvpool.engine.parallel import WORKER_MODULES\n"
            "for module in WORKER_MODULES:\n"
            "    importlib.import_module(module)\n"
            "print(calls, len(os.listdir('/proc/self/task')) - threads)\n")
    assert fresh_process_output(code) == "[] 0"


# --- the step channel, the worker's side, the split of units ---------------------------------

def test_entries_past_one_message_go_in_several_messages_in_order():
    """A COPY with more entries than the fixed-size buffer holds is sent in as many messages
    as it needs, each full but the last and saying whether more follow, and the worker reads
    back every entry in order."""
    channel = parallel.StepChannel(None, worker_spec("tiny"))
    room = (len(channel.buffer) - parallel.HEADER) // 2
    messages = []
    channel._broadcast = lambda: messages.append(
        (int(channel.buffer[0]), *channel.entries()))
    entries = [[i, 100 + i] for i in range(2 * room + 1)]
    channel.send_entries(parallel.COPY, 1, entries)
    assert [(command, pool, len(part), more) for command, pool, part, more in messages] == \
        [(parallel.COPY, 1, room, True), (parallel.COPY, 1, room, True),
         (parallel.COPY, 1, 1, False)]
    assert [entry for _, _, part, _ in messages for entry in part] == entries


def test_a_worker_makes_the_copies_of_one_call_in_one_copy_however_many_messages_they_take():
    """Rank 0 copies pages 0..room to 1..room+1 in one call, each page getting the old
    content of the one before; sent in two messages, the worker's pool copies them at once
    too, not the second message's copy after the first's had moved its source."""
    spec = dataclasses.replace(worker_spec("tiny"), num_pages=12)
    sender = parallel.StepChannel(None, spec)
    room = (len(sender.buffer) - parallel.HEADER) // 2
    messages = []
    sender._broadcast = lambda: messages.append(sender.buffer.clone())
    sender.send_entries(parallel.COPY, 0, [[i, i + 1] for i in range(room + 1)])
    sender.send_stop()
    assert (len(messages), room) == (3, 7)  # 2 of copies, then STOP
    cache = KVCache(spec.layout, spec.num_pages, device=torch.device("cpu"))
    pool = cache.kv_pools.pools[0]
    for page in range(spec.num_pages):
        pool.kv[:, :, page] = page
    worker = parallel.StepChannel(None, spec)
    received = iter(messages)
    worker._broadcast = lambda: worker.buffer.copy_(next(received))
    parallel.serve(types.SimpleNamespace(cache=cache), worker)
    assert pool.kv[0, 0, :spec.num_pages, 0, 0, 0].tolist() == \
        [0, *range(room + 1), *range(room + 2, spec.num_pages)]


def test_a_worker_tier_that_lost_a_page_rank_0_fetched_raises():
    tier = HostTier(4)
    tier.bind("rank 1", (2, 3), torch.float32)
    kept = PageKey.of(ROOT_KEY, (5, 6))
    lost = PageKey.of(kept.chain_key, (7, 8))
    assert tier.store(kept, torch.ones(2, 3))
    [page] = parallel.fetch_pages(tier, [parallel.key_entry(kept)])
    assert torch.equal(page, torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="this rank's tier holds 1 of the 2 pages rank 0 "
                                           "fetched"):
        parallel.fetch_pages(tier, [parallel.key_entry(kept), parallel.key_entry(lost)])


class EmptyQueue:
    """A queue of WorkerSpecs that is empty `empty_for` times, then holds "spec"."""

    def __init__(self, empty_for: int):
        self.empty_for = empty_for

    def get(self, timeout: float) -> str:
        if self.empty_for:
            self.empty_for -= 1
            raise queue.Empty
        return "spec"


class Parent:
    def __init__(self, alive: bool):
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive


def test_a_worker_waits_for_what_to_build_while_rank_0_lives_and_stops_when_it_exits(
        monkeypatch):
    monkeypatch.setattr(parallel.multiprocessing, "parent_process", lambda: Parent(True))
    assert parallel.receive_spec(EmptyQueue(3)) == "spec"
    monkeypatch.setattr(parallel.multiprocessing, "parent_process", lambda: Parent(False))
    with pytest.raises(RuntimeError, match="rank 0 exited before saying what to build"):
        parallel.receive_spec(EmptyQueue(3))


def test_a_rank_is_one_of_the_ranks():
    assert TensorParallel(1, 2).rank == 1
    for rank in (-1, 2):
        with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got"):
            TensorParallel(rank, 2)


def test_fewer_kv_heads_than_ranks_give_each_rank_the_head_its_query_heads_read():
    assert [TensorParallel(rank, 4).kv_part(2) for rank in range(4)] == \
        [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [TensorParallel(rank, 2).kv_part(4) for rank in range(2)] == \
        [range(0, 2), range(2, 4)]
    with pytest.raises(ConfigError, match="num_key_value_heads 2 cannot be replicated evenly "
                                          "across 3 tensor-parallel ranks"):
        TensorParallel(0, 3).kv_part(2)


# last in the file: the module's engine of each config is closed by it (then by its fixture)
def test_close_stops_every_worker_and_a_closed_engine_runs_no_step(engine):
    case, llm = engine
    workers = list(llm.peers.workers)
    llm.close()
    assert [worker.exitcode for worker in workers] == [0]
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(case.batch[:1], GREEDY, use_tqdm=False)
