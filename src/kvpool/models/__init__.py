"""Llama-family decoders (Llama, Qwen2, Qwen3, Mistral) on the paged KV cache, and loading
them from Hugging Face checkpoint folders or the built-in "tiny" preset."""

from kvpool.models.llama import LlamaForCausalLM
from kvpool.models.loader import LoadedModel, load_config, load_model

__all__ = ["LlamaForCausalLM", "LoadedModel", "load_config", "load_model"]
