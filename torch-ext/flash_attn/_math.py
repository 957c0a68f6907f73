"""Torch math that more than one backend runs (no kernels, no backend imports)."""

from __future__ import annotations

import torch


def sink_gradient(s_aux, lse, delta, varlen: bool) -> torch.Tensor:
    """The sink logits' gradient ([Note: gradient chain] in ``_triton/bwd.py``):
    ``-sum_rows exp(s_aux[h] - lse) * delta`` per query head (fp32, deterministic). ``lse`` and
    ``delta`` are ``(B, Hq, Sq)``, or ``(Hq, Tq)`` when ``varlen``."""
    sink = s_aux.float()[:, None] if varlen else s_aux.float()[None, :, None]
    weight = torch.exp(sink - lse)
    weight = torch.where(torch.isfinite(lse), weight, torch.zeros_like(weight))
    dims = (1,) if varlen else (0, 2)
    return -(weight * delta).sum(dim=dims)
