"""Decoders on the paged KV cache, Llama-family (Llama, Qwen2, Qwen3, Mistral, and Qwen3-MoE with
its experts), OLMo 2 and 3, GLM-4, Gemma 3, DeepSeek-V2/V3 (latent pages) and the hybrid Bamba,
and loading them from Hugging Face checkpoint folders, GGUF files or the built-in "tiny"
preset.

May import: forward_context, attention, kernels, memory, planning and kvpool's shared
modules; not the cache or the engine: a model sees only its ForwardContext."""

from kvpool.models.deepseek import DeepseekForCausalLM
from kvpool.models.llama import LlamaForCausalLM
from kvpool.models.loader import LoadedModel, check_splits, load_config, load_model

__all__ = ["DeepseekForCausalLM", "LlamaForCausalLM", "LoadedModel", "check_splits",
           "load_config", "load_model"]
