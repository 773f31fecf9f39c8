"""CUDA graphs for every model family: the padded decode step a graph replays (its context
from the graph runner's static buffer, padded rows on the padding pages and state slot) gives
the real rows the eager step's logits and state, on any device; on CUDA, decode steps replayed
from graphs give the eager steps' greedy tokens. The start-up warm-up's padded prefill rows
touch only the padding pages and state slot."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvpool.engine import LLM, SamplingParams
from kvpool.engine.graphs import CUDAGraphRunner
from kvpool.engine.scheduler import ScheduledBatch
from models_util import save_hf_model
from test_fake_trace import FAMILIES

ENGINE = dict(num_pages=64, page_size=4, max_model_len=64, max_num_seqs=4)


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request, tmp_path_factory):
    return save_hf_model(FAMILIES[request.param](), tmp_path_factory.mktemp(request.param))


def _batch(llm: LLM, lengths, decode: bool) -> ScheduledBatch:
    """Sequences of the given lengths (added on first sight): their prompts but the last
    token, or (`decode`) that last token alone."""
    batch = ScheduledBatch()
    for i, n in enumerate(lengths):
        token_ids = [(11 * i + 3 * t) % 150 for t in range(n)]
        if f"s{i}" not in llm.cache.sequences():
            llm.cache.add_sequence(f"s{i}", token_ids)
        batch.seqs.append(SimpleNamespace(seq_id=f"s{i}", token_ids=token_ids))
        batch.starts.append(n - 1 if decode else 0)
        batch.ends.append(n if decode else n - 1)
        batch.sampled.append(True)
    return batch


def _state(llm: LLM) -> list[torch.Tensor]:
    """Copies of every pool the forward writes (each group's pages, the state slots)."""
    tensors = [pool.kv for pool in llm.runner.kv.pools]
    if llm.runner.has_states:
        tensors += [llm.cache.states.conv, llm.cache.states.ssm]
    return [t.clone() for t in tensors]


def _restore(llm: LLM, saved: list[torch.Tensor]) -> None:
    tensors = [pool.kv for pool in llm.runner.kv.pools]
    if llm.runner.has_states:
        tensors += [llm.cache.states.conv, llm.cache.states.ssm]
    for tensor, copy in zip(tensors, saved, strict=True):
        tensor.copy_(copy)


def test_a_padded_decode_step_gives_the_real_rows_the_eager_logits_and_states(folder):
    llm = LLM(folder, device="cpu", **ENGINE)
    graphs = CUDAGraphRunner(llm.runner, 4, 64)
    lengths = (6, 11, 17)
    llm.runner.run(_batch(llm, lengths, decode=False))
    before = _state(llm)
    decode = _batch(llm, lengths, decode=True)
    eager = llm.runner.run(decode)
    after_eager = _state(llm)
    _restore(llm, before)
    with torch.inference_mode():
        padded = llm.model(graphs.inputs(graphs.stage(decode, 4), 4))
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    if llm.runner.has_states:  # the real sequences' state slots advanced as eagerly
        slots = [llm.cache.state_slot(f"s{i}") for i in range(3)]
        for got, want in zip(_state(llm)[-2:], after_eager[-2:], strict=True):
            torch.testing.assert_close(got[:, slots], want[:, slots], rtol=1e-5, atol=1e-5)


def test_every_groups_metadata_and_the_state_slots_are_in_the_graphs_input_buffer(folder):
    llm = LLM(folder, device="cpu", **ENGINE)
    graphs = CUDAGraphRunner(llm.runner, 4, 64)
    flat = graphs.stage(_batch(llm, (6, 11, 17), decode=True), 4)
    context = graphs.inputs(flat, 4)
    views = [meta.slot_mapping for meta in context.attention]
    views += [] if context.states is None else [context.states.slots]
    assert len(views) == len(llm.runner.kv.pools) + llm.runner.has_states
    for view in views:  # what replay reads is what the next step's stage writes
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    if context.states is not None:
        slots = [llm.cache.state_slot(f"s{i}") for i in range(3)]
        assert context.states.slots.tolist() == slots + [graphs.padding.state_slot]


def test_the_start_up_warm_up_writes_only_the_padding_pages_and_state_slot(folder):
    llm = LLM(folder, device="cpu", **ENGINE)  # on the CPU the engine warms up nothing itself
    for pool in llm.runner.kv.pools:
        pool.kv.normal_()
    before = _state(llm)
    model, lengths = llm.runner.model, []
    llm.runner.model = lambda context: lengths.append(context.host.max_query_len) or model(
        context)
    llm.runner.warm_up([2, 40])
    assert lengths == [2, 40]
    after = _state(llm)
    for pool, was, now in zip(llm.runner.kv.pools, before, after, strict=False):
        assert torch.equal(now[:, :, : pool.num_pages], was[:, :, : pool.num_pages])
        assert not torch.equal(now[:, :, pool.padding_page], was[:, :, pool.padding_page])
    if llm.runner.has_states:  # bytes: slots never written may hold NaN
        others = [s for s in range(llm.cache.states.num_slots)
                  if s != llm.cache.states.padding_slot]
        for was, now in zip(before[-2:], after[-2:], strict=True):
            assert torch.equal(now[:, others].view(torch.uint8), was[:, others].view(torch.uint8))
    stats = llm.cache.stats()
    assert (stats.num_sequences, stats.num_used_pages) == (0, 0)
    llm.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_decode_steps_give_the_eager_tokens_for_every_family(folder):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[(5 * i + 7 * t) % 150 for t in range(3 + 4 * i)] for i in range(6)]
    eager = LLM(folder, device="cuda", enforce_eager=True, **ENGINE).generate(
        prompts, greedy, use_tqdm=False)
    llm = LLM(folder, device="cuda", **ENGINE)
    graphed = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    assert llm.stats().num_graph_steps > 0
