"""The Llama-family decoder against transformers (the reference), the checkpoint loader's
errors, and the built-in "tiny" preset and its byte tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import example, given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from kvpool.engine import LLM, SamplingParams
from kvpool.errors import CheckpointError, ConfigError
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import KVPool
from kvpool.models.loader import _copy_finite, load_model
from kvpool.models.tokenizer import ByteTokenizer
from models_util import (
    CONFIGS,
    PagedRunner,
    assert_logits_match,
    fresh_process_output,
    hf_greedy,
    make_hf_model,
    packed_context,
    phi3_longrope,
    prompts,
    save_hf_model,
    streamed,
)

MAX_TOKENS = 32
WEIGHTS = "model.safetensors"


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    weights_a, weights_b = a.state_dict(), b.state_dict()
    assert weights_a.keys() == weights_b.keys()
    for name, tensor in weights_a.items():
        assert torch.equal(tensor, weights_b[name]), name


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers model, the same checkpoint loaded by kvpool) for one architecture case."""
    hf = make_hf_model(request.param)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf.to(device), load_model(folder, device=device).model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved small Llama checkpoint folder; tests copy it before breaking it."""
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("llama"))


@pytest.fixture
def broken(checkpoint, tmp_path):
    """A fresh copy of the checkpoint folder to break."""
    for path in checkpoint.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    return tmp_path


# --- parity with transformers ---

def test_packed_prefill_logits_match_transformers(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    assert_logits_match(hf, batch, PagedRunner(model).step(batch, all_logits=True))


def test_batched_greedy_decode_on_scattered_pages_matches_transformers_generate(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    runner = PagedRunner(model, free_out_of_window=False)  # every page kept, to look at
    ours = runner.greedy(batch, MAX_TOKENS)
    for seq_id, prompt in batch.items():
        assert ours[seq_id] == hf_greedy(hf, prompt, MAX_TOKENS)
        pages = runner.cache.pages(seq_id)
        assert pages != sorted(pages)  # the sequence really spans scattered pages
    runner.cache.check()


@pytest.mark.parametrize("name", ["llama", "mistral-window-8"])
def test_prompt_prefilled_in_two_chunks_gives_the_same_logits_as_in_one(name, tmp_path, device):
    model = load_model(save_hf_model(make_hf_model(name), tmp_path), device=device).model
    prompt = prompts(model.config.vocab_size, lengths=(22,))["seq0"]
    whole = PagedRunner(model).step({"a": prompt}, all_logits=True)
    runner = PagedRunner(model, seed=1)
    runner.step({"a": prompt[:9]})
    second = runner.step({"a": prompt[9:]}, all_logits=True)
    torch.testing.assert_close(second, whole[9:], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def phi3_longrope_16(tmp_path_factory, device):
    """(transformers model, its checkpoint folder) of a LongRoPE Phi-3 trained on 16
    positions, its context 256: 16x, so cos and sin are scaled by sqrt(1 + ln 16 / ln 16)."""
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(phi3_longrope(16)).eval()
    return hf.to(device), save_hf_model(hf, tmp_path_factory.mktemp("phi3-longrope-16"))


def test_longrope_past_the_trained_context_takes_the_long_factors_as_transformers(
        phi3_longrope_16, device):
    hf, folder = phi3_longrope_16
    model = load_model(folder, device=device).model  # context 256: the long factors
    batch = prompts(model.config.vocab_size, lengths=(17, 26))  # past 16: long in transformers
    ours = PagedRunner(model).greedy(batch, 8)
    for seq_id, prompt in batch.items():
        assert ours[seq_id] == hf_greedy(hf, prompt, 8)


@pytest.mark.parametrize(("max_model_len", "error"), [(0, ValueError), (2**63, ValueError),
                                                     (16.0, TypeError), (True, TypeError)])
def test_load_model_refuses_a_bad_max_model_len_by_name(phi3_longrope_16, device,
                                                        max_model_len, error):
    with pytest.raises(error, match="max_model_len"):
        load_model(phi3_longrope_16[1], device=device, max_model_len=max_model_len)


def test_the_engine_takes_longrope_short_factors_only_for_sequences_within_the_trained_context(
        phi3_longrope_16, device):
    hf, folder = phi3_longrope_16
    short, long = (prompts(hf.config.vocab_size, lengths=(n,))["seq0"] for n in (6, 20))

    def greedy(max_model_len, prompt):
        llm = LLM(folder, device=device, max_model_len=max_model_len, enforce_eager=True)
        params = SamplingParams(max_tokens=10, temperature=0)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    assert greedy(16, short) == hf_greedy(hf, short, 10)
    assert greedy(64, long) == hf_greedy(hf, long, 10)
    # transformers takes the short factors while a sequence is within 16 positions; a cache
    # whose sequences may pass them takes the long ones throughout
    assert greedy(64, short) != hf_greedy(hf, short, 10)


def test_default_logits_are_those_of_each_sequences_last_token(pair):
    _, model = pair
    batch = prompts(model.config.vocab_size, lengths=(5, 11))
    every = PagedRunner(model).step(batch, all_logits=True)
    last = PagedRunner(model).step(batch)
    torch.testing.assert_close(last, every[[4, 15]], rtol=1e-5, atol=1e-5)


# --- loading ---

def test_loaded_weights_take_the_configs_dtype_unless_overridden(broken, device):
    config = json.loads((broken / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (broken / "config.json").write_text(json.dumps(config))
    assert load_model(broken, device=device).model.dtype == torch.bfloat16
    model = load_model(broken, dtype=torch.float16, device=device).model
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_config_without_dtype_loads_float32(broken, device):
    config = json.loads((broken / "config.json").read_text())
    del config["dtype"]
    (broken / "config.json").write_text(json.dumps(config))
    assert load_model(broken, device=device).model.dtype == torch.float32


def test_pool_of_another_dtype_is_refused(checkpoint, device):
    model = load_model(checkpoint, device=device).model
    config = model.config
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim,
                      dtype=torch.float16, page_size=4)
    context = packed_context(KVPool(layout, 1, device=device), [1], [0], [1],
                             [torch.tensor([0])], [torch.tensor([[0]])])
    with pytest.raises(ValueError, match="float16"):
        model(context)


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, device):
    hf = make_hf_model("llama")
    single = load_model(save_hf_model(hf, tmp_path / "single"), device=device).model
    sharded_dir = save_hf_model(hf, tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = load_model(sharded_dir, device=device).model
    assert_same_weights(single, sharded)


def test_missing_weight_is_named(broken, device):
    tensors = load_file(broken / WEIGHTS)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / WEIGHTS)
    with pytest.raises(CheckpointError, match=r"missing weights: model\.layers\.1\.mlp\.up_proj"):
        load_model(broken, device=device)


def test_unexpected_weight_is_named(broken, device):
    tensors = load_file(broken / WEIGHTS)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, broken / WEIGHTS)
    with pytest.raises(CheckpointError, match=r"unexpected weights: model\.layers\.0\.mlp\.extra"):
        load_model(broken, device=device)


@pytest.mark.parametrize(("renamed", "name"), [
    ("model.layers.0.attention_layernorm.weight", "model.layers.0.input_layernorm.weight"),
    ("model.layers.1.feedforward_layernorm.weight",
     "model.layers.1.post_attention_layernorm.weight"),
])
def test_a_weight_also_held_under_a_name_renamed_to_it_is_refused_naming_both(
        broken, device, renamed, name):
    tensors = load_file(broken / WEIGHTS)
    tensors[renamed] = torch.full_like(tensors[name], 5.0)
    save_file(tensors, broken / WEIGHTS)
    with pytest.raises(CheckpointError, match=re.escape(
            f"the checkpoint holds {name} twice: as {name} and as {renamed}")):
        load_model(broken, device=device)


@pytest.mark.parametrize(("dtype", "error", "message"), [
    (torch.float8_e4m3fn, ValueError, "dtype torch.float8_e4m3fn is not one kvpool's models "
                                      "compute in (torch.float32, torch.float16, "
                                      "torch.bfloat16)"),
    (torch.int8, ValueError, "dtype torch.int8 is not one kvpool's models compute in"),
    ("bfloat16", TypeError, "dtype must be a torch.dtype or None, got str 'bfloat16'"),
])
def test_a_dtype_models_do_not_compute_in_is_refused_before_anything_loads(tmp_path, dtype,
                                                                           error, message):
    with pytest.raises(error, match=re.escape(message)):
        load_model(tmp_path / "no-checkpoint-here", dtype=dtype, device="cpu")


def test_misshapen_weight_names_both_shapes(broken, device):
    tensors = load_file(broken / WEIGHTS)
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, broken / WEIGHTS)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(65,\) .*\(64,\)"):
        load_model(broken, device=device)


@pytest.mark.parametrize("name, tensor", [
    ("model.layers.0.self_attn.q_proj.weight", torch.zeros(80, 64)),  # rows past the config's
    ("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 80)),  # ... columns
    ("model.embed_tokens.weight", torch.zeros(200, 64)),  # ... vocabulary rows
    ("model.layers.0.self_attn.o_proj.weight", torch.zeros(64)),  # a dimension too few
    ("model.norm.weight", torch.tensor(1.0)),
])
def test_a_weight_larger_or_of_fewer_dimensions_than_the_config_needs_is_named(
        broken, name, tensor, device):
    tensors = load_file(broken / WEIGHTS)
    assert tensors[name].shape != tensor.shape
    tensors[name] = tensor
    save_file(tensors, broken / WEIGHTS)
    with pytest.raises(CheckpointError, match=re.escape(f"{name} has shape {tuple(tensor.shape)}")):
        load_model(broken, device=device)


def test_a_fused_projection_of_the_wrong_rows_names_its_parts(tmp_path, device):
    folder = save_hf_model(make_hf_model("phi3-window-8"), tmp_path)
    tensors = load_file(folder / WEIGHTS)
    name = "model.layers.1.self_attn.qkv_proj.weight"  # q 4 x 16 rows, k and v 2 x 16 each
    tensors[name] = tensors[name][:-16].contiguous()
    save_file(tensors, folder / WEIGHTS)
    with pytest.raises(CheckpointError, match=rf"{name} has 112 rows in the checkpoint, the "
                                              r"config needs 128 \(64 \+ 32 \+ 32\)"):
        load_model(folder, device=device)


def test_rotary_inv_freq_buffers_in_a_checkpoint_are_ignored(broken, device):
    tensors = load_file(broken / WEIGHTS)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, broken / WEIGHTS)
    load_model(broken, device=device)


def test_a_tied_checkpoint_that_also_stores_lm_head_loads_with_the_head_tied(broken, device):
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert "lm_head.weight" in load_file(broken / WEIGHTS)
    assert load_model(broken, device=device).model.lm_head is None


def test_unknown_architecture_names_the_supported_ones(broken, device):
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(broken, device=device)


def test_invalid_config_json_is_a_config_error(broken, device):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(broken, device=device)


def test_missing_config_json_is_a_config_error(broken, device):
    (broken / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config"):
        load_model(broken, device=device)


def test_folder_without_safetensors_is_a_checkpoint_error(broken, device):
    (broken / WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match="no .*safetensors"):
        load_model(broken, device=device)


def test_tokenizer_json_is_loaded_with_the_configs_special_ids(broken, device):
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(broken / "tokenizer.json"))
    config = json.loads((broken / "config.json").read_text())
    config.update(bos_token_id=1, eos_token_id=[2, 0])
    (broken / "config.json").write_text(json.dumps(config))
    loaded = load_model(broken, device=device)
    assert loaded.tokenizer.encode("hello world") == [1, 2]
    assert loaded.tokenizer.decode([1, 2]) == "hello world"
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_ids) == (1, (2, 0))


def test_folder_without_tokenizer_json_has_no_tokenizer(checkpoint, device):
    assert load_model(checkpoint, device=device).tokenizer is None


# --- the tiny preset ---

def test_tiny_preset_loads_identical_weights_every_time(device):
    a, b = load_model("tiny", device=device), load_model("tiny", device=device)
    assert a.config.architecture == "LlamaForCausalLM"
    assert isinstance(a.tokenizer, ByteTokenizer)
    assert_same_weights(a.model, b.model)


def test_tiny_preset_generates_varied_tokens(device):
    tiny = load_model("tiny", device=device)
    out = PagedRunner(tiny.model).greedy({"a": tiny.tokenizer.encode("Hello")}, 16)["a"]
    assert len(set(out)) > 4


def test_loading_a_model_leaves_torch_dynamo_and_sympy_unimported():
    # Every engine process loads its model first; an init run on the meta device would import
    # torch._dynamo there, seconds of each server's start, and torch.empty_like of a meta
    # tensor sympy, a quarter of a second. Checked in a fresh process.
    code = ("import sys\n"
            "from kvpool.models.loader import load_model\n"
            "load_model('tiny', device='cpu')\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'sympy'))))\n")
    assert fresh_process_output(code) == "[]"


def test_planning_presets_have_no_weights_to_load(device):
    with pytest.raises(ConfigError, match="planning only"):
        load_model("Llama-3-8B", device=device)


def test_byte_tokenizer_round_trips_utf8_text():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("héllo, 世界")
    assert ids[0] == 256 and all(0 <= i < 256 for i in ids[1:])
    assert tokenizer.decode(ids + [257]) == "héllo, 世界"


def test_byte_tokenizer_replaces_invalid_utf8():
    assert ByteTokenizer().decode([0x68, 0xFF, 0x69]) == "h\ufffdi"


@given(st.lists(st.integers(0, 257), max_size=48), st.lists(st.integers(0, 48), max_size=6))
@example(ids=[0xED, 0xA0], cuts=[])  # a surrogate's first bytes, which UTF-8 forbids: two U+FFFD
def test_the_byte_stream_is_a_prefix_of_the_decode_short_of_a_partial_character(ids, cuts):
    text = streamed(ByteTokenizer(), ids, cuts)  # a prefix after every piece
    rest = ByteTokenizer().decode(ids)[len(text):]  # what the held-back bytes decode to
    assert rest in ("", "\ufffd", "\ufffd\ufffd")


@given(st.text(max_size=40), st.lists(st.integers(0, 120), max_size=6))
def test_the_byte_stream_of_whole_characters_is_their_decode(text, cuts):
    assert streamed(ByteTokenizer(), ByteTokenizer().encode(text), cuts) == text


def test_a_tokenizer_json_streams_its_decode(broken, device):
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(broken / "tokenizer.json"))
    loaded = load_model(broken, device=device).tokenizer
    ids = loaded.encode("hello world world hello")
    assert streamed(loaded, ids, [1, 2, 3]) == loaded.decode(ids) == "hello world world hello"


# --- damaged checkpoints: one CheckpointError naming the problem ---

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_is_named(broken, value, device):
    tensors = load_file(broken / WEIGHTS)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = value
    save_file(tensors, broken / WEIGHTS)
    with pytest.raises(CheckpointError, match=r"weight model\.layers\.1\.mlp\.up_proj\.weight "
                                              r"in model\.safetensors holds 1 NaN or infinite"):
        load_model(broken, device=device)


def test_a_non_finite_value_anywhere_in_a_weight_of_any_float_dtype_is_named(device):
    # The check reads a weight's least and greatest values (NaN if any value is); the
    # largest finite values pass, an empty weight too.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        top = torch.finfo(dtype).max
        for values in ([], [top, -top, 0.0], [1.0] * 37):
            _copy_finite(torch.empty(len(values), dtype=dtype, device=device),
                         torch.tensor(values), "w", Path("m.safetensors"))
        for bad in ([float("nan")], [float("inf")], [-float("inf")],
                    [float("inf"), -float("inf")], [float("nan"), float("inf")]):
            for where in (0, 18, 37 - len(bad)):
                values = torch.ones(37)
                values[where:where + len(bad)] = torch.tensor(bad)
                with pytest.raises(CheckpointError, match=rf"weight w in m\.safetensors holds "
                                                          rf"{len(bad)} NaN or infinite"):
                    _copy_finite(torch.empty(37, dtype=dtype, device=device), values, "w",
                                 Path("m.safetensors"))


def test_weight_that_overflows_the_requested_dtype_is_named(broken, device):
    tensors = load_file(broken / WEIGHTS)
    tensors["model.norm.weight"][0] = 1e6  # float16 tops out at 65504
    save_file(tensors, broken / WEIGHTS)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight .* 1 NaN or infinite "
                                              r"value\(s\) of 64 \(as torch\.float16\)"):
        load_model(broken, dtype=torch.float16, device=device)


def test_truncated_safetensors_file_is_a_checkpoint_error(broken, device):
    data = (broken / WEIGHTS).read_bytes()
    (broken / WEIGHTS).write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable "
                                              r"safetensors file"):
        load_model(broken, device=device)


def test_safetensors_file_with_its_tail_cut_inside_a_tensor_is_a_checkpoint_error(broken, device):
    data = (broken / WEIGHTS).read_bytes()
    (broken / WEIGHTS).write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(broken, device=device)


def test_garbage_tokenizer_json_is_a_checkpoint_error(broken, device):
    (broken / "tokenizer.json").write_text("<html>not a tokenizer</html>")
    with pytest.raises(CheckpointError, match="tokenizer.json is not a readable tokenizer.json"):
        load_model(broken, device=device)


def test_model_safetensors_directory_is_named(broken, device):
    (broken / WEIGHTS).unlink()
    (broken / WEIGHTS).mkdir()
    with pytest.raises(CheckpointError, match=r"weight files are missing: .*model\.safetensors "
                                              r"is a directory$"):
        load_model(broken, device=device)


def test_index_whose_weight_map_is_a_list_is_a_checkpoint_error(broken, device):
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [WEIGHTS]}))
    with pytest.raises(CheckpointError, match="'weight_map' must map tensor names to file "
                                              "names, got a list"):
        load_model(broken, device=device)


def test_generation_config_with_a_bad_eos_is_a_config_error(broken, device):
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match="'eos_token_id' must be a token id"):
        load_model(broken, device=device)
