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
