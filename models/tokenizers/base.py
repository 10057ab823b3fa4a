"""Shared plumbing of the image tokenizers: input checks, patchify/unpatchify, loading.

Images everywhere in mmspec's tokenizers are float tensors [B, 3, H, W] with values in [0, 1] (the
layout of ``mmspec.world.render.to_tensor``); H and W must be multiples of the patch size. One token
covers one ``patch_size`` x ``patch_size`` patch, so a 32x32 image with 4x4 patches is an 8x8 grid of
64 tokens.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from diffusers import ConfigMixin, ModelMixin
from einops import rearrange

from mmspec.models.parameter_attrs import ParameterDtypeDeviceMixin

_RANGE_TOLERANCE = 1e-3


class PatchTokenizerMixin(ParameterDtypeDeviceMixin, ModelMixin, ConfigMixin):
    """Base class: config fields ``patch_size``, ``image_size`` (the size it was trained at) and
    ``channels``; subclasses implement ``encode`` and ``decode``."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any):
        """Load from a folder written by ``save_pretrained`` (or a hub id diffusers can resolve).

        A path that looks local and does not exist raises FileNotFoundError (diffusers alone would try
        the network and raise a generic OSError).
        """
        path = os.fspath(pretrained_model_name_or_path)
        looks_local = os.path.isabs(path) or path.startswith(".") or path.count("/") != 1 or os.path.exists(path)
        if looks_local:
            if not os.path.isdir(path):
                raise FileNotFoundError(f"no tokenizer folder at {path!r}")
            if not os.path.isfile(os.path.join(path, cls.config_name)):
                raise FileNotFoundError(f"{path!r} has no {cls.config_name}; is it a save_pretrained folder?")
        return super().from_pretrained(path, **kwargs)

    # ------------------------------------------------------------------------------------------------
    # checks and layout
    # ------------------------------------------------------------------------------------------------

    def check_images(self, images: torch.Tensor, name: str = "images") -> torch.Tensor:
        """Validate [B, C, H, W] float images in [0, 1]; returns them as float32 on the model's device."""
        p, c = self.config.patch_size, self.config.channels
        if not isinstance(images, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor [B, {c}, H, W], got {type(images).__name__}")
        if images.ndim != 4 or images.shape[1] != c:
            raise ValueError(f"{name} must have shape [B, {c}, H, W], got {tuple(images.shape)}")
        if not images.is_floating_point():
            raise ValueError(f"{name} must be a float tensor with values in [0, 1], got {images.dtype}")
        h, w = images.shape[2:]
        if h % p or w % p or h == 0 or w == 0:
            raise ValueError(f"{name} height and width must be positive multiples of patch_size={p}, got {h}x{w}")
        if images.numel() and (images.min() < -_RANGE_TOLERANCE or images.max() > 1 + _RANGE_TOLERANCE):
            raise ValueError(
                f"{name} values must be in [0, 1] (got min {images.min().item():.3g}, max {images.max().item():.3g})"
            )
        return images.to(device=self.device, dtype=torch.float32)

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, H/p, W/p, p*p*C] (row-major patches, channels last within a patch)."""
        p = self.config.patch_size
        return rearrange(images, "b c (h p1) (w p2) -> b h w (p1 p2 c)", p1=p, p2=p)

    def unpatchify(self, patches: torch.Tensor) -> torch.Tensor:
        """[B, h, w, p*p*C] -> [B, C, h*p, w*p]."""
        p, c = self.config.patch_size, self.config.channels
        return rearrange(patches, "b h w (p1 p2 c) -> b c (h p1) (w p2)", p1=p, p2=p, c=c)

    @property
    def patch_dim(self) -> int:
        return self.config.patch_size**2 * self.config.channels

    def grid_size(self, image_size: int | None = None) -> int:
        """Tokens per side for square images of ``image_size`` (default: the training size)."""
        size = self.config.image_size if image_size is None else image_size
        if size % self.config.patch_size:
            raise ValueError(f"image_size must be a multiple of patch_size={self.config.patch_size}, got {size}")
        return size // self.config.patch_size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Reconstruction: decode(encode(images))."""
        return self.decode(self.encode(images))
