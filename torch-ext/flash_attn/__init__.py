"""FlashAttention for the Hugging Face kernel Hub: flash-attn 2's ``flash_attn_func`` and
``flash_attn_varlen_func`` (GQA/MQA, causal, sliding window, softcap, ALiBi, attention sinks,
dropout) and ``flash_attn_with_kvcache`` (contiguous or paged KV caches, any page size), with a
compiled Hopper backend, Triton kernels for other GPUs and a PyTorch-ops
backend on CPU. ``FLASH_ATTN_HUB_BACKEND=auto|triton|cuda|cpu`` overrides the choice."""

from .interface import flash_attn_func, flash_attn_varlen_func
from .kvcache import flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
