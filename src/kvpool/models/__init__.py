"""Decoders on the paged KV cache, Llama-family (Llama, Qwen2, Qwen3, Mistral) and DeepSeek-V2/V3
(latent pages), and loading them from Hugging Face checkpoint folders or the built-in "tiny"
preset."""

from kvpool.models.deepseek import DeepseekForCausalLM
from kvpool.models.llama import LlamaForCausalLM
from kvpool.models.loader import LoadedModel, load_config, load_model

__all__ = ["DeepseekForCausalLM", "LlamaForCausalLM", "LoadedModel", "load_config", "load_model"]
