"""Load a model: a local Hugging Face checkpoint folder (config.json + safetensors, optional
tokenizer.json), a GGUF file (models/gguf.py) or the built-in "tiny" preset (seeded random
weights, byte tokenizer). A tensor-parallel rank loads only its part of each weight
(kvpool.models.parallel): safetensors reads just those bytes. Checkpoints whose names or
layout differ from kvpool's parameters are mapped at load: renamed (Mixtral's experts, a
multimodal checkpoint's text decoder, GPT-OSS's router), split (Phi-3's fused projections,
Granite MoE's and GPT-OSS's experts stacked in one tensor) or dequantized (FP8 releases'
block-scaled float8 weights, GPT-OSS releases' MXFP4 experts)."""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvpool.devices import check_device
from kvpool.errors import CheckpointError, ConfigError
from kvpool.formats import check_model_dtype
from kvpool.models.bamba import BambaForCausalLM
from kvpool.models.config import PRESETS, ModelConfig, token_ids
from kvpool.models.deepseek import DeepseekForCausalLM
from kvpool.models.exaone4 import Exaone4ForCausalLM
from kvpool.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvpool.models.gguf import (
    CACHE_ENV,
    GGUFCheckpoint,
    conversion_folder,
    conversion_problem,
    gguf_path,
    gguf_source,
    write_conversion,
)
from kvpool.models.glm4 import Glm4ForCausalLM
from kvpool.models.granite_hybrid import GraniteHybridForCausalLM
from kvpool.models.llama import LlamaForCausalLM
from kvpool.models.olmo2 import Olmo2ForCausalLM, Olmo3ForCausalLM
from kvpool.models.parallel import (
    ONE_RANK,
    WHOLE,
    Index,
    TensorParallel,
    checkpoint_index,
    take,
)
from kvpool.models.qwen3_next import Qwen3NextForCausalLM
from kvpool.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kvpool.numeric import check_int64

TINY_PRESET = "tiny"
TINY_SEED = 0
TINY_INIT_STD = 0.2  # varied greedy outputs with top-1 margins far above float noise
_INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES = 10  # weights listed per kind of problem
VISION_PARTS = ("vision_tower.", "multi_modal_projector.")  # of multimodal checkpoints
SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` scales the float8 `X.weight` (times it)
# Checkpoint names of Mixtral's, Granite MoE's and GPT-OSS's routers, Ernie 4.5's router
# bias, Mixtral's experts, Qwen2-MoE's shared expert, a multimodal checkpoint's text decoder
# and Apertus's norms -> kvpool's.
RENAMED = (
    (re.compile(r"language_model\.((model|lm_head)\..*)"), r"\1"),
    (re.compile(r"(.*\.)mlp\.shared_expert\.(.*)"), r"\1mlp.shared_experts.\2"),
    (re.compile(r"(.*\.)block_sparse_moe\.gate\.weight"), r"\1mlp.gate.weight"),
    (re.compile(r"(.*\.)block_sparse_moe\.experts\.(\d+)\.w1\.weight"),
     r"\1mlp.experts.\2.gate_proj.weight"),
    (re.compile(r"(.*\.)block_sparse_moe\.experts\.(\d+)\.w2\.weight"),
     r"\1mlp.experts.\2.down_proj.weight"),
    (re.compile(r"(.*\.)block_sparse_moe\.experts\.(\d+)\.w3\.weight"),
     r"\1mlp.experts.\2.up_proj.weight"),
    (re.compile(r"(.*\.)block_sparse_moe\.router\.layer\.weight"), r"\1mlp.gate.weight"),
    (re.compile(r"(.*\.)mlp\.router\.(weight|bias)"), r"\1mlp.gate.\2"),
    (re.compile(r"(.*\.)mlp\.moe_statics\.e_score_correction_bias"),
     r"\1mlp.gate.e_score_correction_bias"),
    (re.compile(r"(.*\.)attention_layernorm\.weight"), r"\1input_layernorm.weight"),
    (re.compile(r"(.*\.)feedforward_layernorm\.weight"), r"\1post_attention_layernorm.weight"),
)
# Checkpoint tensors that stack several of the model's parameters along their rows (Phi-3's
# projections, GraniteMoeShared's shared MLP), named after `model.layers.N.`: the
# parameters, in order (Granite's shared MLP down projection holds one, listed so that
# DENSE_FUSED places it with the rest of that MLP). Those named with `{}` (Granite MoE's
# experts) hold every expert of the layer along a first dimension, `{}` the expert's index.
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "shared_mlp.input_linear.weight": ("mlp.shared_experts.gate_proj.weight",
                                       "mlp.shared_experts.up_proj.weight"),
    "shared_mlp.output_linear.weight": ("mlp.shared_experts.down_proj.weight",),
    "block_sparse_moe.input_linear.weight": ("mlp.experts.{}.gate_proj.weight",
                                             "mlp.experts.{}.up_proj.weight"),
    "block_sparse_moe.output_linear.weight": ("mlp.experts.{}.down_proj.weight",),
}
# Checkpoint tensors that stack a layer's experts as x @ W (GPT-OSS's: `[experts, in, out]`,
# their biases `[experts, out]`), named after `model.layers.N.`: the parameters each expert's
# slice holds, interleaved along its last dimension (gate, up, gate, up, ...), `{}` the
# expert's index. A parameter's weight is its columns of the slice, transposed.
INTERLEAVED = {
    "mlp.experts.gate_up_proj": ("mlp.experts.{}.gate_proj.weight",
                                 "mlp.experts.{}.up_proj.weight"),
    "mlp.experts.gate_up_proj_bias": ("mlp.experts.{}.gate_proj.bias",
                                      "mlp.experts.{}.up_proj.bias"),
    "mlp.experts.down_proj": ("mlp.experts.{}.down_proj.weight",),
    "mlp.experts.down_proj_bias": ("mlp.experts.{}.down_proj.bias",),
}
# The INTERLEAVED weights a GPT-OSS release may store as MXFP4: `X_blocks` [experts, out,
# in / 32, 16] of two e2m1 values a byte (the low nibble first), each 16 bytes a block of 32
# values along `in`, and `X_scales` [experts, out, in / 32] of e8m0 exponents, one a block;
# they stand for X [experts, in, out], the blocks' dequantized values transposed.
MXFP4_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MXFP4_BLOCK = 32  # values a scale covers
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])  # by 4-bit code
# each byte's two values, its low nibble's first
E2M1_PAIRS = torch.stack((E2M1.repeat(16), E2M1.repeat_interleave(16)), dim=-1)
E8M0 = torch.tensor([2.0 ** (e - 127) for e in range(255)] + [math.nan])  # by exponent byte
# Granite's shared MLP on a layer without experts (a GraniteMoeHybrid of none) is the layer's
# MLP: FUSED's parameters of its tensors there
DENSE_FUSED = {"shared_mlp.input_linear.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
               "shared_mlp.output_linear.weight": ("mlp.down_proj.weight",)}
# The module class of each architecture other than the dense Llama family (which
# LlamaForCausalLM runs); Qwen3-MoE is a Llama-family decoder whose layers hold experts.
MODEL_CLASSES: dict[str, type[torch.nn.Module]] = {
    "BambaForCausalLM": BambaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteHybridForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}


@dataclass(frozen=True, slots=True)
class Columns:
    """A parameter held in an INTERLEAVED tensor: expert `expert`'s slice, its columns
    `start`, `start + step`, ... transposed (a bias: those elements)."""

    expert: int
    start: int
    step: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The parameter's values in the expert's slice `tensor`."""
        return tensor[..., self.start::self.step].mT if tensor.dim() == 2 else \
            tensor[self.start::self.step]


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run, its config, and its tokenizer (None if the folder has none)."""

    model: LlamaForCausalLM  # or a subclass: every decoder family is one (MODEL_CLASSES)
    config: ModelConfig
    tokenizer: Tokenizer | None


def load_model(model: str | Path, *, dtype: torch.dtype | None = None,
               device: str | torch.device, tp: TensorParallel = ONE_RANK,
               max_model_len: int | None = None) -> LoadedModel:
    """Load a checkpoint folder, a GGUF file (a path ending in .gguf, or a packaged name such
    as "smollm2"; with KVPOOL_GGUF_CACHE set, through its conversion, written on first use
    once the file passes the checks, or from the file itself, with a warning, where the cache
    cannot hold it) or the "tiny" preset onto `device`; with `tp`, this rank's part of it.
    dtype None: the config's (float32 if it states none, but for an MXFP4 GPT-OSS's
    bfloat16). `max_model_len`, the longest sequence it will run (None: the config's
    context), picks LongRoPE's factors. Raises TypeError for a dtype that is not a
    torch.dtype, ValueError for one kvpool does not compute in (float32, float16 and
    bfloat16 it does) or a bad device, ConfigError for a missing, malformed or unsupported
    config (or one that does not split across the ranks) and CheckpointError for weights
    that do not match it."""
    check_model_dtype(dtype)
    device = check_device(device)
    if max_model_len is not None:
        check_int64("max_model_len", max_model_len, 1)
    source = gguf_source(model)
    if isinstance(source, GGUFCheckpoint):
        folder = conversion_folder(source.path)
        if folder is None or not _convert_gguf(source, folder):
            return load_gguf(source, dtype=dtype, device=device, tp=tp,
                             max_model_len=max_model_len)
        source = folder
    weights_of = gguf_path(model)  # the GGUF file whose conversion loads here, if any
    model = source or model  # a GGUF file's cached conversion is a checkpoint folder
    config = load_config(model)
    if max_model_len is not None:
        config = config.for_max_model_len(max_model_len)
    if model == TINY_PRESET:
        weights_dtype = config.weights_dtype(dtype)
        net = LlamaForCausalLM(config, dtype=weights_dtype, device=device, tp=tp)
        # The whole model's shapes, from a CPU copy (a few MB): its rotary tables on the meta
        # device would import torch._dynamo, seconds of every fresh process's start.
        whole = LlamaForCausalLM(config, dtype=weights_dtype, device="cpu")
        init_random_weights(net, {name: tuple(t.shape) for name, t in whole.state_dict().items()},
                            seed=TINY_SEED, std=TINY_INIT_STD)
        return LoadedModel(net.eval(), config, ByteTokenizer())
    folder = Path(model)
    files = checkpoint_files(folder)
    tokenizer_file = folder / "tokenizer.json"
    tokenizer = None
    if tokenizer_file.is_file():
        tokenizer = HFTokenizer.from_file(tokenizer_file, config.bos_token_id,
                                          config.eos_token_ids)
    net = model_class(config)(config, dtype=config.weights_dtype(dtype), device=device, tp=tp)
    load_weights(net, files, weights_of)
    return LoadedModel(net.eval(), config, tokenizer)


def load_gguf(checkpoint: GGUFCheckpoint, *, dtype: torch.dtype | None,
              device: torch.device, tp: TensorParallel = ONE_RANK,
              max_model_len: int | None = None) -> LoadedModel:
    """Load a GGUF file: its tensors dequantized into a model of the config its metadata
    describes (this rank's part of each; LongRoPE's factors chosen by `max_model_len` as
    load_model chooses them), in `dtype` (None: float32), with the tokenizer its vocabulary
    describes."""
    config, path = checkpoint.config(), checkpoint.path
    if max_model_len is not None:
        config = config.for_max_model_len(max_model_len)
    tokenizer = checkpoint.tokenizer()  # before the weights: a bad vocabulary fails at once
    net = model_class(config)(config, dtype=config.weights_dtype(dtype), device=device, tp=tp)
    params = net.state_dict()
    _check_gguf_weights(net, checkpoint)
    with torch.no_grad():
        for name, tensor in checkpoint.tensors():
            _copy_finite(params[name], take(tensor, checkpoint_index(net, name)), name, path)
    return LoadedModel(net.eval(), config, tokenizer)


def _convert_gguf(checkpoint: GGUFCheckpoint, folder: Path) -> bool:
    """Write a GGUF file's conversion into `folder` once its config, tokenizer, chat template,
    tensor types and shapes pass the checks load_gguf makes before reading a weight (the
    shapes against a model built on the meta device, which holds no memory) and every weight
    is finite, as load_gguf checks them: a refused file leaves nothing in the cache.
    False, after a warning naming KVPOOL_GGUF_CACHE and `folder`, where the cache cannot
    hold it (an unwritable folder or too little space, found before dequantizing; or the
    write failed): the cache is an optimisation, the caller loads the file itself."""
    config = checkpoint.config()
    checkpoint.tokenizer()  # before the weights, as load_gguf: a bad vocabulary fails at once
    checkpoint.chat_template()
    _check_gguf_weights(model_class(config)(config, dtype=torch.float32, device="meta"),
                        checkpoint)
    size = 4 * sum(math.prod(shape) for shape in checkpoint.shapes().values())  # float32
    problem = conversion_problem(folder, size)
    if problem is None:
        weights = dict(checkpoint.tensors())
        for name, tensor in weights.items():
            _check_finite(tensor, name, checkpoint.path)
        try:
            write_conversion(checkpoint, folder, weights)
        except (OSError, SafetensorError) as e:
            problem = f"writing it failed: {e}"
    if problem is not None:
        warnings.warn(f"kvpool: {CACHE_ENV} cannot hold the conversion of "
                      f"{checkpoint.path.name} at {folder} ({problem}); loading the file "
                      f"itself", stacklevel=3)
    return problem is None


def _check_gguf_weights(model: torch.nn.Module, checkpoint: GGUFCheckpoint) -> None:
    """CheckpointError naming the GGUF file unless its tensors are of supported types and
    are the model's weights, each of its shape."""
    path = checkpoint.path
    _check_weights(model, {name: (shape, path) for name, shape in checkpoint.shapes().items()},
                   path)


def check_splits(config: ModelConfig, tensor_parallel_size: int) -> None:
    """ConfigError unless a model of `config` splits across `tensor_parallel_size` ranks as
    the loader splits it (heads, vocabulary, MLP and Mamba widths): a rank's part is built on
    the meta device, which holds no memory, before any process starts."""
    if tensor_parallel_size > 1:
        model_class(config)(config, dtype=torch.float32, device="meta",
                            tp=TensorParallel(0, tensor_parallel_size))


def model_class(config: ModelConfig) -> type[torch.nn.Module]:
    """The module class that runs a config's architecture."""
    return MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)


def load_config(model: str | Path) -> ModelConfig:
    """The config `load_model` would load the model with, read without touching the weights:
    a checkpoint folder's config.json with the end ids of its generation_config.json, or the
    "tiny" preset's, or a GGUF file's metadata (its cached conversion's config.json where one
    exists; nothing is converted). Other presets are geometries for planning only:
    ConfigError."""
    if isinstance(model, str) and model in PRESETS:
        if model != TINY_PRESET:
            raise ConfigError(f"preset {model!r} is a geometry for memory planning only, it "
                              f"has no weights; load_model takes {TINY_PRESET!r} or a "
                              f"checkpoint folder")
        return ModelConfig.from_hf(model)
    source = gguf_source(model)
    if isinstance(source, GGUFCheckpoint):
        return source.config()
    folder = Path(source or model)
    return _with_generation_eos(ModelConfig.from_hf(folder), folder)


def _with_generation_eos(config: ModelConfig, folder: Path) -> ModelConfig:
    """Add the end ids of generation_config.json: instruct models list their end-of-turn
    tokens only there."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return config
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError) as e:
        raise ConfigError(f"{path} is not a valid generation config: {e!r}") from None
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *token_ids(eos, "eos_token_id")]))
    return replace(config, eos_token_ids=merged)


def init_random_weights(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], *,
                        seed: int, std: float) -> None:
    """Reproducible weights on any device and dtype: matrices ~ N(0, std^2) of the whole
    model's `shapes` (name -> shape) drawn in float32 on the CPU from one seeded generator in
    name order, of which `model` takes its tensor-parallel part; norm scales 1, biases 0."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif name.endswith(".bias"):
                tensor.zero_()
            else:
                whole = torch.randn(shapes[name], generator=generator) * std
                tensor.copy_(take(whole, checkpoint_index(model, name)))


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names when sharded, else
    model.safetensors, else every *.safetensors in the folder."""
    index = folder / _INDEX_FILE
    if index.is_file():
        files = [folder / name for name in _index_file_names(index)]
    elif (folder / "model.safetensors").exists():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {folder}")
    unreadable = [f"{f} {'is a directory' if f.is_dir() else 'does not exist'}"
                  for f in files if not f.is_file()]
    if unreadable:
        named = f" ({index.name} names them)" if index.is_file() else ""
        raise CheckpointError(f"weight files are missing{named}: {', '.join(unreadable)}")
    return files


def _index_file_names(index: Path) -> list[str]:
    """The file names an index's weight_map (tensor name -> file name) points to, sorted."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index: {e!r}") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) for name in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names, "
                              f"got a {type(weight_map).__name__}")
    return sorted(set(weight_map.values()))


def load_weights(model: torch.nn.Module, files: list[Path],
                 weights_of: Path | None = None) -> None:
    """Copy the checkpoint's tensors (the model's tensor-parallel part of each) into the model
    by name, after checking that names and shapes match exactly (a tied lm_head and rotary
    inv_freq buffers are skipped). With `fp8_weight_block` in the config, float8 weights are
    dequantized by their `weight_scale_inv` first; with `mxfp4_experts`, each expert weight of
    an MXFP4 stack from its own blocks only. A weight's values that are not finite (in the
    model's dtype) are named in `weights_of` where given (the GGUF file that `files` are the
    conversion of), else in their own file."""
    params, config = model.state_dict(), model.config
    block = config.fp8_weight_block
    # DeepSeek-V3's and GLM-4.5's checkpoints carry their multi-token-prediction module as
    # the layers after the last, Ernie 4.5's and Qwen3-Next's as modules named `mtp`.
    found = _checkpoint_shapes(files, tied=model.lm_head is None,
                               mtp_layers=range(config.num_layers,
                                                config.num_layers + config.mtp_layers),
                               mtp=config.architecture in (
                                   "Ernie4_5_MoeForCausalLM", "Qwen3NextForCausalLM"))
    # weight name -> the file of its scale (without quantization, scales are unexpected)
    scales = {} if block is None else {name[:-len(SCALE_SUFFIX)]: found.pop(name)[1]
                                       for name in [n for n in found if n.endswith(SCALE_SUFFIX)]}
    # MXFP4 stack name -> the file of its scales
    mxfp4 = _mxfp4_stacks(found) if config.mxfp4_experts else {}
    # parameter name -> (the checkpoint tensor holding it, its piece there; None: all of it)
    sources = _renamed(found) | _split_fused(found, config) | _split_interleaved(found, config)
    _check_weights(model, found, files[0].parent)
    read = {sources.get(name, (name, None))[0] for name in found}
    if orphans := sorted(scales.keys() - read):
        raise CheckpointError(f"checkpoint {files[0].parent} has scales of no weight: "
                              f"{_first([name + SCALE_SUFFIX for name in orphans])}")
    with torch.no_grad():
        for file in files:
            with _open_safetensors(file) as f:
                for name in [n for n, (_, where) in found.items() if where == file]:
                    source, piece = sources.get(name, (name, None))
                    index = checkpoint_index(model, name)
                    if source in scales:
                        whole = _dequantized(f, source, file, scales[source], block)
                        tensor = take(whole if piece is None else whole[piece], index)
                    elif piece is None:
                        tensor = _read_tensor(f, source, file, index)
                    elif source in mxfp4:
                        tensor = _mxfp4_weight(f, source, file, mxfp4[source], piece, index)
                    elif isinstance(piece, Columns):
                        expert = _read_tensor(f, source, file, ((piece.expert,),))
                        tensor = take(piece.of(expert), index)
                    else:
                        tensor = take(_read_tensor(f, source, file, (piece,)), index)
                    if tensor.dtype == torch.float8_e4m3fn:
                        raise CheckpointError(f"weight {source} in {file.name} is float8 "
                                              f"with no {source}{SCALE_SUFFIX}")
                    _copy_finite(params[name], tensor, name, weights_of or file)


def _renamed(found: dict) -> dict[str, tuple[str, None]]:
    """Rename the RENAMED tensors of `found` to kvpool's parameter names; returns parameter
    name -> (the checkpoint's name, None). CheckpointError for a parameter the checkpoint
    holds under two names."""
    sources = {}
    for name in list(found):
        for pattern, template in RENAMED:
            if match := pattern.fullmatch(name):
                ours = match.expand(template)
                if ours in found:
                    other = sources.get(ours, (ours,))[0]
                    raise CheckpointError(f"the checkpoint holds {ours} twice: as {other} and "
                                          f"as {name}")
                found[ours] = found.pop(name)
                sources[ours] = (name, None)
                break
    return sources


def _split_fused(found: dict, config: ModelConfig) -> dict[str, tuple[str, tuple]]:
    """Replace each FUSED tensor of `found` by the parameters it stacks (DENSE_FUSED's on a
    layer without experts), with their shapes; returns parameter name -> (the fused tensor's
    name, the piece of it the parameter is: its rows, or an expert's index and its rows).
    CheckpointError for a parameter the checkpoint holds in two tensors."""
    # Granite's shared MLP is the MoE's, or in a model without experts its dense MLP
    expert, shared = (config.moe.intermediate_size, config.moe.shared_intermediate_size) \
        if config.moe else (0, config.intermediate_size)
    rows = {"self_attn.qkv_proj.weight": (config.num_heads * config.head_dim,
                                          *(config.num_kv_heads * config.head_dim,) * 2),
            "mlp.gate_up_proj.weight": (config.intermediate_size,) * 2,
            "shared_mlp.input_linear.weight": (shared,) * 2,
            "shared_mlp.output_linear.weight": (config.hidden_size,),
            "block_sparse_moe.input_linear.weight": (expert,) * 2,
            "block_sparse_moe.output_linear.weight": (config.hidden_size,)}
    parts = {}
    for name in list(found):
        suffix = name.split(".", 3)[-1]
        if suffix not in FUSED or _layer_index(name) < 0:
            continue
        shape, file = found.pop(name)
        layer = name[:-len(suffix)]  # model.layers.N.
        params = FUSED[suffix]
        if suffix in DENSE_FUSED and not config.is_moe_layer(_layer_index(name)):
            params = DENSE_FUSED[suffix]
        stacked = "{}" in params[0]
        experts = config.moe.num_experts if config.moe else 0
        if stacked and (len(shape) != 3 or shape[0] != experts):
            raise CheckpointError(f"{name} has shape {tuple(shape)} in the checkpoint, the "
                                  f"config needs {experts} experts stacked along its first "
                                  f"dimension")
        if not stacked and len(shape) != 2:
            raise CheckpointError(f"{name} has shape {tuple(shape)} in the checkpoint, the "
                                  f"config needs a matrix of {sum(rows[suffix])} rows")
        (total, *rest) = shape[stacked:]
        for index in range(shape[0]) if stacked else (None,):
            start = 0
            for part, size in zip(params, rows[suffix], strict=True):
                ours = layer + part.format(index)
                if ours in found:
                    raise CheckpointError(f"{name} holds {ours}, which the checkpoint holds "
                                          f"too")
                found[ours] = ((size, *rest), file)
                piece = slice(start, start + size)
                parts[ours] = (name, (index, piece) if stacked else (piece,))
                start += size
        if start != total:
            raise CheckpointError(f"{name} has {total} rows in the checkpoint, the config "
                                  f"needs {start} ({' + '.join(map(str, rows[suffix]))})")
    return parts


def _split_interleaved(found: dict, config: ModelConfig) -> dict[str, tuple[str, Columns]]:
    """Replace each INTERLEAVED tensor of `found` by the parameters it holds, with their
    shapes; returns parameter name -> (the tensor's name, the parameter's Columns there).
    CheckpointError for a tensor that does not stack the config's experts (weights 3-d,
    biases 2-d) or whose last dimension does not split into its parameters, or that holds a
    parameter the checkpoint holds apart too. The parameters' shapes are checked against the
    model's afterwards."""
    parts = {}
    experts = config.moe.num_experts if config.moe else 0
    for name in list(found):
        suffix = name.split(".", 3)[-1]
        if suffix not in INTERLEAVED or _layer_index(name) < 0:
            continue
        shape, file = found.pop(name)
        params = INTERLEAVED[suffix]
        dims = 2 if suffix.endswith("_bias") else 3
        if len(shape) != dims or shape[0] != experts:
            raise CheckpointError(f"{name} has shape {tuple(shape)} in the checkpoint, the "
                                  f"config needs {experts} experts stacked along the first "
                                  f"of its {dims} dimensions")
        if shape[-1] % len(params):
            raise CheckpointError(f"{name} has shape {tuple(shape)} in the checkpoint, which "
                                  f"does not stack experts' {' and '.join(params)} "
                                  f"({len(params)} interleaved along its last dimension)")
        *rest, width = shape[1:]
        for expert in range(shape[0]):
            for start, param in enumerate(params):
                ours = name[:-len(suffix)] + param.format(expert)
                if ours in found:
                    raise CheckpointError(f"{name} holds {ours}, which the checkpoint holds "
                                          f"too")
                found[ours] = ((width // len(params), *rest), file)
                parts[ours] = (name, Columns(expert, start, len(params)))
    return parts


def _dequantized(f, name: str, file: Path, scale_file: Path, block: tuple[int, int]
                 ) -> torch.Tensor:
    """The float32 values of the float8 weight `name`: each block of `block` rows and columns
    times its scale (the last blocks of a dimension may be partial)."""
    weight = _read_tensor(f, name, file, WHOLE)
    with _open_safetensors(scale_file) as g:
        scale = _read_tensor(g, name + SCALE_SUFFIX, scale_file, WHOLE)
    blocks = None  # the scale's shape a 2-d weight needs
    if weight.dim() == 2:
        blocks = tuple(-(-n // b) for n, b in zip(weight.shape, block, strict=True))
    if weight.dtype != torch.float8_e4m3fn or tuple(scale.shape) != blocks:
        raise CheckpointError(
            f"weight {name} in {file.name} is {weight.dtype} of shape {tuple(weight.shape)} "
            f"with a scale of shape {tuple(scale.shape)}; blocks of {block[0]} x {block[1]} "
            f"need a 2-d float8_e4m3fn weight and a scale of shape {blocks}")
    rows, cols = weight.shape
    scale = scale.float().repeat_interleave(block[0], 0)[:rows]
    return weight.float() * scale.repeat_interleave(block[1], 1)[:, :cols]


def _mxfp4_stacks(found: dict) -> dict[str, Path]:
    """Replace each MXFP4 stack's blocks and scales in `found` by the stack they stand for
    (MXFP4_STACKS), with its shape; returns stack name -> the file of its scales.
    CheckpointError for blocks without scales, of a shape that is not MXFP4's, or of a stack
    the checkpoint holds unquantized too."""
    files = {}
    for name in [n for n in found if n.endswith("_blocks")]:
        stack = name[:-len("_blocks")]
        if stack.split(".", 3)[-1] not in MXFP4_STACKS:  # after model.layers.N.
            continue
        if stack + "_scales" not in found:
            raise CheckpointError(f"{name} has no {stack}_scales in the checkpoint")
        (blocks, file), (scales, files[stack]) = found.pop(name), found.pop(stack + "_scales")
        if len(blocks) != 4 or blocks[-1] != MXFP4_BLOCK // 2 or scales != blocks[:-1]:
            raise CheckpointError(
                f"{name} has shape {blocks} and {stack}_scales {scales} in the checkpoint; "
                f"MXFP4 needs blocks [experts, rows, blocks, {MXFP4_BLOCK // 2}] and scales "
                f"[experts, rows, blocks]")
        if stack in found:
            raise CheckpointError(f"the checkpoint holds {stack} and its MXFP4 blocks too")
        experts, rows, groups, _ = blocks
        found[stack] = ((experts, groups * MXFP4_BLOCK, rows), file)
    return files


def _mxfp4_weight(f, stack: str, file: Path, scale_file: Path, piece: Columns,
                  index: Index) -> torch.Tensor:
    """The part `index` of the parameter `piece` of the MXFP4 stack `stack`, in float32: each
    value its e2m1 code's times its block's power of two (exact in float32 and bfloat16).
    Only the parameter is dequantized: its columns of the stack are its expert's block rows
    `piece.start::piece.step`."""
    blocks = _read_tensor(f, stack + "_blocks", file, ((piece.expert,),))
    with _open_safetensors(scale_file) as g:
        scales = _read_tensor(g, stack + "_scales", scale_file, ((piece.expert,),))
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"{stack}_blocks in {file.name} is {blocks.dtype} and "
                              f"{stack}_scales in {scale_file.name} {scales.dtype}; MXFP4 "
                              f"needs torch.uint8")
    rows = slice(piece.start, None, piece.step)
    # table lookups by embedding: a few times faster on the CPU than indexing the tables
    values = torch.nn.functional.embedding(blocks[rows].int(), E2M1_PAIRS).flatten(-2)
    values *= torch.nn.functional.embedding(scales[rows].int(), E8M0[:, None])
    return take(values.flatten(-2), index)


def _copy_finite(param: torch.Tensor, tensor: torch.Tensor, name: str, file: Path) -> None:
    """Copy a checkpoint tensor into its parameter; NaN or infinite values (in the file, or
    from casting to a narrower dtype) raise CheckpointError naming the tensor. The check runs
    on the parameter's device, one pass per tensor: its least and greatest values, NaN if any
    value is (torch.isfinite makes several passes, an order of magnitude slower on the CPU)."""
    param.copy_(tensor)
    _check_finite(param, name, file)


def _check_finite(tensor: torch.Tensor, name: str, file: Path) -> None:
    """CheckpointError naming the weight and its file if `tensor` holds NaN or infinite
    values."""
    if tensor.is_floating_point() and tensor.numel() and not bool(
            torch.stack(torch.aminmax(tensor)).isfinite().all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(f"weight {name} in {file.name} holds {bad:,} NaN or infinite "
                              f"value(s) of {tensor.numel():,} (as {tensor.dtype}); the "
                              f"checkpoint is corrupt or overflows this dtype")


def _open_safetensors(file: Path):
    """safe_open, with an unreadable file (truncated, not safetensors) as CheckpointError."""
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None


def _read_tensor(f, name: str, file: Path, index: Index) -> torch.Tensor:
    """The part `index` of tensor `name`, reading only its bytes."""
    try:
        return take(f.get_slice(name), index)
    except (SafetensorError, OSError) as e:  # a header promising more bytes than there are
        raise CheckpointError(f"tensor {name} of {file} cannot be read: {e}") from None


def _checkpoint_shapes(files: list[Path], tied: bool, mtp_layers: range = range(0),
                       mtp: bool = False) -> dict[str, tuple[tuple[int, ...], Path]]:
    """name -> (shape, file) of every tensor the model should load, read from headers only;
    tensors of the layers `mtp_layers` are not the model's, nor, with `mtp`, tensors whose
    names hold "mtp" (as transformers leaves them)."""
    found = {}
    for file in files:
        with _open_safetensors(file) as f:
            names = f.keys()
            for name in names:
                if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                    continue
                if name.startswith(VISION_PARTS):  # kvpool runs the text decoder only
                    continue
                if _layer_index(name) in mtp_layers:
                    continue
                if mtp and "mtp" in name:
                    continue
                found[name] = (tuple(f.get_slice(name).get_shape()), file)
    return found


def _layer_index(name: str) -> int:
    """The layer a tensor name belongs to (`model.layers.7.mlp...` -> 7); -1 for none."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return -1


def _check_weights(model: torch.nn.Module, found: dict, folder: Path) -> None:
    """CheckpointError unless the checkpoint holds every weight of `model`, no other, and
    each of the shape the config gives it (the whole tensor's: a tensor-parallel rank checks
    the whole shape, not only that of the part it holds)."""
    expected = _whole_shapes(model)
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    misshapen = [f"{name} has shape {found[name][0]} in the checkpoint, the config needs "
                 f"{expected[name]}"
                 for name in sorted(expected.keys() & found.keys())
                 if tuple(found[name][0]) != expected[name]]
    problems = []
    if missing:
        problems.append(f"missing weights: {_first(missing)}")
    if unexpected:
        problems.append(f"unexpected weights: {_first(unexpected)}")
    if misshapen:
        problems.append(f"wrong shapes: {_first(misshapen)}")
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not match its config: "
                              + "; ".join(problems))


def _whole_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape in the whole model: a tensor-parallel rank's model is built
    again whole on the meta device (which holds no memory) to read them."""
    if model.tp.size > 1:
        model = type(model)(model.config, dtype=torch.float32, device="meta")
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _first(items: list[str]) -> str:
    """The first few items, comma-separated, and how many more there are."""
    more = len(items) - _MAX_NAMES
    return ", ".join(items[:_MAX_NAMES]) + (f" (and {more} more)" if more > 0 else "")
