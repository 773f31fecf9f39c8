"""Helpers for the model tests: small random transformers checkpoints, and a runner that drives
a kvpool model over a KVCache in packed steps (prefill, chunked prefill, batched decode)."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from safetensors.torch import load_file, save_file

from kvpool.attention import AttentionMetadata
from kvpool.cache import KVCache
from kvpool.engine import LLM, SamplingParams
from kvpool.forward_context import ForwardContext, HostLengths
from kvpool.memory.grouped_pool import GroupedPool
from kvpool.memory.pool import KVPool
from kvpool.memory.state_pool import StateBatch
from kvpool.models.llama import LlamaForCausalLM
from kvpool.models.loader import load_model

SMALL = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "llama-rope-llama3-biases": lambda: transformers.LlamaConfig(
        **SMALL, attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama-rope-linear": lambda: transformers.LlamaConfig(
        **SMALL, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-tied": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
    # an epsilon large enough to move every norm's output, the q/k norms' included
    "qwen3-norm-eps": lambda: transformers.Qwen3Config(**SMALL, head_dim=32, rms_norm_eps=0.5),
    # Qwen3's long-context recipe: 4x the trained context, cos/sin scaled by 1 + 0.1 ln 4
    "qwen3-rope-yarn": lambda: transformers.Qwen3Config(
        **SMALL, head_dim=32,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral-window-8": lambda: transformers.MistralConfig(**SMALL, sliding_window=8),
    # fused qkv_proj and gate_up_proj in the checkpoint, split by the loader; Phi-3 has no
    # biases, whatever attention_bias says
    "phi3-window-8": lambda: transformers.Phi3Config(**SMALL, sliding_window=8,
                                                     attention_bias=True),
    # Phi-4-mini's rope: LongRoPE over 3/4 of each head, here its short factors (sequences
    # stay within the trained context) and a given attention factor
    "phi3-longrope-partial": lambda: phi3_longrope(256, {"attention_factor": 1.25}),
    # Granite's multipliers of the embedding, the residual branches, the attention scores
    # (in place of 1 / sqrt(head_dim)) and the logits; biases on q, k, v, o and the MLP
    "granite": lambda: transformers.GraniteConfig(
        **SMALL, embedding_multiplier=2.5, residual_multiplier=0.6, attention_multiplier=0.3,
        logits_scaling=3.0, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    # norms after attention and the MLP (none before), q and k normed across all heads
    "olmo2": lambda: transformers.Olmo2Config(**SMALL, attention_bias=True),
    # no RoPE on every second layer (NoPE), q/k left as projected; biases on q, k, v, o and
    # the MLP
    "smollm3": lambda: transformers.SmolLM3Config(**SMALL, no_rope_layer_interval=2,
                                                  attention_bias=True, mlp_bias=True),
}


def phi3_longrope(trained_context: int, rope: dict | None = None,
                  **config) -> transformers.Phi3Config:
    """A small Phi-3 config (SMALL and `config`) with LongRoPE over 3/4 of each head (6
    frequencies), trained on `trained_context` positions, `rope` added to its parameters."""
    return transformers.Phi3Config(
        **SMALL, original_max_position_embeddings=trained_context, partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0], **(rope or {})},
        **config)


def make_hf_model(name: str, seed: int = 0, configs=CONFIGS) -> transformers.PreTrainedModel:
    """A small random float32 transformers model of configs[name]. Norm scales and biases
    are randomised too (transformers initialises them to 1 and 0, which would hide bugs), and
    so are the routers' correction biases (zeros: DeepSeek-V3's, GLM-4.5's, Ernie 4.5's)."""
    torch.manual_seed(seed)
    config = configs[name]()
    config._attn_implementation = "eager"
    auto = transformers.AutoModelForImageTextToText if hasattr(config, "vision_config") \
        else transformers.AutoModelForCausalLM
    model = auto.from_config(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(1.0, 0.2)
            elif param_name.endswith(".bias"):
                param.normal_(0.0, 0.2)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.2)
    return model


def save_hf_model(model: transformers.PreTrainedModel, folder: Path, **kwargs) -> Path:
    """save_pretrained into `folder`; returns it."""
    model.save_pretrained(folder, **kwargs)
    return folder


def packed_context(kv: KVPool | GroupedPool, input_ids: list[int], starts: list[int],
                   ends: list[int], slot_mappings: list[torch.Tensor],
                   page_tables: list[torch.Tensor], *, all_logits: bool = False,
                   states: StateBatch | None = None) -> ForwardContext:
    """The ForwardContext of a packed step of sequences computing tokens [starts[b], ends[b])
    (one slot mapping and page tables per layer group of `kv`), on kv's device; logits of
    every token if `all_logits`, else of each sequence's last."""
    device = kv.pools[0].kv.device if isinstance(kv, GroupedPool) else kv.kv.device
    if isinstance(kv, KVPool):
        kv = GroupedPool(kv.layout, (kv,))
    query_starts = [0]
    for start, end in zip(starts, ends, strict=True):
        query_starts.append(query_starts[-1] + end - start)
    host = HostLengths(query_starts, list(ends), max(ends),
                       max(b - a for a, b in zip(starts, ends, strict=True)))
    seq_lens = torch.tensor(ends, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.tensor(query_starts, dtype=torch.int32, device=device)
    attention = tuple(
        AttentionMetadata(slots.to(device), tables.to(device=device, dtype=torch.int32),
                          seq_lens, cu_seqlens_q, host.max_seq_len, host.max_query_len)
        for slots, tables in zip(slot_mappings, page_tables, strict=True))
    positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
    logits_indices = range(len(input_ids)) if all_logits else query_starts[1:]
    return ForwardContext(
        torch.tensor(input_ids, device=device), positions.to(device),
        torch.tensor([i - (not all_logits) for i in logits_indices], device=device),
        attention, kv, host, states)


class PagedRunner:
    """Runs packed forward passes of a kvpool model for several sequences on a KVCache whose
    free pages are handed out in shuffled order, so page tables are scattered, on the model's
    device (page tables and slots moved there from the host, as the engine's runner does). The
    pages are of the model's dtype unless `kv_dtype` says otherwise (float8_e4m3fn: fp8
    pages); an all-windowed model's pages go back out of the window unless not
    `free_out_of_window`."""

    def __init__(self, model: LlamaForCausalLM, *, num_pages: int = 128, page_size: int = 4,
                 seed: int = 0, kv_dtype: torch.dtype | None = None,
                 free_out_of_window: bool = True):
        layout = model.config.kv_layout(dtype=kv_dtype or model.dtype, page_size=page_size)
        self.model = model
        self.device = model.rotary_emb.inv_freq.device
        self.cache = KVCache(layout, num_pages, device=self.device,
                             free_out_of_window=free_out_of_window)
        pages = self.cache.allocator.allocate(num_pages)
        random.Random(seed).shuffle(pages)
        self.cache.allocator.free(pages)
        self.cache.pool.kv.fill_(float("nan"))  # unwritten slots must never be read

    def step(self, chunks: dict[str, list[int]], *, all_logits: bool = False) -> torch.Tensor:
        """One forward pass over the new tokens of each sequence (created on first sight).
        Returns float32 logits: of every new token if `all_logits`, else of each last one."""
        seq_ids = list(chunks)
        starts, ends = [], []
        for seq_id, tokens in chunks.items():
            if seq_id in self.cache.sequences():
                starts.append(self.cache.num_tokens(seq_id))
                self.cache.append(seq_id, len(tokens))
            else:
                starts.append(0)
                self.cache.add_sequence(seq_id, num_tokens=len(tokens))
            ends.append(self.cache.num_tokens(seq_id))
        input_ids = [t for tokens in chunks.values() for t in tokens]
        return self.model(packed_context(
            self.cache.pool, input_ids, starts, ends,
            [self.cache.slot_mapping(seq_ids, starts, ends)],
            [self.cache.page_tables(seq_ids)], all_logits=all_logits))

    def greedy(self, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
        """Prefill all prompts in one pass, then decode all together; `max_tokens` greedy
        tokens per sequence."""
        out: dict[str, list[int]] = {seq_id: [] for seq_id in prompts}
        chunks = prompts
        for _ in range(max_tokens):
            next_tokens = self.step(chunks).argmax(-1).tolist()
            for seq_id, token in zip(prompts, next_tokens, strict=True):
                out[seq_id].append(token)
            chunks = {seq_id: [tokens[-1]] for seq_id, tokens in out.items()}
        return out


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding, never stops early). The
    attention mask is given: without it, `generate` masks every prompt token equal to the pad
    token (SmolLM2's pad token is its `<|im_end|>`, which chat prompts hold)."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


def hf_logits(model: transformers.PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """transformers' logits `[len(prompt), vocab]` of every position."""
    with torch.no_grad():
        return model(torch.tensor([prompt], device=model.device)).logits[0].float()


def prompts(vocab_size: int, lengths=(3, 9, 17, 26), seed: int = 1) -> dict[str, list[int]]:
    """Seeded random prompts of the given lengths, keyed "seq0", "seq1", ..."""
    rng = random.Random(seed)
    return {f"seq{i}": [rng.randrange(vocab_size) for _ in range(n)]
            for i, n in enumerate(lengths)}


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def assert_logits_match(hf: transformers.PreTrainedModel, batch: dict[str, list[int]],
                        logits: torch.Tensor, tolerance: float = 1e-4) -> None:
    """The rows of packed `logits` `[sum of prompt lengths, vocab]` for each prompt of `batch`
    equal transformers' logits for it, within `tolerance` relative to their largest."""
    offset = 0
    for prompt in batch.values():
        ours = logits[offset:offset + len(prompt)]
        assert relative_error(ours, hf_logits(hf, prompt)) < tolerance
        offset += len(prompt)


def assert_prefill_logits_match(hf: transformers.PreTrainedModel, model,
                                tolerance: float = 1e-4) -> None:
    """A packed prefill of `prompts` gives transformers' logits: within `tolerance` of their
    largest, and (float32 against float32) within it in absolute terms."""
    batch = prompts(model.config.vocab_size)
    logits = PagedRunner(model).step(batch, all_logits=True)
    assert_logits_match(hf, batch, logits, tolerance)
    offset = 0
    for prompt in batch.values():
        ours = logits[offset:offset + len(prompt)]
        torch.testing.assert_close(ours, hf_logits(hf, prompt), rtol=0, atol=tolerance)
        offset += len(prompt)


def assert_greedy_decode_matches(hf: transformers.PreTrainedModel, model,
                                 max_tokens: int) -> None:
    """A batched greedy decode of `prompts` on scattered pages gives transformers' tokens,
    and leaves the cache's invariants whole."""
    batch = prompts(model.config.vocab_size)
    runner = PagedRunner(model)
    ours = runner.greedy(batch, max_tokens)
    assert ours == {seq_id: hf_greedy(hf, prompt, max_tokens) for seq_id, prompt in batch.items()}
    runner.cache.check()


def loaded_pair(name: str, configs, folder: Path, device) -> tuple:
    """(transformers model of config `name` on `device`, the same checkpoint saved in
    `folder` and loaded by kvpool)."""
    hf = make_hf_model(name, configs=configs)
    return hf.to(device), load_model(save_hf_model(hf, folder), device=device).model


def rewrite_weight(folder: Path, name: str, change) -> None:
    """Replace (or add) the weight `name` of a checkpoint folder by `change(its tensor, or
    None where there is none)`."""
    weights = load_file(folder / "model.safetensors")
    weights[name] = change(weights.get(name)).contiguous()
    save_file(weights, folder / "model.safetensors")


class EngineCase(NamedTuple):
    """A saved checkpoint, a batch of prompts and transformers' greedy continuation of each."""

    folder: Path
    batch: list[list[int]]
    expected: list[list[int]]


def engine_case(name: str, configs, folder: Path, device, max_tokens: int) -> EngineCase:
    """A checkpoint of config `name`, 8 prompts (four share a 24-token prefix) and
    transformers' greedy continuations of each, run alone on `device`."""
    return case_of(make_hf_model(name, configs=configs), folder, device, max_tokens)


def case_of(hf: transformers.PreTrainedModel, folder: Path, device,
            max_tokens: int) -> EngineCase:
    """engine_case of the transformers model `hf`, saved into `folder`."""
    folder = save_hf_model(hf, folder)
    hf.to(device)
    shared = prompts(160, lengths=(24,), seed=2)["seq0"]
    batch = list(prompts(160, lengths=(5, 13, 30, 41), seed=3).values())
    batch += [shared + tail for tail in prompts(160, lengths=(1, 6, 9, 17), seed=4).values()]
    return EngineCase(folder, batch, [hf_greedy(hf, prompt, max_tokens) for prompt in batch])


def check_engine_with_prefix_hits_and_chunks(case: EngineCase, device,
                                             greedy: SamplingParams) -> None:
    """Through LLM with prefix hits and 16-token chunks, the greedy tokens are transformers'."""
    llm = LLM(case.folder, num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              device=device)
    outputs = llm.generate(case.batch, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == case.expected
    assert llm.cache.stats().prefix_hit_tokens > 0
    llm.check()


def check_engine_with_preemption(case: EngineCase, device, greedy: SamplingParams) -> None:
    """Through LLM in 96 slots (the longest request needs 73), requests are preempted and
    the greedy tokens are still transformers'."""
    llm = LLM(case.folder, num_pages=24, page_size=4, device=device)
    outputs = llm.generate(case.batch, greedy, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == case.expected
    llm.check()


def streamed(tokenizer, ids: list[int], cuts: list[int], context: int | None = None) -> str:
    """The text a tokenizer's stream gives for `ids` arriving in pieces (cut at the positions
    `cuts`) after token `context`, checking after every piece that, as long as the full
    decodes of the ids one more at a time never took text back (byte pieces can turn invalid
    together), each text is a prefix of the full decode and of the next text."""
    decoded = [tokenizer.decode(ids[:n], context=context) for n in range(len(ids) + 1)]
    grows = [True]  # grows[n]: the decodes of ids[:1], ..., ids[:n] never took text back
    for before, after in itertools.pairwise(decoded):
        grows.append(grows[-1] and after.startswith(before.rstrip("\ufffd")))
    stream, text = tokenizer.stream(context=context), ""
    for end in [*sorted(c for c in cuts if c < len(ids)), len(ids)]:
        previous, text = text, stream.text(ids[:end])
        if grows[end]:
            assert decoded[end].startswith(text) and text.startswith(previous), (
                ids[:end], previous, text, decoded[end])
    return text


def fresh_process_output(code: str) -> str:
    """What `code` prints, run by this Python in a fresh process that imports this
    checkout's kvpool (what a process imports when it starts is the question)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [src, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, check=True).stdout.strip()


def interrupt_once(owner, name: str) -> None:
    """Make `owner.<name>` raise KeyboardInterrupt (a Ctrl-C) on its next call, then be
    itself again."""
    real = getattr(owner, name)

    def interrupted(*args, **kwargs):
        setattr(owner, name, real)
        raise KeyboardInterrupt

    setattr(owner, name, interrupted)
