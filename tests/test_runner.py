"""The model runner's step inputs (one flat buffer in the workspace, identical to packing each
tensor on its own), its staging buffer and inference mode, and the CUDA-graph runner's buckets
and padding (on the pool's reserved page: no sequence, any number of runners), on the CPU and,
where present, CUDA."""

from types import SimpleNamespace

import pytest
import torch

from hybrid_util import make_bamba
from kvpool.engine import runner as runner_module
from kvpool.engine.graphs import CUDAGraphRunner, graph_batch_sizes, is_decode_only
from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.engine.runner import ModelRunner, StepLayout
from kvpool.engine.scheduler import ScheduledBatch
from kvpool.forward_context import HostLengths
from kvpool.kernels import MAX_DECODE_SPLITS, decode_scratch_bytes
from kvpool.memory.workspace import ALIGNMENT
from models_util import packed_context, save_hf_model

PAGE = 4


@pytest.fixture
def llm(device):
    return LLM("tiny", num_pages=64, page_size=PAGE, max_model_len=64, max_num_seqs=12,
               device=device)


def _batch(llm, chunks):
    """A ScheduledBatch of (seq_id, token_ids, start, end, sampled); each sequence is added
    to the cache with all its tokens."""
    batch = ScheduledBatch()
    for seq_id, token_ids, start, end, sampled in chunks:
        if seq_id not in llm.cache.sequences():
            llm.cache.add_sequence(seq_id, num_tokens=len(token_ids))
        batch.seqs.append(SimpleNamespace(seq_id=seq_id, token_ids=token_ids))
        batch.starts.append(start)
        batch.ends.append(end)
        batch.sampled.append(sampled)
    return batch


def _reference_inputs(cache, batch):
    """The step's tensors packed one by one, as the engine did before the flat buffer."""
    seq_ids = [seq.seq_id for seq in batch.seqs]
    input_ids = [t for s, a, b in zip(batch.seqs, batch.starts, batch.ends, strict=True)
                 for t in s.token_ids[a:b]]
    positions = [p for a, b in zip(batch.starts, batch.ends, strict=True) for p in range(a, b)]
    cu = [0]
    for a, b in zip(batch.starts, batch.ends, strict=True):
        cu.append(cu[-1] + b - a)
    logits_indices = [cu[i + 1] - 1 for i, s in enumerate(batch.sampled) if s]
    return dict(input_ids=input_ids, positions=positions,
                slot_mapping=cache.slot_mapping(seq_ids, batch.starts, batch.ends).tolist(),
                page_tables=cache.page_tables(seq_ids).tolist(), seq_lens=batch.ends,
                cu_seqlens_q=cu, logits_indices=logits_indices)


def _as_lists(inputs):
    (meta,) = inputs.attention
    return dict(input_ids=inputs.input_ids.tolist(), positions=inputs.positions.tolist(),
                slot_mapping=meta.slot_mapping.tolist(), page_tables=meta.page_tables.tolist(),
                seq_lens=meta.seq_lens.tolist(), cu_seqlens_q=meta.cu_seqlens_q.tolist(),
                logits_indices=inputs.logits_indices.tolist())


def _mixed_batch(llm):
    """A prefill chunk, a chunk on top of a computed prefix (not sampled) and two decodes."""
    return _batch(llm, [
        ("a", list(range(10, 40)), 0, 20, False),
        ("b", list(range(50, 75)), 16, 25, True),
        ("c", [7, 8, 9, 10, 11, 12], 5, 6, True),
        ("d", [3] * 13, 12, 13, True),
    ])


def _inputs(llm, batch):
    runner = llm.runner
    layout = runner.layout(batch)
    flat = runner.stage(batch, layout)
    host = HostLengths([0, 20, 29, 30, 31], batch.ends, max(batch.ends), 20)
    return runner.context(flat, layout, host), flat


# ---- the eager step ----------------------------------------------------------------------

def test_step_inputs_equal_the_tensors_packed_one_by_one(llm):
    batch = _mixed_batch(llm)
    inputs, _ = _inputs(llm, batch)
    assert _as_lists(inputs) == _reference_inputs(llm.cache, batch)


def test_step_inputs_have_the_dtypes_the_model_and_kernels_take(llm):
    inputs, _ = _inputs(llm, _mixed_batch(llm))
    (meta,) = inputs.attention
    assert inputs.input_ids.dtype == inputs.positions.dtype == torch.int64
    assert meta.slot_mapping.dtype == inputs.logits_indices.dtype == torch.int64
    assert meta.page_tables.dtype == meta.seq_lens.dtype == meta.cu_seqlens_q.dtype == torch.int32


def test_step_metadata_is_the_workspaces_first_allocation(llm):
    batch = _mixed_batch(llm)
    _, flat = _inputs(llm, batch)
    assert flat.data_ptr() == llm.workspace.buffer.data_ptr()
    assert llm.workspace.num_allocs == 1
    assert llm.workspace.used == llm.runner.layout(batch).size * 8
    llm.workspace.check()


def test_a_step_resets_the_workspace(llm):
    _inputs(llm, _mixed_batch(llm))
    _inputs(llm, _mixed_batch(llm))
    assert llm.workspace.num_allocs == 1


def test_the_staging_buffers_are_allocated_at_setup_for_the_largest_step(llm, device):
    largest = StepLayout(12, llm.config.max_num_batched_tokens, 64 // PAGE, 12)
    assert len(llm.runner.staging) == 2
    for staging in llm.runner.staging:
        assert not staging.is_inference() and staging.device.type == "cpu"
        assert staging.is_pinned() == (device.type == "cuda")
        assert staging.numel() == largest.size


def test_consecutive_steps_pack_into_the_two_staging_buffers_in_turn(llm):
    batch = _mixed_batch(llm)
    used = []
    for _ in range(3):
        for buffer in llm.runner.staging:
            buffer.zero_()
        llm.runner.stage(batch, llm.runner.layout(batch))
        used.append([bool(buffer.any()) for buffer in llm.runner.staging])
    assert used in ([[True, False], [False, True], [True, False]],
                    [[False, True], [True, False], [False, True]])


class _Event:
    """Stands in for a CUDA event of staging buffer `index`, logging what is done with it."""

    def __init__(self, index, log):
        self.index, self.log = index, log

    def synchronize(self):
        self.log.append(("wait", self.index))

    def record(self, stream):
        self.log.append(("record", self.index))


def test_a_staging_buffer_is_packed_again_only_once_its_last_copy_has_left(llm, monkeypatch):
    # With overlap, a step that samples nothing is never waited for: its buffer's copy to the
    # device may still be queued when the buffer comes round again. On CUDA each copy records
    # an event that the next packing of the same buffer waits on.
    log = []
    monkeypatch.setattr(llm.runner, "_copied", (_Event(0, log), _Event(1, log)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    packed = []
    pack = runner_module.pack_step
    monkeypatch.setattr(runner_module, "pack_step", lambda batch, cache, host, *rest: (
        packed.append(len(log)), pack(batch, cache, host, *rest)))
    batch = _mixed_batch(llm)
    for _ in range(3):
        llm.runner.stage(batch, llm.runner.layout(batch))
    first = log[0][1]  # the buffers are used in turn, from whichever is next
    buffers = [first, 1 - first, first]
    assert log == [entry for b in buffers for entry in (("wait", b), ("record", b))]
    assert packed == [1, 3, 5]  # each packing after its buffer's wait, before its record


def test_a_step_in_inference_mode_leaves_buffers_a_later_step_writes_outside_it(llm):
    batch = _mixed_batch(llm)
    with torch.inference_mode():
        llm.runner.run(batch)
    # what failed on CUDA when the staging buffer was made lazily in inference mode:
    # "Inplace update to inference tensor outside InferenceMode"
    flat = llm.runner.stage(batch, llm.runner.layout(batch))
    assert not flat.is_inference()
    assert not any(buffer.is_inference() for buffer in llm.runner.staging)


def test_the_engine_runs_each_step_in_inference_mode(llm, monkeypatch):
    seen = []
    schedule = llm.scheduler.schedule

    def recording_schedule():
        seen.append(torch.is_inference_mode_enabled())
        return schedule()

    monkeypatch.setattr(llm.scheduler, "schedule", recording_schedule)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert seen and all(seen) and not torch.is_inference_mode_enabled()


def test_a_step_larger_than_the_staging_buffer_is_refused_before_the_workspace_changes(llm):
    batch = _mixed_batch(llm)
    _inputs(llm, batch)
    used = llm.workspace.used
    too_large = StepLayout(12, llm.config.max_num_batched_tokens + 1, 64 // PAGE, 12)
    with pytest.raises(ValueError, match=r"needs \d+ metadata elements; the staging buffer "
                                         r"holds \d+"):
        llm.runner.stage(batch, too_large)
    assert llm.workspace.used == used


def test_a_step_exactly_the_size_of_the_staging_buffer_is_staged(llm):
    # one padded row of 4 tokens, its page table as wide as fills the buffer to the element
    padding = llm.runner.padding._replace(num_tokens=4)
    size = llm.runner.staging[0].numel()
    layout = StepLayout(1, 4, size - StepLayout(1, 4, 0, 1).size, 1)
    assert layout.size == size
    inputs = llm.runner.context(llm.runner.stage(ScheduledBatch(), layout, padding), layout,
                                HostLengths([0, 4], [4], 4, 4))
    assert _as_lists(inputs)["slot_mapping"] == [padding.slots[0]] * 4


def test_an_input_id_0_is_a_token_not_a_placeholder(llm):
    # placeholders are negative; token 0 keeps its id whatever the previous step sampled
    batch = _batch(llm, [("z", [0, 5, 0, 6, 0], 0, 5, True)])
    layout = llm.runner.layout(batch)
    flat = llm.runner.stage(batch, layout, last_tokens=torch.tensor([9], device=llm.cache.device))
    assert layout.split(flat).input_ids.tolist() == [0, 5, 0, 6, 0]


def test_a_step_after_one_that_sampled_nothing_runs_as_without_last_tokens(llm):
    # with overlap, a step whose chunks sample nothing hands the next an empty token tensor
    batch = _mixed_batch(llm)
    layout = llm.runner.layout(batch)
    flat = llm.runner.stage(batch, layout,
                            last_tokens=torch.empty(0, dtype=torch.int64, device=llm.cache.device))
    assert layout.split(flat).input_ids.tolist() == _reference_inputs(llm.cache, batch)["input_ids"]


def test_runner_logits_equal_a_forward_on_the_reference_inputs(llm):
    llm.cache.pool.kv.zero_()  # the chunks' prefixes are never computed: no NaN bits to read
    batch = _mixed_batch(llm)
    ref = _reference_inputs(llm.cache, batch)
    context = packed_context(llm.cache.pool, ref["input_ids"], batch.starts, batch.ends,
                             [torch.tensor(ref["slot_mapping"])],
                             [torch.tensor(ref["page_tables"])], all_logits=True)
    context.logits_indices = torch.tensor(ref["logits_indices"], device=llm.cache.device)
    assert torch.equal(llm.runner.run(batch), llm.model(context))


# ---- CUDA-graph buckets and padding ------------------------------------------------------

@pytest.mark.parametrize(("max_num_seqs", "sizes"), [
    (1, [1]),
    (5, [1, 2, 4, 5]),
    (8, [1, 2, 4, 8]),
    (12, [1, 2, 4, 8, 12]),
    (32, [1, 2, 4, 8, 16, 24, 32]),
    (60, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 60]),
])
def test_graph_batch_sizes_are_powers_of_two_then_multiples_of_8(max_num_seqs, sizes):
    assert graph_batch_sizes(max_num_seqs) == sizes


def _decodes(llm, n, first=0):
    return _batch(llm, [(f"s{i}", [i + 1] * (i % 7 + 2), i % 7 + 1, i % 7 + 2, True)
                        for i in range(first, first + n)])


def _written_decodes(llm, n):
    """`_decodes` whose earlier tokens' K/V a prefill wrote: their decode reads it, and a
    pool nothing wrote may hold NaN bits (whatever memory the pool was given)."""
    batch = _decodes(llm, n)
    llm.runner.run(_batch(llm, [(s.seq_id, s.token_ids, 0, a, False)
                                for s, a in zip(batch.seqs, batch.starts, strict=True)]))
    return batch


@pytest.mark.parametrize(("size", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 12),
                                              (12, 12)])
def test_a_decode_batch_runs_at_the_smallest_bucket_that_holds_it(llm, size, bucket):
    graphs = CUDAGraphRunner(llm.runner, 12, 64)
    assert graphs.bucket(_decodes(llm, size)) == bucket


def test_prefill_and_oversized_batches_run_eagerly(llm):
    graphs = CUDAGraphRunner(llm.runner, 4, 64)
    assert graphs.bucket(_decodes(llm, 5)) is None
    prefill = _batch(llm, [("p", [1, 2, 3], 0, 3, True)])
    unsampled = _batch(llm, [("q", [1, 2, 3], 1, 2, False)])
    assert not is_decode_only(prefill) and graphs.bucket(prefill) is None
    assert not is_decode_only(unsampled) and graphs.bucket(unsampled) is None


def test_padded_rows_use_the_pools_reserved_page_which_no_sequence_holds(llm):
    before = llm.cache.stats()
    graphs = CUDAGraphRunner(llm.runner, 12, 64)
    assert (graphs.pad_page, graphs.pad_slot) == (64, 64 * PAGE)  # the page after the 64
    assert graphs.pad_page == llm.cache.pool.padding_page
    assert llm.cache.stats() == before
    llm.check()
    others = llm.cache.allocator.allocate(llm.cache.allocator.num_free)
    assert graphs.pad_page not in others


def _run_padded(graphs, batch, bucket):
    """What a replay of `bucket`'s graph computes for `batch`, run eagerly (any device)."""
    return graphs.runner.model(graphs.inputs(graphs.stage(batch, bucket), bucket))


def test_after_a_padded_run_the_cache_holds_no_sequence_and_no_used_page(llm):
    graphs = CUDAGraphRunner(llm.runner, 12, 64)
    batch = _decodes(llm, 3)
    _run_padded(graphs, batch, 4)
    _run_padded(graphs, ScheduledBatch(), 8)  # a capture's batch: padding alone
    for seq in batch.seqs:
        llm.cache.free_sequence(seq.seq_id)
    stats = llm.cache.stats()
    assert (stats.num_sequences, stats.num_used_pages, stats.num_reserved_pages) == (0, 0, 1)
    assert stats.num_free_pages + stats.num_cached_pages == stats.num_pages == 64
    assert llm.cache.sequences() == []
    llm.check()


def test_two_graph_runners_share_one_cache_and_its_padding_page(llm):
    first, second = CUDAGraphRunner(llm.runner, 12, 64), CUDAGraphRunner(llm.runner, 4, 64)
    assert first.pad_page == second.pad_page
    llm.cache.pool.kv.fill_(float("nan"))  # as a pool given recycled memory may start
    batch = _written_decodes(llm, 3)
    torch.testing.assert_close(_run_padded(first, batch, 8)[:3],
                               _run_padded(second, batch, 4)[:3], rtol=1e-5, atol=1e-5)
    assert llm.cache.stats().num_sequences == 3
    llm.cache.check()  # sequences added behind the scheduler: the cache alone is checked


def test_after_generate_the_cache_holds_no_sequence_and_no_used_page(llm):
    llm.generate([[1, 2, 3] * 5, [4, 5]], SamplingParams(max_tokens=4), use_tqdm=False)
    stats = llm.cache.stats()
    assert (stats.num_sequences, stats.num_used_pages, llm.stats().num_used_pages) == (0, 0, 0)
    llm.check()


def test_graph_runners_capture_and_replay_on_one_cache_as_often_as_wanted(llm, device):
    if device.type != "cuda":
        pytest.skip("capturing CUDA graphs needs CUDA")
    runners = [CUDAGraphRunner(llm.runner, 4, 64) for _ in range(2)]
    for graphs in runners:
        graphs.capture(progress=False)
    runners[0].capture(progress=False)  # again: the padding page takes any number
    batch = _written_decodes(llm, 3)
    with torch.inference_mode():
        eager = llm.runner.run(batch).clone()
        replays = [graphs.run(batch, 4).clone() for graphs in runners]
    for logits in replays:
        torch.testing.assert_close(logits, eager, rtol=1e-3, atol=1e-3)
    assert llm.cache.stats().num_sequences == 3
    llm.cache.check()  # sequences added behind the scheduler: the cache alone is checked


def test_a_forward_of_padding_alone_changes_no_page_of_the_allocator(llm):
    graphs = CUDAGraphRunner(llm.runner, 12, 64)
    pool = llm.cache.pool
    pool.kv.normal_()
    before = pool.kv.clone()
    _run_padded(graphs, ScheduledBatch(), 12)
    assert torch.equal(pool.kv[:, :, : pool.num_pages], before[:, :, : pool.num_pages])
    assert not torch.equal(pool.kv[:, :, pool.padding_page], before[:, :, pool.padding_page])


def test_padded_rows_write_the_padding_slot_and_read_only_the_padding_page(llm):
    graphs = CUDAGraphRunner(llm.runner, 12, 64)
    batch = _decodes(llm, 3)
    inputs = graphs.inputs(graphs.stage(batch, 4), 4)
    real = _reference_inputs(llm.cache, batch)
    got = _as_lists(inputs)
    width = 64 // PAGE
    assert got["input_ids"] == real["input_ids"] + [0]
    assert got["positions"] == real["positions"] + [0]
    assert got["slot_mapping"] == real["slot_mapping"] + [graphs.pad_slot]
    assert got["seq_lens"] == real["seq_lens"] + [1]
    assert got["cu_seqlens_q"] == [0, 1, 2, 3, 4]
    assert got["logits_indices"] == [0, 1, 2, 3]
    assert got["page_tables"] == [row + [0] * (width - len(row)) for row in real["page_tables"]] \
        + [[graphs.pad_page] * width]
    assert (inputs.attention[0].max_seq_len, inputs.attention[0].max_query_len) == (64, 1)
    assert inputs.host.seq_lens is None and inputs.host.decode_only


def test_graph_page_tables_hold_a_longest_sequence_when_the_model_length_ends_mid_page(llm):
    # 62 tokens take 16 pages of 4: the static page tables are 16 columns, not 15
    graphs = CUDAGraphRunner(llm.runner, 4, 62)
    assert graphs.layout(4).width == 16
    batch = _batch(llm, [("long", [1] * 62, 61, 62, True)])
    got = _as_lists(graphs.inputs(graphs.stage(batch, 1), 1))
    assert got["page_tables"] == llm.cache.page_tables(["long"]).tolist()


def test_graph_inputs_land_at_one_address_whatever_the_batch(llm):
    graphs = CUDAGraphRunner(llm.runner, 12, 64)
    addresses = {graphs.stage(_decodes(llm, n, first=n * 10), 8).data_ptr() for n in (5, 6, 8)}
    assert addresses == {llm.workspace.buffer.data_ptr()}


def test_a_padded_forward_changes_no_real_page_but_the_batchs_own_slots(llm):
    graphs = CUDAGraphRunner(llm.runner, 12, 64)
    batch = _written_decodes(llm, 3)
    before = llm.cache.pool.kv.clone()
    eager = llm.runner.run(batch)
    written = llm.cache.slot_mapping([s.seq_id for s in batch.seqs], batch.starts, batch.ends)
    after_eager = llm.cache.pool.kv.clone()
    llm.cache.pool.kv.copy_(before)
    padded = _run_padded(graphs, batch, 8)
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    kv = llm.cache.pool.kv.flatten(2, 3)  # [layers, 2, slots, heads, head_dim]
    # bytes, not floats: unwritten slots may hold NaN, which never equals itself
    differ = kv.view(torch.uint8) != before.flatten(2, 3).view(torch.uint8)
    changed = differ.flatten(3).any(-1).any(0).any(0).nonzero().flatten()
    assert set(changed.tolist()) <= {*written.tolist(), graphs.pad_slot}
    real = written.tolist()  # the same K/V as eager, up to the matmuls' batch-size rounding
    torch.testing.assert_close(kv[:, :, real], after_eager.flatten(2, 3)[:, :, real],
                               rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def bamba_checkpoint(tmp_path_factory):
    return save_hf_model(make_bamba("bamba"), tmp_path_factory.mktemp("bamba"))


def test_padded_hybrid_rows_use_the_padding_page_and_the_padding_state_slot(
        bamba_checkpoint, device):
    llm = LLM(bamba_checkpoint, num_pages=32, page_size=PAGE, max_num_seqs=4, max_model_len=64,
              prefix_caching=False, device=device)
    cache, states = llm.cache, llm.cache.states
    cache.pool.kv.zero_()  # the pool starts unwritten: NaN bits in it would never compare equal
    graphs = CUDAGraphRunner(llm.runner, 4, 64)
    batch = _written_decodes(llm, 2)
    kv, conv, ssm = cache.pool.kv.clone(), states.conv.clone(), states.ssm.clone()
    eager = llm.runner.run(batch)
    cache.pool.kv.copy_(kv)
    states.conv.copy_(conv)
    states.ssm.copy_(ssm)
    inputs = graphs.inputs(graphs.stage(batch, 4), 4)
    real = [cache.state_slot(s.seq_id) for s in batch.seqs]
    assert inputs.states.slots.tolist() == real + [states.padding_slot] * 2
    padded = llm.model(inputs)
    torch.testing.assert_close(padded[:2], eager, rtol=1e-4, atol=1e-4)
    others = [slot for slot in range(states.num_slots) if slot not in real]
    assert torch.equal(states.conv[:, others], conv[:, others])
    assert torch.equal(states.ssm[:, others], ssm[:, others])
    assert not torch.equal(states.ssm[:, states.padding_slot], ssm[:, states.padding_slot])
    written = cache.slot_mapping([s.seq_id for s in batch.seqs], batch.starts, batch.ends)
    flat, before = cache.pool.kv.flatten(2, 3), kv.flatten(2, 3)
    untouched = [slot for slot in range(cache.num_pages * PAGE) if slot not in written.tolist()]
    assert torch.equal(flat[:, :, untouched], before[:, :, untouched])
    stats = cache.stats()
    assert (stats.num_sequences, states.stats().num_used, states.stats().num_reserved) == (
        2, 2, 1)
    cache.check()


# ---- workspace planning and stats --------------------------------------------------------

def test_the_workspace_holds_the_largest_steps_metadata_and_the_attention_scratch(llm):
    mc, config = llm.model_config, llm.config
    width = 64 // PAGE
    metadata = StepLayout(12, config.max_num_batched_tokens, width, 12, states=True).size * 8
    scratch = decode_scratch_bytes(12, mc.num_heads, mc.head_dim, MAX_DECODE_SPLITS)
    assert llm.workspace.nbytes == metadata + scratch + 8 * ALIGNMENT


def test_stats_report_the_workspace_and_no_graphs_on_the_cpu():
    llm = LLM("tiny", num_pages=64, page_size=PAGE, max_model_len=64, max_num_seqs=12,
              device="cpu")
    llm.generate([[1, 2, 3] * 9, [4, 5]], SamplingParams(max_tokens=3), use_tqdm=False)
    stats = llm.stats()
    assert stats.workspace_bytes == llm.workspace.nbytes
    assert 0 < stats.workspace_peak_bytes <= stats.workspace_bytes
    assert (stats.num_cuda_graphs, stats.cuda_graph_bytes, stats.num_graph_steps) == (0, 0, 0)


def test_graph_memory_is_planned_unless_enforce_eager(llm):
    dtype = llm.model.dtype
    assert llm.config.cuda_graph_bytes(llm.model_config, dtype) > 0
    eager = LLM("tiny", num_pages=8, enforce_eager=True)
    assert eager.config.cuda_graph_bytes(eager.model_config, dtype) == 0


def test_enforce_eager_must_be_a_bool():
    with pytest.raises(TypeError, match="enforce_eager"):
        LLM("tiny", num_pages=8, enforce_eager="yes")


# ---- the start-up warm-up ----------------------------------------------------------------

@pytest.mark.parametrize("enforce_eager", [False, True])
def test_an_engine_on_one_gpu_warms_up_its_shortest_and_longest_prefill(
        device, enforce_eager, monkeypatch):
    warmed = []
    monkeypatch.setattr(ModelRunner, "warm_up", lambda runner, lens: warmed.append(list(lens)))
    LLM("tiny", num_pages=64, page_size=PAGE, max_model_len=64, max_num_batched_tokens=48,
        device=device, enforce_eager=enforce_eager)
    # the CPU compiles nothing at run time: no warm-up there
    assert warmed == ([[2, 48]] if device.type == "cuda" else [])


def test_the_warm_up_is_a_prefill_row_of_each_length_on_the_padding_page(llm):
    steps = []  # read at once: each step's views alias the workspace the next one reuses
    llm.runner.model = lambda context: steps.append(
        (_as_lists(context), context.host.max_seq_len, context.host.max_query_len))
    llm.runner.warm_up([2, 9])
    pad = llm.runner.padding
    for (got, max_seq_len, max_query_len), n in zip(steps, [2, 9], strict=True):
        assert got == dict(input_ids=[0] * n, positions=list(range(n)),
                           slot_mapping=[pad.slots[0]] * n,
                           page_tables=[[pad.pages[0]] * -(-n // PAGE)], seq_lens=[n],
                           cu_seqlens_q=[0, n], logits_indices=[n - 1])
        assert (max_seq_len, max_query_len) == (n, n)


def test_the_warm_up_of_whole_pages_takes_no_extra_page_table_column(llm):
    steps = []
    llm.runner.model = lambda context: steps.append(_as_lists(context)["page_tables"])
    llm.runner.warm_up([PAGE, 2 * PAGE])
    pad = llm.runner.padding.pages[0]
    assert steps == [[[pad]], [[pad, pad]]]
