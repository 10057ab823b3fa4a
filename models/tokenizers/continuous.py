"""Continuous image tokenizer: a per-patch autoencoder to low-dimensional latent tokens (MAR-style).

Each ``patch_size`` x ``patch_size`` RGB patch (48 numbers for 4x4) is encoded by a small MLP to a
``latent_dim``-vector (16 by default) and decoded back by another MLP; the token grid of a 32x32
image is [8, 8, 16]. Latents are standardised per channel with statistics measured on the training
patches (``latent_mean`` / ``latent_std``), so a generator sees roughly unit-variance tokens.

Training (:func:`mmspec.models.recipes.autoencoder_training.train_autoencoder`) injects Gaussian noise of
10 % of each latent channel's spread before decoding, so the decoder stays smooth around the latents it was
trained on: a generator's imperfect latents still decode to clean shapes.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import register_to_config
from diffusers.utils.accelerate_utils import apply_forward_hook
from torch import nn

from .base import PatchTokenizerMixin


def _mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, d_out))


class ContinuousTokenizer(PatchTokenizerMixin):
    """Per-patch MLP autoencoder with standardised latents.

    Example::

        >>> from mmspec.models.tokenizers import load_zoo_tokenizer
        >>> ae = load_zoo_tokenizer("continuous")
        >>> z = ae.encode(images)     # [B, 3, 32, 32] in [0, 1] -> [B, 8, 8, 16]
        >>> recon = ae.decode(z)      # [B, 3, 32, 32] in [0, 1]
        >>> seq = z.flatten(1, 2)     # [B, 64, 16] for a MAR-style model

    Args (config):
        latent_dim: channels per token. hidden_dim: MLP width. patch_size, image_size, channels: as
        for :class:`~mmspec.models.tokenizers.VQTokenizer`.
    """

    @register_to_config
    def __init__(self, latent_dim: int = 16, hidden_dim: int = 128, patch_size: int = 4, image_size: int = 32,
                 channels: int = 3):
        super().__init__()
        for name, value in (("latent_dim", latent_dim), ("hidden_dim", hidden_dim), ("patch_size", patch_size),
                            ("image_size", image_size), ("channels", channels)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        d = patch_size * patch_size * channels
        self.encoder = _mlp(d, hidden_dim, latent_dim)
        self.decoder = _mlp(latent_dim, hidden_dim, d)
        self.register_buffer("latent_mean", torch.zeros(latent_dim))
        self.register_buffer("latent_std", torch.ones(latent_dim))

    @property
    def latent_dim(self) -> int:
        return self.config.latent_dim

    def encode_raw(self, patches: torch.Tensor) -> torch.Tensor:
        """[..., D] patches in [0, 1] -> unstandardised latents [..., latent_dim] (differentiable)."""
        return self.encoder(patches * 2.0 - 1.0)

    def decode_raw(self, z: torch.Tensor) -> torch.Tensor:
        """Unstandardised latents [..., latent_dim] -> patches [..., D] (unclamped, differentiable)."""
        return (self.decoder(z) + 1.0) * 0.5

    @apply_forward_hook  # a pipeline's model CPU offload moves the tokenizer to the accelerator first
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] in [0, 1] -> standardised latent tokens [B, H/p, W/p, latent_dim]."""
        x = self.patchify(self.check_images(images))
        with torch.no_grad():
            return (self.encode_raw(x) - self.latent_mean) / self.latent_std

    def check_latents(self, latents: torch.Tensor, name: str = "latents") -> torch.Tensor:
        if not isinstance(latents, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor [B, h, w, {self.latent_dim}], got {type(latents).__name__}")
        if latents.ndim != 4 or latents.shape[-1] != self.latent_dim:
            raise ValueError(f"{name} must have shape [B, h, w, {self.latent_dim}], got {tuple(latents.shape)}")
        if not latents.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {latents.dtype}")
        if not torch.isfinite(latents).all():
            raise ValueError(f"{name} contains NaN or infinite values")
        return latents.to(device=self.device, dtype=torch.float32)

    @apply_forward_hook
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Standardised latent tokens [B, h, w, latent_dim] -> images [B, 3, h*p, w*p] in [0, 1]."""
        z = self.check_latents(latents) * self.latent_std + self.latent_mean
        with torch.no_grad():
            return self.unpatchify(self.decode_raw(z)).clamp(0.0, 1.0)
