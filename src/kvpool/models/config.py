"""Model configs: read a Hugging Face config.json (Llama, Qwen2, Qwen3, Mistral) into one
validated dataclass, the KV layout a config implies, and the built-in presets used by
`kvpool plan` and the `tiny` model."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool import fp8
from kvpool.errors import ConfigError
from kvpool.formats import DTYPES
from kvpool.layout import KVLayout

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
DEFAULT_DTYPE = torch.float32  # for configs that state no dtype

# Geometries of published models (their config.json, trimmed to what kvpool reads).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 258,
        "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 256, "eos_token_id": 257, "dtype": "float32",
    },
    "Llama-3-8B": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
    "Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    },
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "Mistral-7B": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What kvpool needs of a decoder's config.json, normalised across architectures and
    transformers versions (rope settings live in `rope_theta` + `rope_scaling`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None: plain RoPE; else has "rope_type" ("linear", "llama3")
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool  # Llama/Qwen3 when attention_bias
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    sliding_window: int | None  # Mistral
    dtype: torch.dtype | None  # the checkpoint's, None when unstated
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, source: dict | str | Path) -> ModelConfig:
        """Parse a config dict, a config.json path, a checkpoint folder or a preset name."""
        cfg = read_hf_config(source)
        arch = _architecture(cfg)
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        kv_heads = _int(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = cfg.get("head_dim") or None
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"hidden_size={hidden} is not a multiple of "
                                  f"num_attention_heads={heads} and no head_dim is given")
            head_dim = hidden // heads
        rope_theta, rope_scaling = _rope(cfg)
        attention_bias = _bool(cfg, "attention_bias")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        if arch.startswith("Qwen") and _bool(cfg, "use_sliding_window"):
            raise ConfigError(f"{arch} with use_sliding_window=true is not supported")
        return cls(
            architecture=arch,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_positive(head_dim, "head_dim"),
            rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(cfg, "max_position_embeddings", 4096),
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings"),
            qkv_bias=is_qwen2 or (attention_bias and arch != "MistralForCausalLM"),
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=_bool(cfg, "mlp_bias") and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=(_optional_int(cfg, "sliding_window")
                            if arch == "MistralForCausalLM" else None),
            dtype=_dtype(cfg),
            bos_token_id=_optional_int(cfg, "bos_token_id", minimum=0),
            eos_token_ids=token_ids(cfg.get("eos_token_id"), "eos_token_id"),
        )


    def weights_dtype(self, dtype: torch.dtype | None = None) -> torch.dtype:
        """The dtype the weights load in: `dtype` if given, else the config's, else float32."""
        return dtype or self.dtype or DEFAULT_DTYPE

    def kv_layout(self, *, dtype: torch.dtype | None = None, page_size: int = 16,
                  kv_cache_dtype: str = "auto") -> KVLayout:
        """The KV layout of this model: its layers, KV heads and head_dim, in the dtype its
        weights load in (see `weights_dtype`) or, with `kv_cache_dtype` "fp8_e4m3",
        float8_e4m3fn; with pages of `page_size` tokens."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim,
                        fp8.kv_cache_dtype(kv_cache_dtype, self.weights_dtype(dtype)), page_size)


def read_hf_config(source: dict | str | Path) -> dict:
    """The raw config dict of a dict, a config.json path, a checkpoint folder or a preset."""
    if isinstance(source, dict):
        return source
    if isinstance(source, str) and source in PRESETS:
        return dict(PRESETS[source])
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join(PRESETS)
        raise ConfigError(f"no config at {str(source)!r}: expected a config.json, a checkpoint "
                          f"folder holding one, or a preset name ({names})")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} holds a {type(cfg).__name__}, expected a JSON object")
    return cfg


def token_ids(value: Any, key: str) -> tuple[int, ...]:
    """An id or a list of ids (a config's `eos_token_id`) as a tuple; None is ()."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise ConfigError(f"config {key!r} must be a token id or a list of them (ints >= 0), "
                          f"got {value!r}")
    return tuple(ids)


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures")
    if archs is None:
        model_type = cfg.get("model_type")
        arch = _ARCH_BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
        if arch is None:
            raise ConfigError(f"config has no 'architectures' and an unsupported "
                              f"model_type={model_type!r}; kvpool supports "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        return arch
    if isinstance(archs, list) and archs:
        archs = archs[0]
    if archs not in SUPPORTED_ARCHITECTURES:
        found = archs if isinstance(archs, str) else repr(archs)
        raise ConfigError(f"unsupported architecture {found}; kvpool supports "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs


def _rope(cfg: dict) -> tuple[float, dict | None]:
    # transformers 5 writes rope_parameters (theta inside); older configs rope_theta + rope_scaling
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config {key!r} must be an object, got {params!r}")
    params = dict(params)
    theta = params.pop("rope_theta", None)
    theta = _float(cfg, "rope_theta", 10000.0) if theta is None else _number(theta, "rope_theta")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}; kvpool supports "
                          "default, linear and llama3")
    if "factor" not in params:
        raise ConfigError(f"rope_type {rope_type!r} needs a 'factor'")
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        if name in params:
            _number(params[name], f"{key}.{name}")
    return theta, {"rope_type": rope_type, **params}


def _dtype(cfg: dict) -> torch.dtype | None:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name is None:
        return None
    if not isinstance(name, str) or name not in DTYPES:
        raise ConfigError(f"unsupported dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _int(cfg: dict, key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    value = default if value is None else value
    if value is None:
        raise ConfigError(f"config has no {key!r}")
    return _positive(value, key)


def _optional_int(cfg: dict, key: str, *, minimum: int = 1) -> int | None:
    value = cfg.get(key)
    if value is not None and not (_is_int(value) and value >= minimum):
        raise ConfigError(f"config {key!r} must be an integer >= {minimum} or null, "
                          f"got {value!r}")
    return value


def _positive(value: Any, key: str) -> int:
    if not _is_int(value) or value <= 0:
        raise ConfigError(f"config {key!r} must be a positive integer, got {value!r}")
    return value


def _float(cfg: dict, key: str, default: float) -> float:
    """A positive finite number; absent or null gives `default`."""
    value = cfg.get(key)
    return default if value is None else _number(value, key)


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 < value < math.inf):
        raise ConfigError(f"config {key!r} must be a positive finite number, got {value!r}")
    return float(value)


def _bool(cfg: dict, key: str) -> bool:
    value = cfg.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"config {key!r} must be true or false, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
