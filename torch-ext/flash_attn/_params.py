"""The one parameter record passed from the public API to every backend.

Every backend (CPU, Triton, CUDA) receives an :class:`AttnParams` that has
already been validated and normalised by ``_validate``:

* ``softmax_scale`` is a concrete float (``None`` became ``head_dim ** -0.5``);
* ``window_left`` / ``window_right`` are ``-1`` for "unbounded" or ``>= 0``;
  ``causal=True`` has already forced ``window_right = 0``;
* ``softcap`` is ``0.0`` (off) or ``> 0``;
* ``dropout_p`` is in ``[0, 1)``, with ``seed`` the 64-bit counter-RNG seed.

Masking semantics (bottom-right aligned, as flash-attn 2): for query row ``i``
of a sequence with ``Sq`` queries and ``Sk`` keys, key ``j`` is visible iff
``(left < 0 or j >= i + Sk - Sq - left) and (right < 0 or j <= i + Sk - Sq + right)``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttnParams:
    softmax_scale: float
    causal: bool
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float
    seed: int
    deterministic: bool
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def has_window(self) -> bool:
        """True when any side of the band is bounded (causal included)."""
        return self.window_left >= 0 or self.window_right >= 0


@dataclasses.dataclass(frozen=True)
class KvCacheParams:
    """The scalars of a ``flash_attn_with_kvcache`` call (or of a paged
    ``flash_attn_varlen_func``), validated by ``kvcache``.

    * ``softmax_scale``, ``causal``, ``window_left``/``window_right``, ``softcap`` as in
      :class:`AttnParams` (causal has forced ``window_right = 0``);
    * ``rotary_interleaved``: rotary pairs ``(2i, 2i + 1)`` (True) or ``(i, i + rotary_dim / 2)``;
    * ``num_splits``: key splits per (sequence, kv head); 0 lets the backend choose;
    * ``max_seqlen_q``: the longest query sequence (``Sq`` batched);
    * ``max_seqlen_k``: an upper bound of any sequence's key count, known without reading
      values (the cache capacity, or ``max_seqlen_k`` of a paged varlen call).
    """
    softmax_scale: float
    causal: bool
    window_left: int
    window_right: int
    softcap: float
    rotary_interleaved: bool
    num_splits: int
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def rotary_per_row(self) -> bool:
        """Whether query row ``i`` is rotated at position ``cache_seqlens + i`` (causal or
        local attention) rather than every row at ``cache_seqlens`` (flash-attn 2's rule)."""
        return self.causal or self.window_left >= 0 or self.window_right >= 0

    def attention(self) -> AttnParams:
        """The :class:`AttnParams` of the attention part (no dropout)."""
        return AttnParams(softmax_scale=self.softmax_scale, causal=self.causal,
                          window_left=self.window_left, window_right=self.window_right,
                          softcap=self.softcap, dropout_p=0.0, seed=0, deterministic=True,
                          max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k)
