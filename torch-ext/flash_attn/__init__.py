"""FlashAttention for the Hugging Face kernel Hub: flash-attn 2's public functions
(``flash_attn_func``, ``flash_attn_varlen_func`` and the qkv/kv-packed variants, GQA/MQA,
causal, sliding window, softcap, ALiBi, attention sinks, dropout), ``flash_attn_with_kvcache``
(contiguous or paged KV caches, any page size) and its ``flash_attn_interface`` module, with a
compiled Hopper backend, Triton kernels for other GPUs and a PyTorch-ops backend on CPU.
``FLASH_ATTN_HUB_BACKEND=auto|triton|cuda|cpu`` overrides the choice."""

from . import flash_attn_interface
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func)
from .kvcache import flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
