"""Local 2-D verification helper for MuLo-SD (arXiv 2601.05149).

MuLo-SD verifies a whole grid of drafted image tokens in one target pass and, instead of truncating the
raster order at the first rejection, resamples only square neighbourhoods around rejected tokens
("local resampling"). This module turns per-token accept decisions into the keep / resample sets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmspec.validation import check_ndim


@dataclass
class LocalVerification:
    """Per-token outcome on a ``[B, H, W]`` grid.

    Attributes:
        keep: bool ``[B, H, W]``, accepted tokens outside every rejected neighbourhood.
        resample: bool ``[B, H, W]``, the rejected tokens grown to radius-l squares (to be redrawn).
    """

    keep: torch.Tensor
    resample: torch.Tensor

    def resample_indices(self) -> torch.Tensor:
        """``[M, 3]`` (batch, row, column) indices of the tokens to redraw, in raster order."""
        return self.resample.nonzero()


def local_resample_sets(accepted: torch.Tensor, radius: int, valid: torch.Tensor | None = None) -> LocalVerification:
    """Expand rejections to radius-``radius`` square neighbourhoods (Chebyshev distance <= radius).

    Args:
        accepted: bool ``[B, H, W]``, the acceptance decision of every drafted token.
        radius: neighbourhood radius l >= 0 (0 resamples only the rejected tokens).
        valid: optional bool ``[B, H, W]`` marking grid cells that were drafted at all; cells outside it
            are neither kept nor resampled.
    """
    check_ndim(accepted, 3, "accepted", "[B, H, W]")
    if accepted.dtype != torch.bool:
        raise ValueError(f"accepted must be a bool tensor, got {accepted.dtype}")
    if not isinstance(radius, int) or radius < 0:
        raise ValueError(f"radius must be an integer >= 0, got {radius!r}")
    valid = torch.ones_like(accepted) if valid is None else valid
    if valid.shape != accepted.shape:
        raise ValueError(f"valid must match accepted {tuple(accepted.shape)}, got {tuple(valid.shape)}")
    rejected = (~accepted & valid).float().unsqueeze(1)  # [B, 1, H, W]
    grown = F.max_pool2d(rejected, kernel_size=2 * radius + 1, stride=1, padding=radius).squeeze(1) > 0
    resample = grown & valid
    return LocalVerification(keep=valid & ~resample, resample=resample)
