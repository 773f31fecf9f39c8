"""On CUDA only: the forward reads nothing back from the device, decode steps replayed from
CUDA graphs give the eager steps' tokens, the sampler draws without synchronising, and
overlap scheduling (on by default) gives the plain loop's tokens and launches a step without
waiting for the one before."""

import random

import pytest
import torch

from kvpool.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(n=12, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(258) for _ in range(rng.randint(3, 90))] for _ in range(n)]


def _llm(**options):
    return LLM("tiny", device="cuda", num_pages=512, max_num_seqs=16, max_model_len=512,
               **options)


@pytest.mark.parametrize("steps_before", [0, 1])  # a prefill step, then a decode step
def test_the_forward_runs_without_host_synchronisation(steps_before):
    llm = _llm(enforce_eager=True)
    for prompt in _prompts(4):
        llm.add_request(prompt, GREEDY)
    for _ in range(steps_before):
        llm.step()
    batch = llm.scheduler.schedule()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.runner.run(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_graph_decode_steps_give_the_eager_tokens():
    prompts = _prompts()
    eager = _llm(enforce_eager=True).generate(prompts, GREEDY, use_tqdm=False)
    llm = _llm()
    graphed = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    stats = llm.stats()
    assert stats.num_cuda_graphs == 5 and stats.num_graph_steps > 0  # 1, 2, 4, 8, 16
    llm.check()


def test_sampling_on_the_device_runs_without_host_synchronisation():
    llm = _llm(enforce_eager=True)
    logits = torch.randn(8, 258, device="cuda")
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=i) for i in range(8)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = llm.sampler(logits, params, list(range(8)), [5] * 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.device.type == "cuda" and tokens.shape == (8,)


def test_overlap_is_on_by_default_and_gives_the_plain_tokens_with_graphs():
    prompts = _prompts()
    params = [GREEDY, SamplingParams(max_tokens=24, temperature=0.8, seed=3, n=2),
              SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(5, 9))] * 4
    plain = _llm(overlap=False).generate(prompts, params, use_tqdm=False)
    llm = _llm()
    assert llm.overlap
    overlapped = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in overlapped] == \
        [[c.token_ids for c in o.outputs] for o in plain]
    assert llm.stats().num_graph_steps > 0 and llm.cache.stats().num_used_pages == 0
    llm.check()


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_an_overlapped_step_launches_without_host_synchronisation(enforce_eager):
    llm = _llm(enforce_eager=enforce_eager)
    for prompt in _prompts(4):
        llm.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.7, n=2))
    for _ in range(3):  # prefills, forks, decodes: a step is in flight now
        llm.step()
    previous = llm._in_flight
    batch = llm.scheduler.schedule()
    torch.cuda.synchronize()
    with torch.inference_mode():
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = llm._forward(batch, previous)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        llm._finish(previous, 0.0)  # waits for the previous step's tokens, by design
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched, failed = llm._launch(batch, logits)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert launched is not None and launched.tokens.is_cuda and failed == []
