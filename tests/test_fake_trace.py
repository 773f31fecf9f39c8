"""Every model family's decode step reads nothing back from the device, so a CUDA graph can
replay it: its forward, on the forward context the CUDA-graph runner builds for a padded
decode batch, traces with fake tensors (`make_fx(tracing_mode="fake")`) into a graph with no
`.item()` / `.tolist()` (aten._local_scalar_dense), `nonzero` or `unique`, no shape that
depends on the data (an unbacked symbolic size) and no tensor made on the default device (a
host tensor among device tensors), and the trace never branches on a value.
kvpool's attention ops enter the trace as custom ops with fake implementations (their kernels
are tested on their own); the pools are constants, the context's tensors the inputs."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import kvpool.models.llama
import kvpool.models.mla
from hybrid_util import make_bamba
from kvpool.attention import paged_attention, write_kv, write_latent
from kvpool.engine import LLM
from kvpool.engine.graphs import CUDAGraphRunner
from kvpool.engine.scheduler import ScheduledBatch
from kvpool.forward_context import ForwardContext
from kvpool.models.llama import LlamaForCausalLM
from kvpool.models.loader import MODEL_CLASSES
from kvpool.models.moe import MoE
from kvpool.rope import Rotation
from models_util import make_hf_model, save_hf_model
from test_deepseek import CONFIGS as DEEPSEEK
from test_families import CONFIGS as FAMILY_CONFIGS
from test_gpt_oss import make_gpt_oss
from test_granite_hybrid import CONFIGS as GRANITE_HYBRID
from test_granite_moe import CONFIGS as GRANITE_MOE
from test_moe_families import CONFIGS as MOE_FAMILIES
from test_qwen3_moe import CONFIGS as QWEN3_MOE
from test_qwen3_moe import MIXTRAL
from test_qwen3_next import make_qwen3_next
from test_windows import CONFIGS as WINDOWED

BUCKET, MAX_MODEL_LEN = 4, 64
FAMILIES = {  # name: a small random transformers model of the family
    "llama": lambda: make_hf_model("llama"),
    "qwen3": lambda: make_hf_model("qwen3"),
    "qwen3-moe": lambda: make_hf_model("qwen3-moe", configs=QWEN3_MOE),  # dense and MoE layers
    "mixtral": lambda: make_hf_model("mixtral-window-8", configs=MIXTRAL),  # MoE, a window
    "smollm3": lambda: make_hf_model("smollm3"),  # layers without RoPE
    "olmo2": lambda: make_hf_model("olmo2"),  # post-norms, q/k normed across all heads
    # OLMo 2's layers, windows and a rope of the sliding layers' own
    "olmo3": lambda: make_hf_model("olmo3", configs=FAMILY_CONFIGS),
    "seed-oss": lambda: make_hf_model("seed-oss", configs=FAMILY_CONFIGS),  # Llama's, biased
    "arcee": lambda: make_hf_model("arcee", configs=FAMILY_CONFIGS),  # an ungated MLP
    "ernie4_5": lambda: make_hf_model("ernie4_5", configs=FAMILY_CONFIGS),  # q/k rows reordered
    "apertus": lambda: make_hf_model("apertus", configs=FAMILY_CONFIGS),  # xIELU, q/k norms
    "glm4": lambda: make_hf_model("glm4", configs=FAMILY_CONFIGS),  # post-norms, half rotary
    "glm": lambda: make_hf_model("glm", configs=FAMILY_CONFIGS),  # half rotary, in pairs
    # post-norms, a window pool, full layers without RoPE
    "exaone4": lambda: make_hf_model("exaone4", configs=FAMILY_CONFIGS),
    "granite": lambda: make_hf_model("granite"),  # the multipliers
    # the multipliers and MoE layers with a shared MLP
    "granitemoe-shared": lambda: make_hf_model("granitemoe-shared", configs=GRANITE_MOE),
    "qwen2-moe": lambda: make_hf_model("qwen2-moe", configs=QWEN3_MOE),  # a gated shared expert
    "gemma3": lambda: make_hf_model("gemma3", configs=WINDOWED),  # a full and a window pool
    "gemma2": lambda: make_hf_model("gemma2", configs=WINDOWED),  # softcapped scores, logits
    "gpt-oss": lambda: make_gpt_oss("gpt-oss"),  # sinks, a window, experts with biases
    "deepseek-v2": lambda: make_hf_model("v2-grouped-yarn", configs=DEEPSEEK),
    "deepseek-v3": lambda: make_hf_model("v3-yarn", configs=DEEPSEEK),
    # q/k norms and partial rotary, V3's grouped sigmoid routing with its bias
    "glm4-moe": lambda: make_hf_model("glm4-moe", configs=MOE_FAMILIES),
    # softmax routing with a [1, experts] bias and a renormalisation floor
    "ernie4_5-moe": lambda: make_hf_model("ernie4_5-moe", configs=MOE_FAMILIES),
    "bamba": lambda: make_bamba("bamba"),
    # Bamba's layers with Granite MoE's experts and multipliers, attention without RoPE
    "granite-hybrid": lambda: make_bamba("granite-hybrid", configs=GRANITE_HYBRID),
    # without experts: the shared MLP as each layer's dense MLP
    "granite-hybrid-dense": lambda: make_bamba("granite-hybrid-dense", configs=GRANITE_HYBRID),
    # Gated DeltaNet layers, gated attention, experts with a gated shared expert
    "qwen3-next": lambda: make_qwen3_next("qwen3-next"),
    # dense MLP layers, biases
    "qwen3-next-dense": lambda: make_qwen3_next("qwen3-next-listed-dense-biased-tied"),
}
FORBIDDEN = ("aten._local_scalar_dense", "aten.nonzero", "aten._unique", "aten.unique",
             "aten.item")  # host reads and data-dependent shapes


@torch.library.custom_op("kvpool_trace::write_kv", mutates_args=("k_cache", "v_cache", "q"))
def _write_kv_op(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
    write_kv(k_cache, v_cache, slots, k, v, rotation=Rotation(q, cos, sin))


@_write_kv_op.register_fake
def _(k_cache, v_cache, slots, k, v, q, cos, sin) -> None:
    return None


@torch.library.custom_op("kvpool_trace::write_kv_unrotated", mutates_args=("k_cache", "v_cache"))
def _write_kv_unrotated_op(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           k: torch.Tensor, v: torch.Tensor) -> None:
    write_kv(k_cache, v_cache, slots, k, v)


@_write_kv_unrotated_op.register_fake
def _(k_cache, v_cache, slots, k, v) -> None:
    return None


@torch.library.custom_op("kvpool_trace::write_latent", mutates_args=("cache",))
def _write_latent_op(cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
    write_latent(cache, slots, latent)


@_write_latent_op.register_fake
def _(cache, slots, latent) -> None:
    return None


@torch.library.custom_op("kvpool_trace::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        page_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, scale: float, sliding_window: int | None,
                        softcap: float | None, sinks: torch.Tensor | None,
                        max_seq_len: int | None, max_query_len: int | None) -> torch.Tensor:
    return paged_attention(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q,
                           scale=scale, sliding_window=sliding_window, softcap=softcap,
                           sinks=sinks, max_seq_len=max_seq_len, max_query_len=max_query_len)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, scale, sliding_window, softcap,
      sinks, max_seq_len, max_query_len) -> torch.Tensor:
    return torch.empty_like(q)


def _traced_write_kv(k_cache, v_cache, slots, k, v, *, k_scale=None, v_scale=None,
                     rotation):
    assert k_scale is None and v_scale is None  # the traced pools hold no fp8 pages
    if rotation is None:  # a NoPE layer
        _write_kv_unrotated_op(k_cache, v_cache, slots, k, v)
    else:
        _write_kv_op(k_cache, v_cache, slots, k, v, *rotation)


def _traced_write_latent(cache, slots, latent, *, scale=None):
    assert scale is None
    _write_latent_op(cache, slots, latent)


def _traced_paged_attention(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, *,
                            scale=None, sliding_window=None, softcap=None, sinks=None,
                            max_seq_len=None, max_query_len=None, workspace=None, k_scale=None,
                            v_scale=None):
    assert k_scale is None and v_scale is None
    return _paged_attention_op(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q,
                               scale, sliding_window, softcap, sinks, max_seq_len,
                               max_query_len)


@pytest.fixture(autouse=True)
def attention_as_custom_ops(monkeypatch):
    for module in (kvpool.models.llama, kvpool.models.mla):
        monkeypatch.setattr(module, "paged_attention", _traced_paged_attention)
    monkeypatch.setattr(kvpool.models.llama, "write_kv", _traced_write_kv)
    monkeypatch.setattr(kvpool.models.mla, "write_latent", _traced_write_latent)


def host_reads(fn, *inputs) -> list[str]:
    """What in the fake-tensor trace of `fn(*inputs)` reads device data on the host or
    takes a shape from it: the forbidden ops and data-dependent shapes in its graph, or the
    error that stopped the trace (a branch on a value)."""
    return traced(fn, *inputs)[1]


def traced(fn, *inputs) -> tuple[torch.fx.GraphModule | None, list[str]]:
    """(the fake-tensor trace of `fn(*inputs)`, or None if it stopped; `host_reads`)."""
    try:
        # A tensor the forward makes without naming a device lands on the meta device here
        # and meets the inputs' device in some op: the CPU tensor it would be on CUDA, which
        # a CUDA graph cannot capture (it would be copied to the device at every replay).
        with torch.device("meta"):
            graph = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
    except RuntimeError as e:  # torch's data-dependent errors, guards included
        return None, [f"{type(e).__name__}: {str(e).splitlines()[0]}"]
    found = []
    for node in graph.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith(FORBIDDEN):
            found.append(str(node.target))
        val = node.meta.get("val")
        for v in val if isinstance(val, list | tuple) else [val]:
            if isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape):
                found.append(f"{node.target}: shape {tuple(v.shape)}")
    return graph, found


def context_inputs(fn, context: ForwardContext):
    """(`step`, tensors): `step(*tensors)` is `fn(context)` with every device tensor of the
    context (ids, positions, logits indices, each group's metadata, state slots) an input."""
    metas = context.attention
    leaves = [context.input_ids, context.positions, context.logits_indices]
    for meta in metas:
        leaves += [meta.slot_mapping, meta.page_tables, meta.seq_lens, meta.cu_seqlens_q]
    if context.states is not None:
        leaves.append(context.states.slots)

    def step(*tensors):
        it = iter(tensors)
        ids, positions, logits_indices = next(it), next(it), next(it)
        attention = tuple(replace(meta, slot_mapping=next(it), page_tables=next(it),
                                  seq_lens=next(it), cu_seqlens_q=next(it)) for meta in metas)
        states = None if context.states is None else replace(context.states, slots=next(it))
        return fn(replace(context, input_ids=ids, positions=positions,
                          logits_indices=logits_indices, attention=attention, states=states))

    return step, leaves


@pytest.fixture(scope="module", params=list(FAMILIES))
def engine(request, tmp_path_factory):
    folder = save_hf_model(FAMILIES[request.param](), tmp_path_factory.mktemp(request.param))
    return LLM(folder, device="cpu", num_pages=64, page_size=4, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=BUCKET)


def decode_context(llm: LLM) -> ForwardContext:
    """The context the CUDA-graph runner builds for 3 decoding sequences padded to 4."""
    batch = ScheduledBatch()
    for i, n in enumerate((5, 9, 14)):
        seq_id = f"trace{i}-{len(llm.cache.sequences())}"
        token_ids = [(7 * i + t) % 100 for t in range(n)]
        llm.cache.add_sequence(seq_id, token_ids)
        batch.seqs.append(SimpleNamespace(seq_id=seq_id, token_ids=token_ids))
        batch.starts.append(n - 1)
        batch.ends.append(n)
        batch.sampled.append(True)
    graphs = CUDAGraphRunner(llm.runner, BUCKET, MAX_MODEL_LEN)
    return graphs.inputs(graphs.stage(batch, BUCKET), BUCKET)


def test_every_familys_decode_step_reads_nothing_back(engine):
    step, inputs = context_inputs(engine.model, decode_context(engine))
    graph, found = traced(step, *inputs)
    assert found == []
    (logits,) = graph.graph.output_node().args  # the logits of the padded batch
    assert tuple(logits.meta["val"].shape) == (BUCKET, engine.model.config.vocab_size)


def test_the_trace_covers_every_model_class_and_architecture():
    # CUDA graphs capture every model's decode step (LLM names no exceptions): each class
    # the loader builds, and each architecture it maps to a class of its own (Qwen3-MoE runs
    # on the Llama class with experts in its layers), must be a family traced above.
    traced = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "qwen3-moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
              "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
              "olmo3": "Olmo3ForCausalLM", "seed-oss": "SeedOssForCausalLM",
              "arcee": "ArceeForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM",
              "apertus": "ApertusForCausalLM", "glm4": "Glm4ForCausalLM",
              "glm": "GlmForCausalLM",
              "exaone4": "Exaone4ForCausalLM",
              "granite": "GraniteForCausalLM", "qwen2-moe": "Qwen2MoeForCausalLM",
              "granitemoe-shared": "GraniteMoeSharedForCausalLM",
              "gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
              "gpt-oss": "GptOssForCausalLM",
              "deepseek-v2": "DeepseekV2ForCausalLM", "deepseek-v3": "DeepseekV3ForCausalLM",
              "glm4-moe": "Glm4MoeForCausalLM", "ernie4_5-moe": "Ernie4_5_MoeForCausalLM",
              "bamba": "BambaForCausalLM", "granite-hybrid": "GraniteMoeHybridForCausalLM",
              "granite-hybrid-dense": "GraniteMoeHybridForCausalLM",
              "qwen3-next": "Qwen3NextForCausalLM", "qwen3-next-dense": "Qwen3NextForCausalLM"}
    assert set(traced) == set(FAMILIES)
    assert all(type(FAMILIES[name]()).__name__ == arch for name, arch in traced.items())
    assert set(MODEL_CLASSES) <= set(traced.values())
    classes = {MODEL_CLASSES.get(arch, LlamaForCausalLM) for arch in traced.values()}
    assert classes == {LlamaForCausalLM, *MODEL_CLASSES.values()}


@pytest.mark.parametrize("read", [
    lambda x: x.sum().item(),
    lambda x: x.tolist(),
    lambda x: x.nonzero(),
    lambda x: x.unique(),
    lambda x: x[x > 0],
    lambda x: torch.where(x > 0, torch.zeros(()), x),  # a tensor on the default device
])
def test_the_trace_finds_a_host_read_or_a_data_dependent_shape(read):
    assert host_reads(read, torch.arange(4))


def test_the_trace_finds_the_prefill_expert_loops_host_reads(engine):
    moe = next((m for m in engine.model.modules() if isinstance(m, MoE)), None)
    if moe is None:
        pytest.skip("not a mixture-of-experts model")
    x = torch.randn(BUCKET, engine.model.config.hidden_size)
    assert host_reads(lambda h: moe(h, True), x) == []
    assert host_reads(lambda h: moe(h, False), x)
