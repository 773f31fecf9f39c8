"""Tensor parallelism of a hybrid model (Bamba, GraniteMoeHybrid) on the CPU with gloo, 2 ranks:
the Mamba heads split across the ranks with their state slots, the greedy tokens equal
transformers' (and so one rank's) through preemption, prefix hits (a checkpoint restored on
every rank), chunks and forked samples (a state slot copied on every rank)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from hybrid_util import BAMBA_CONFIGS, make_bamba
from kvpool.engine import LLM, SamplingParams
from kvpool.errors import ConfigError
from kvpool.models import load_model
from kvpool.models.config import ModelConfig
from kvpool.models.parallel import TensorParallel
from models_util import case_of, save_hf_model
from test_granite_hybrid import CONFIGS as GRANITE_HYBRID
from test_tensor_parallel import ENGINE, GREEDY, MAX_TOKENS, RANKS, cpu_only

# Bamba's configs and GraniteMoeHybrid's (its experts split as every MoE's, 2 B/C groups;
# and without experts, its shared MLP split as a dense MLP)
HYBRIDS = {**BAMBA_CONFIGS, **{name: GRANITE_HYBRID[name]
                               for name in ("granite-hybrid", "granite-hybrid-dense")}}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def engine(request, tmp_path_factory, device):
    """(case, LLM of 2 ranks) for one hybrid config (2 B/C groups: one per rank; or 1 group,
    replicated, whose gated norm spans both ranks): 16 pages of 4 tokens, 16-token chunks."""
    cpu_only(device)
    case = case_of(make_bamba(request.param, configs=HYBRIDS),
                   tmp_path_factory.mktemp(request.param), device, MAX_TOKENS)
    llm = LLM(case.folder, device=device, **ENGINE)
    yield case, llm
    llm.close()


def test_greedy_tokens_equal_transformers_through_preemption_prefix_hits_and_chunks(engine):
    case, llm = engine
    outputs = llm.generate(case.batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == case.expected
    assert llm.stats().num_preemptions > 0
    assert llm.cache.stats().prefix_hit_tokens > 0  # served from a state checkpoint
    llm.check()


def test_forked_samples_copy_their_state_on_every_rank(engine):
    """n=2 greedy samples: the second's state slot is a copy of the first's, made by rank 0
    and repeated by the worker; a worker that missed it would start from another state."""
    case, llm = engine
    before = llm.cache.states.stats().num_copies
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(case.batch[:2], params, use_tqdm=False)
    assert llm.cache.states.stats().num_copies > before
    for output, expected in zip(outputs, case.expected[:2], strict=True):
        assert [sample.token_ids for sample in output.outputs] == [expected] * 2


@pytest.mark.parametrize("engine", ["bamba"], indirect=True)
def test_a_checkpoint_saved_by_copy_then_restored_reaches_the_worker_in_that_order(engine,
                                                                                  device):
    """b's one-token row [15, 16) saves its checkpoint at 16 by a copy after its step; c
    (b and 5 tokens), added then, restores it by a copy from that slot before the next step.
    The worker repeats them in turn: one copy of both would restore the slot's old state."""
    case, llm = engine
    b = [(7 * i) % 150 + 1 for i in range(16)]
    c = b + [3, 1, 4, 1, 5]
    with LLM(case.folder, device=device, **{**ENGINE, "tensor_parallel_size": 1}) as one:
        expected = [o.outputs[0].token_ids for o in one.generate([b, c], GREEDY,
                                                                  use_tqdm=False)]
    hits = llm.cache.stats().prefix_hit_tokens
    llm.add_request([9], GREEDY)  # one token: b's first step then prefills [0, 15)
    first = llm.add_request(b, GREEDY)
    llm.step()
    llm.step()
    second = llm.add_request(c, GREEDY)
    outputs = {}
    while llm.has_unfinished():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in llm.step() if o.finished)
    assert llm.cache.stats().prefix_hit_tokens - hits == 16
    assert [outputs[first], outputs[second]] == expected


def test_each_rank_state_slot_holds_its_share_of_the_mamba_heads(engine):
    case, llm = engine
    whole = llm.model_config.mamba
    layout = llm.cache.states.layout
    assert layout.num_heads == whole.num_heads // RANKS
    groups = max(1, whole.num_groups // RANKS)
    assert layout.conv_dim == whole.intermediate_size // RANKS + 2 * groups * whole.state_size


def test_a_rank_loads_its_heads_rows_of_each_section_of_in_proj(tmp_path, device):
    hf = make_bamba("bamba")  # 8 heads of 16 channels, 2 groups of 16 state channels
    folder = save_hf_model(hf, tmp_path)
    whole = hf.state_dict()
    part = load_model(folder, device=device, tp=TensorParallel(1, RANKS)).model.state_dict()
    mixer = "model.layers.0.mamba."
    in_proj = whole[mixer + "in_proj.weight"]  # z 128, x 128, B 32, C 32, dt 8
    expected = torch.cat([in_proj[64:128], in_proj[192:256], in_proj[272:288],
                          in_proj[304:320], in_proj[324:328]])
    assert torch.equal(part[mixer + "in_proj.weight"].cpu(), expected)
    conv = whole[mixer + "conv1d.weight"]
    assert torch.equal(part[mixer + "conv1d.weight"].cpu(),
                       torch.cat([conv[64:128], conv[144:160], conv[176:192]]))
    assert torch.equal(part[mixer + "A_log"].cpu(), whole[mixer + "A_log"][4:])
    assert torch.equal(part[mixer + "norm.weight"].cpu(), whole[mixer + "norm.weight"][64:])
    assert torch.equal(part[mixer + "out_proj.weight"].cpu(),
                       whole[mixer + "out_proj.weight"][:, 64:])


def test_a_rank_holds_its_share_of_the_heads_and_groups_or_one_group_replicated():
    whole = ModelConfig.from_hf(BAMBA_CONFIGS["bamba"]().to_dict()).mamba  # 8 heads, 2 groups
    assert (whole.per_rank(2).num_heads, whole.per_rank(2).num_groups) == (4, 1)
    assert (whole.per_rank(4).num_heads, whole.per_rank(4).num_groups) == (2, 1)
    assert whole.per_rank(4).conv_dim == 2 * 16 + 2 * 16


def test_mamba_heads_that_do_not_split_are_refused_before_any_process_starts(tmp_path, device):
    folder = save_hf_model(make_bamba("bamba"), tmp_path)
    with pytest.raises(ConfigError, match="mamba_n_heads 8 does not split across 3 "
                                          "tensor-parallel ranks"):
        LLM(folder, num_pages=24, device=device, tensor_parallel_size=3)
    assert not multiprocessing.active_children()


# last in the file: the module's engine of each config is closed by it (then by its fixture)
def test_close_stops_every_worker(engine):
    case, llm = engine
    workers = list(llm.peers.workers)
    llm.close()
    assert [worker.exitcode for worker in workers] == [0]
