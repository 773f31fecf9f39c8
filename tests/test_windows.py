"""Models mixing sliding-window and full-attention layers (Qwen2/Qwen3 with layer_types,
Gemma 2, Gemma 3 text) against transformers on sequences longer than the window, and how their
configs are read."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import transformers

import kvpool.models.llama
from kvpool.attention import paged_attention
from kvpool.cache import HOLE
from kvpool.engine import LLM, SamplingParams
from kvpool.engine.config import EngineConfig
from kvpool.errors import ConfigError, OutOfPages
from kvpool.kernels import cpu as cpu_kernel
from kvpool.models.config import FULL, SLIDING, ModelConfig
from kvpool.models.loader import load_model
from models_util import (
    SMALL,
    PagedRunner,
    assert_logits_match,
    hf_greedy,
    make_hf_model,
    prompts,
    save_hf_model,
)
from test_models import MAX_TOKENS

WINDOW = 8  # shorter than every prompt but the first, and than every continuation
FOUR = dict(SMALL, num_hidden_layers=4)
MIXED = [FULL, SLIDING, SLIDING, FULL]
GEMMA = dict(FOUR, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
             rope_parameters={FULL: {"rope_type": "default", "rope_theta": 1000.0},
                              SLIDING: {"rope_type": "default", "rope_theta": 50.0}})
# Gemma 2's caps, binding on these random weights: attention scores reach ~40, logits ~12
GEMMA2 = dict(FOUR, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
              rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
              attn_logit_softcapping=10.0, final_logit_softcapping=5.0)
CONFIGS = {
    "qwen3-layer-types": lambda: transformers.Qwen3Config(
        **FOUR, head_dim=32, use_sliding_window=True, sliding_window=WINDOW, layer_types=MIXED),
    "qwen2-max-window-layers": lambda: transformers.Qwen2Config(
        **FOUR, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "gemma3": lambda: transformers.Gemma3TextConfig(**GEMMA, sliding_window_pattern=2),
    # an epsilon large enough to move every (1 + weight) norm's output, the q/k norms' included
    "gemma3-norm-eps": lambda: transformers.Gemma3TextConfig(**GEMMA, sliding_window_pattern=2,
                                                             rms_norm_eps=0.5),
    "gemma3-linear-rope-untied": lambda: transformers.Gemma3TextConfig(
        **dict(GEMMA, rope_parameters={
            FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 50.0}}),
        layer_types=MIXED, tie_word_embeddings=False),
    # every second layer full from the second on, both caps, the head tied
    "gemma2": lambda: transformers.Gemma2Config(**GEMMA2),
    # a full layer first, q/k/v/o biases, an untied head, norms moved by their epsilon
    "gemma2-layer-types-biases-untied": lambda: transformers.Gemma2Config(
        **GEMMA2, layer_types=MIXED, attention_bias=True, tie_word_embeddings=False,
        rms_norm_eps=0.5),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers model, the same checkpoint loaded by kvpool) for one windowed case."""
    hf = make_hf_model(request.param, configs=CONFIGS)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf.to(device), load_model(folder, device=device).model


def test_each_layer_gets_the_window_transformers_gives_it(pair):
    hf, model = pair
    expected = [WINDOW if t == SLIDING else None for t in hf.config.layer_types]
    assert SLIDING in hf.config.layer_types and FULL in hf.config.layer_types
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == expected


def test_packed_prefill_logits_match_transformers(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    assert_logits_match(hf, batch, PagedRunner(model).step(batch, all_logits=True))


def test_batched_greedy_decode_matches_transformers_generate(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    ours = PagedRunner(model).greedy(batch, MAX_TOKENS)
    for seq_id, prompt in batch.items():
        assert ours[seq_id] == hf_greedy(hf, prompt, MAX_TOKENS)


def test_prompt_prefilled_in_two_chunks_gives_the_same_logits_as_in_one(pair):
    _, model = pair
    prompt = prompts(model.config.vocab_size, lengths=(22,))["seq0"]
    whole = PagedRunner(model).step({"a": prompt}, all_logits=True)
    runner = PagedRunner(model, seed=1)
    runner.step({"a": prompt[:9]})
    second = runner.step({"a": prompt[9:]}, all_logits=True)
    # float32 matrix products of other shapes add in another order: ~1e-5 apart on CUDA
    torch.testing.assert_close(second, whole[9:], rtol=1e-4, atol=1e-4)


def generate_like_transformers(llm: LLM, hf, batch: list[list[int]]) -> list:
    """The engine's greedy outputs of `batch`, once their tokens are checked against
    transformers' generate."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(batch, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, MAX_TOKENS)
                                                          for p in batch]
    return outputs


@pytest.mark.parametrize("name", ["qwen3-layer-types", "gemma3", "gemma2"])
def test_engine_greedy_outputs_with_chunks_and_prefix_hits_equal_transformers(name, tmp_path,
        device):
    hf = make_hf_model(name, configs=CONFIGS)
    folder = save_hf_model(hf, tmp_path)
    hf.to(device)
    shared = prompts(160, lengths=(20,), seed=2)["seq0"]
    batch = list(prompts(160, lengths=(5, 30), seed=3).values())
    batch += [shared + tail for tail in prompts(160, lengths=(3, 11), seed=4).values()]
    llm = LLM(folder, num_pages=64, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
              device=device)
    generate_like_transformers(llm, hf, batch)
    assert llm.cache.stats().prefix_hit_tokens > 0
    llm.check()


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_gemma2_gives_transformers_logits_and_tokens_on_each_attention_backend(
        backend, monkeypatch, tmp_path):
    # Prefill rows, the C kernel's decode rows ("cpu") and Triton's kernels (on CUDA, else in
    # its interpreter) all softcap the scores: as the model calls them.
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    if backend == "cpu" and cpu_kernel.library() is None:
        pytest.skip("the CPU decode kernel did not compile")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    hf = make_hf_model("gemma2", configs=CONFIGS)
    model = load_model(save_hf_model(hf, tmp_path), device=device).model
    hf.to(device)
    monkeypatch.setattr(kvpool.models.llama, "paged_attention",
                        functools.partial(paged_attention, backend=backend))
    batch = prompts(model.config.vocab_size, lengths=(3, 17))
    assert_logits_match(hf, batch, PagedRunner(model).step(batch, all_logits=True))
    ours = PagedRunner(model).greedy(batch, 4)
    assert list(ours.values()) == [hf_greedy(hf, prompt, 4) for prompt in batch.values()]


# Gemma 3's 4B-27B and Mistral Small 3's checkpoints: a text decoder beside a vision encoder
# (not loaded), whose image tokens (157-159) the prompts leave out
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)
MULTIMODAL = {
    "gemma3-multimodal": lambda: transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**GEMMA, sliding_window_pattern=2),
        vision_config=transformers.SiglipVisionConfig(**VISION), mm_tokens_per_image=4,
        boi_token_index=157, eoi_token_index=158, image_token_index=159),
    # 8 heads and 4 KV heads: transformers' defaults
    "gemma3-multimodal-default-heads": lambda: transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(
            **dict(GEMMA, num_attention_heads=8, num_key_value_heads=4),
            sliding_window_pattern=2),
        vision_config=transformers.SiglipVisionConfig(**VISION), mm_tokens_per_image=4,
        boi_token_index=157, eoi_token_index=158, image_token_index=159),
    # a final logit softcap binding on these weights (logits reach ~12), which transformers'
    # Gemma3ForConditionalGeneration leaves unapplied
    "gemma3-multimodal-final-softcap": lambda: transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**GEMMA, sliding_window_pattern=2,
                                                  final_logit_softcapping=3.0),
        vision_config=transformers.SiglipVisionConfig(**VISION), mm_tokens_per_image=4,
        boi_token_index=157, eoi_token_index=158, image_token_index=159),
    # the head tied by the top level's tie_word_embeddings, as transformers ties it
    "mistral3-multimodal": lambda: transformers.Mistral3Config(
        text_config=transformers.MistralConfig(**SMALL, sliding_window=WINDOW),
        vision_config=transformers.PixtralVisionConfig(**VISION, head_dim=16),
        image_token_index=159),
}


@pytest.mark.parametrize(("name", "architecture"), [
    ("gemma3-multimodal", "Gemma3ForCausalLM"),
    ("gemma3-multimodal-final-softcap", "Gemma3ForCausalLM"),
    ("mistral3-multimodal", "MistralForCausalLM")])
def test_a_multimodal_checkpoints_text_decoder_gives_its_logits_and_tokens(name, architecture,
                                                                           tmp_path, device):
    hf = make_hf_model(name, configs=MULTIMODAL).to(device)
    model = load_model(save_hf_model(hf, tmp_path), device=device).model
    assert model.config.architecture == architecture
    batch = prompts(157)
    assert_logits_match(hf, batch, PagedRunner(model).step(batch, all_logits=True))
    ours = PagedRunner(model).greedy(batch, MAX_TOKENS)
    for seq_id, prompt in batch.items():  # no image token comes out (it would want pixels)
        assert ours[seq_id] == hf_greedy(hf, prompt, MAX_TOKENS)


def test_a_multimodal_gemma3_checkpoint_leaving_out_its_heads_gives_transformers_logits(
        tmp_path, device):
    # the heads left out of the text_config, as google/gemma-3-4b-it's config leaves them out
    hf = make_hf_model("gemma3-multimodal-default-heads", configs=MULTIMODAL).to(device)
    folder = save_hf_model(hf, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    for key in ("num_attention_heads", "num_key_value_heads"):
        del config["text_config"][key]
    (folder / "config.json").write_text(json.dumps(config))
    model = load_model(folder, device=device).model
    assert (model.config.num_heads, model.config.num_kv_heads) == (8, 4)
    batch = prompts(157)
    assert_logits_match(hf, batch, PagedRunner(model).step(batch, all_logits=True))


# --- reading the configs ---

def qwen3(**overrides) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
            **overrides}


def test_qwen_without_use_sliding_window_has_no_windowed_layer():
    config = ModelConfig.from_hf(qwen3(sliding_window=8, max_window_layers=1))
    assert [config.layer_window(i) for i in range(4)] == [None] * 4


def test_qwen_windows_the_layers_from_max_window_layers_on():
    config = ModelConfig.from_hf(qwen3(use_sliding_window=True, sliding_window=8,
                                       max_window_layers=1))
    assert [config.layer_window(i) for i in range(4)] == [None, 8, 8, 8]


def test_qwen_windows_the_layers_from_28_on_when_max_window_layers_is_left_out():
    assert transformers.Qwen3Config().max_window_layers == 28
    config = ModelConfig.from_hf(qwen3(use_sliding_window=True, sliding_window=8,
                                       num_hidden_layers=30))
    assert [config.layer_window(i) for i in range(30)] == [None] * 28 + [8, 8]


def test_qwen_layer_types_override_max_window_layers():
    config = ModelConfig.from_hf(qwen3(use_sliding_window=True, sliding_window=8,
                                       max_window_layers=1, layer_types=MIXED))
    assert [config.layer_window(i) for i in range(4)] == [None, 8, 8, None]


def test_sliding_layer_types_without_a_window_are_a_config_error():
    with pytest.raises(ConfigError, match="names 2 sliding_attention layer.*use_sliding_window"):
        ModelConfig.from_hf(qwen3(sliding_window=8, layer_types=MIXED))


def test_layer_types_of_the_wrong_length_are_a_config_error():
    with pytest.raises(ConfigError, match="each of the 4 layers"):
        ModelConfig.from_hf(qwen3(use_sliding_window=True, sliding_window=8,
                                  layer_types=MIXED[:3]))


def gemma3(**overrides) -> dict:
    return {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 7, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 4, **overrides}


def test_gemma3_defaults_window_five_layers_in_six_and_ties_the_head():
    config = ModelConfig.from_hf(gemma3())
    windows = [config.layer_window(i) for i in range(7)]
    assert windows == [4096] * 5 + [None] + [4096]
    assert config.tie_word_embeddings
    assert config.gemma.query_pre_attn_scalar == 256.0


def test_gemma3_old_style_rope_keys_give_both_bases():
    config = ModelConfig.from_hf(gemma3(rope_theta=1e6, rope_local_base_freq=1e4,
                                        rope_scaling={"rope_type": "linear", "factor": 8.0},
                                        sliding_window_pattern=2))
    assert (config.rope_theta, config.rope_scaling) == (1e6, {"rope_type": "linear",
                                                              "factor": 8.0})
    assert (config.gemma.local_rope_theta, config.gemma.local_rope_scaling) == (1e4, None)
    assert [config.layer_window(i) is None for i in range(4)] == [False, True, False, True]


def gemma2(**overrides) -> dict:
    return {**gemma3(**overrides), "architectures": ["Gemma2ForCausalLM"]}


def test_gemma2_defaults_window_every_other_layer_cap_and_tie_the_head():
    config = ModelConfig.from_hf({**gemma2(), "model_type": "gemma2"})
    assert [config.layer_window(i) for i in range(7)] == [4096, None] * 3 + [4096]
    gemma = config.gemma
    assert (gemma.attn_logit_softcapping, gemma.final_logit_softcapping) == (50.0, 30.0)
    assert (gemma.query_pre_attn_scalar, gemma.local_rope_theta) == (256.0, 10000.0)
    assert config.tie_word_embeddings and not config.qk_norm
    assert (config.head_dim, config.max_position_embeddings) == (4, 8192)  # head_dim given
    assert ModelConfig.from_hf({k: v for k, v in gemma2().items()
                                if k != "head_dim"}).head_dim == 256


def test_gemma2_caps_set_to_null_are_off_and_its_window_pattern_is_fixed():
    config = ModelConfig.from_hf(gemma2(attn_logit_softcapping=None,
                                        final_logit_softcapping=None, sliding_window_pattern=6))
    assert (config.gemma.attn_logit_softcapping, config.gemma.final_logit_softcapping) == (
        None, None)
    assert [config.layer_window(i) is None for i in range(4)] == [False, True, False, True]


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
@pytest.mark.parametrize("value", [0, -30.0, "30", float("inf")])
def test_gemma2_softcap_not_a_positive_finite_number_is_refused(key, value):
    with pytest.raises(ConfigError, match=f"'{key}' must be"):
        ModelConfig.from_hf(gemma2(**{key: value}))


@pytest.mark.parametrize(("key", "value", "match"), [
    ("use_bidirectional_attention", True, "Gemma2ForCausalLM with use_bidirectional"),
    ("hidden_activation", "gelu", "unsupported hidden_activation 'gelu'"),
])
def test_gemma2_options_kvpool_does_not_run_are_refused(key, value, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(gemma2(**{key: value}))


def test_gemma3_attention_softcapping_is_refused():
    # transformers' Gemma 3 leaves it unapplied: refused rather than run either way
    with pytest.raises(ConfigError, match="attn_logit_softcapping=30.0 is not supported"):
        ModelConfig.from_hf(gemma3(attn_logit_softcapping=30.0))


def test_gemma3_caps_its_logits_by_a_final_softcap_as_transformers(tmp_path, device):
    configs = {"gemma3-final-cap": lambda: transformers.Gemma3TextConfig(
        **GEMMA, sliding_window_pattern=2, final_logit_softcapping=2.0)}
    hf = make_hf_model("gemma3-final-cap", configs=configs).to(device)
    model = load_model(save_hf_model(hf, tmp_path), device=device).model
    batch = prompts(model.config.vocab_size)
    logits = PagedRunner(model).step(batch, all_logits=True)
    assert logits.abs().max() <= 2.0
    assert_logits_match(hf, batch, logits)


def test_gemma3_bidirectional_attention_is_refused():
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        ModelConfig.from_hf(gemma3(use_bidirectional_attention=True))


# --- pages given back out of the window (every layer windowed: Mistral) ---

MISTRAL = "mistral-window-8"
PAGE_SIZE = 4  # PagedRunner's


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, device):
    hf = make_hf_model(MISTRAL)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(MISTRAL))
    return hf.to(device), load_model(folder, device=device).model


def held_pages(runner: PagedRunner, seq_id: str) -> int:
    return sum(page != HOLE for page in runner.cache.pages(seq_id))


def test_mistral_decodes_on_given_back_pages_like_transformers_holding_a_window(mistral):
    hf, model = mistral
    batch = prompts(model.config.vocab_size)
    runner = PagedRunner(model)
    out = {seq_id: [runner.step({seq_id: prompt}).argmax(-1).item()]
           for seq_id, prompt in batch.items()}
    for _ in range(MAX_TOKENS - 1):
        logits = runner.step({seq_id: tokens[-1:] for seq_id, tokens in out.items()})
        for seq_id, token in zip(out, logits.argmax(-1).tolist(), strict=True):
            out[seq_id].append(token)
            assert held_pages(runner, seq_id) <= -(-WINDOW // PAGE_SIZE) + 1
        runner.cache.check()
    for seq_id, prompt in batch.items():
        assert out[seq_id] == hf_greedy(hf, prompt, MAX_TOKENS)
        assert HOLE in runner.cache.pages(seq_id)


def test_mistral_chunked_prefill_gives_pages_back_between_chunks(mistral):
    _, model = mistral
    prompt = prompts(model.config.vocab_size, lengths=(30,))["seq0"]
    whole = PagedRunner(model).step({"a": prompt}, all_logits=True)
    runner = PagedRunner(model, seed=1)
    for start in range(0, 30, 5):
        logits = runner.step({"a": prompt[start:start + 5]}, all_logits=True)
        torch.testing.assert_close(logits, whole[start:start + 5], rtol=1e-5, atol=1e-5)
        # the chunk's 5 tokens and the 7 before them, on at most 4 pages
        assert held_pages(runner, "a") <= -(-(WINDOW - 1 + 5) // PAGE_SIZE) + 1
    assert runner.cache.pages("a")[:4] == [HOLE] * 4


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mistral_engine_outputs_with_pages_given_back_equal_transformers(mistral, tmp_path,
                                                                         prefix_caching, device):
    hf, _ = mistral
    folder = save_hf_model(hf, tmp_path)
    shared = prompts(160, lengths=(20,), seed=2)["seq0"]
    batch = list(prompts(160, lengths=(5, 30), seed=3).values())
    batch += [shared + tail for tail in prompts(160, lengths=(3, 11), seed=4).values()]
    llm = LLM(folder, num_pages=24, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
              prefix_caching=prefix_caching, device=device)
    outputs = generate_like_transformers(llm, hf, batch)
    assert llm.cache.groups[0].window == WINDOW
    stats = llm.cache.stats()
    assert (stats.prefix_hit_tokens > 0) == prefix_caching
    if prefix_caching:  # prompts entering chunk by chunk are looked up whole, once
        assert llm.stats().num_preemptions == 0
        assert stats.prefix_query_tokens == sum(map(len, batch))
        assert stats.prefix_hit_tokens == sum(o.num_cached_tokens for o in outputs)
    llm.check()


def test_mistral_engine_sequences_decoding_past_their_prompts_hold_a_window(mistral, tmp_path,
        device):
    hf, _ = mistral
    llm = LLM(save_hf_model(hf, tmp_path), num_pages=24, page_size=4, max_num_seqs=2, device=device)
    for prompt in prompts(160, lengths=(5, 30, 23), seed=3).values():  # at most 30 tokens
        llm.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                               ignore_eos=True))
    decoded_far = 0
    while llm.has_unfinished():
        llm.step()
        for seq_id in llm.cache.sequences():
            if llm.cache.num_tokens(seq_id) > 40:
                decoded_far += 1
                assert sum(page != HOLE for page in llm.cache.pages(seq_id)) <= 3
        llm.check()
    assert decoded_far > 0


def test_mistral_engine_serves_requests_longer_than_its_pool_like_transformers(mistral,
                                                                             tmp_path, device):
    """Steps of at most 4 tokens: a sequence holds its window of 8, two steps and, under
    prefix caching, the 2 copies of its first drop (7 pages of 4 tokens) however long it
    grows, so requests of 62 and 69 tokens run in 8 pages (32 tokens), hits and all."""
    hf, _ = mistral
    llm = LLM(save_hf_model(hf, tmp_path), num_pages=8, page_size=4, max_num_seqs=2,
              max_num_batched_tokens=4, device=device)
    shared = prompts(160, lengths=(30,), seed=6)["seq0"]
    batch = [shared, shared + [7] * 7, shared]
    generate_like_transformers(llm, hf, batch)
    assert llm.cache.stats().prefix_hit_tokens > 0
    llm.check()


def test_a_windowed_request_gets_room_for_the_copies_of_its_first_drop_or_is_refused(
        mistral, tmp_path, device):
    """With prefix caching, a windowed sequence's first drop out of the window copies the
    pages of its window that the prefix tree indexes. A pool without room for them was taken,
    and the sequence preempted itself and came back on the same hit for ever: a chunk smaller
    than a page never filled one to commit."""
    hf, _ = mistral
    folder = save_hf_model(hf, tmp_path)
    prompt = prompts(160, lengths=(18,), seed=5)["seq0"]  # 5 pages of 4 tokens
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    tight = LLM(folder, num_pages=5, page_size=4, max_num_batched_tokens=3, device=device)
    # steps of 3 tokens: (8 + 2 * 3 - 3) // 4 + 2 = 4 pages at once, and 2 copies
    with pytest.raises(OutOfPages, match="18 tokens need 6 pages of 4 tokens; the pool has 5"):
        tight.add_request(prompt, params)
    assert not tight.has_unfinished()
    roomy = LLM(folder, num_pages=6, page_size=4, max_num_batched_tokens=3, device=device)
    roomy.add_request(prompt, params)
    for _ in range(100):
        roomy.step()
        if not roomy.has_unfinished():
            break
    assert not roomy.has_unfinished()
    roomy.check()


def test_mistral_engine_keeps_every_page_when_told_to(mistral, tmp_path, device):
    hf, _ = mistral
    llm = LLM(save_hf_model(hf, tmp_path), num_pages=64, page_size=4, max_num_seqs=2,
              free_out_of_window=False, device=device)
    prompt = prompts(160, lengths=(30,), seed=3)["seq0"]
    llm.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                           ignore_eos=True))
    while llm.has_unfinished():
        llm.step()
        for seq_id in llm.cache.sequences():
            assert HOLE not in llm.cache.pages(seq_id)
    assert llm.cache.groups[0].window is None


def test_free_out_of_window_must_be_a_bool():
    with pytest.raises(TypeError, match="free_out_of_window must be a bool, got 'no'"):
        EngineConfig(free_out_of_window="no")


def test_a_window_no_sequence_passes_is_full_attention_in_the_engines_cache(tmp_path, device):
    # Phi-3.5 and Phi-4-mini state a window of 262,144 tokens, past their whole context
    hf = make_hf_model("phi3-wide-window", configs={"phi3-wide-window": lambda: (
        transformers.Phi3Config(**SMALL, sliding_window=24))})
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert EngineConfig(max_model_len=24).kv_layout(config).layer_windows == ()
    assert EngineConfig(max_model_len=25).kv_layout(config).layer_windows == (24, 24)
    llm = LLM(save_hf_model(hf, tmp_path), device=device, max_model_len=24, num_pages=16,
              page_size=4, enforce_eager=True)
    assert llm.cache.page_groups[0].window is None  # one pool of full attention
    prompt = prompts(hf.config.vocab_size, lengths=(9,))["seq0"]
    outputs = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0),
                           use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == hf_greedy(hf.to(device), prompt, 12)
