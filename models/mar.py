"""A MAR-style masked autoregressive image model over continuous tokens, with a diffusion MLP head.

MAR (Li et al. 2024, "Autoregressive Image Generation without Vector Quantization",
https://arxiv.org/abs/2406.11838) generates the tokens of an image in a random order, a *set* of tokens
per iteration: a bidirectional ViT encoder reads the tokens generated so far (plus ``buffer_size``
condition slots), a ViT decoder fills every other position with a learned mask token and returns one
condition vector ``z`` per position, and a small diffusion model (an MLP with adaptive LayerNorm) samples
each token of the set from ``p(x | z)``. Nothing is quantised: tokens are the continuous latents of an
autoencoder (here the shapes world's :class:`~mmspec.models.tokenizers.ContinuousTokenizer`, 16 channels
per 4x4 patch, 64 tokens per 32x32 image).

This file holds:

* :class:`DiffusionSchedule`: the Gaussian diffusion of MAR's DiffLoss (cosine schedule over 1000 steps,
  epsilon prediction, learned variance in the range [posterior variance, beta] ("learned range"),
  respaced DDPM sampling with a temperature on the noise);
* :class:`DiffusionHead`: MAR's ``SimpleMLPAdaLN`` (timestep + condition -> adaLN-modulated residual MLP
  blocks -> eps and variance logits);
* :class:`MARModel`: encoder/decoder + head, class-conditioned (``condition_type="class"``: the class
  embedding fills the buffer, as in MAR) or text-conditioned (``"text"``: word embeddings fill the buffer,
  one word per slot; the project's T5-free zoo models), classifier-free guidance through MAR's
  ``fake_latent``; :meth:`MARModel.head_outputs` is the forward of a training step;
* the official checkpoints: :func:`mar_config` (MAR-B/L/H sizes) and :meth:`MARModel.from_mar_checkpoint`,
  which maps the official key layout (``model_ema`` or ``model`` of ``checkpoint-last.pth``) onto this
  model's names with :data:`OFFICIAL_KEY_RULES`.

The generation loop (iteration schedule, classifier-free guidance schedule, speculative decoding) lives in
:mod:`mmspec.pipelines.continuous_ar_image`; the model exposes the pieces it needs: :meth:`MARModel.forward`
(condition vectors of every position given the visible tokens) and :meth:`MARModel.sample_head`
(denoise a batch of tokens with given noise, optionally recording every step's Gaussian). MAR's training
step (masking, the diffusion loss MSE + VLB, optional distillation from a teacher) lives with the recipes:
:mod:`mmspec.models.recipes.mar_loss`.

Deviations from the official code (none changes the forward of a loaded checkpoint): dropout defaults
to 0; the mask ratio is drawn from the same truncated Gaussian by inverse CDF with torch (no scipy /
global numpy RNG); the diffusion loss is computed on the masked tokens only (the official code computes
it everywhere and zeroes the rest: same value); the VLB term at t = 0 uses a continuous Gaussian
likelihood instead of ADM's discretised 8-bit image likelihood (latents are not 8-bit pixels); encoders
of rows that see different numbers of tokens are padded and masked (the official code needs equal counts).
"""

from __future__ import annotations

import math
import os
import re
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

# ----------------------------------------------------------------------------------------------------
# Gaussian diffusion (cosine schedule, learned-range variance, respacing)
# ----------------------------------------------------------------------------------------------------

DIFFUSION_STEPS = 1000  # training steps of MAR's DiffLoss


def cosine_betas(num_steps: int = DIFFUSION_STEPS, max_beta: float = 0.999) -> np.ndarray:
    """Betas of the cosine schedule (Nichol & Dhariwal 2021): alpha_bar(t) = cos((t + 0.008) / 1.008 * pi/2)^2."""
    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    return np.array([min(1 - alpha_bar((i + 1) / num_steps) / alpha_bar(i / num_steps), max_beta)
                     for i in range(num_steps)], dtype=np.float64)


def spaced_timesteps(num_steps: int, sampling_steps: int) -> list[int]:
    """The ``sampling_steps`` of ``range(num_steps)`` kept by respacing with one section (evenly strided,
    rounded with Python's ``round`` as the reference implementation does), ascending."""
    if not 1 <= sampling_steps <= num_steps:
        raise ValueError(f"num_diffusion_steps must be in [1, {num_steps}], got {sampling_steps}")
    stride = (num_steps - 1) / (sampling_steps - 1) if sampling_steps > 1 else 1
    return sorted({round(k * stride) for k in range(sampling_steps)})


class DiffusionSchedule:
    """Coefficients of a (respaced) DDPM with epsilon prediction and learned-range variance.

    Indices ``i = 0 .. num_steps-1`` count the kept steps (0 = the last, least noisy step);
    ``timesteps[i]`` is the matching step of the 1000-step training process, the value the network sees.
    All arrays are float64 numpy (cast at use).
    """

    def __init__(self, sampling_steps: int | None = None) -> None:
        base = cosine_betas()
        kept = list(range(DIFFUSION_STEPS)) if sampling_steps is None else spaced_timesteps(DIFFUSION_STEPS,
                                                                                            sampling_steps)
        alphas_cumprod = np.cumprod(1.0 - base)
        betas, last = [], 1.0
        for t in kept:  # respacing: new beta_i = 1 - abar(t_i) / abar(t_{i-1})
            betas.append(1 - alphas_cumprod[t] / last)
            last = alphas_cumprod[t]
        self.timesteps = np.array(kept, dtype=np.int64)
        self.betas = np.array(betas, dtype=np.float64)
        self.num_steps = len(kept)
        abar = np.cumprod(1.0 - self.betas)
        abar_prev = np.append(1.0, abar[:-1])
        self.alphas_cumprod = abar
        self.sqrt_alphas_cumprod = np.sqrt(abar)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - abar)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / abar)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / abar - 1)
        self.posterior_variance = self.betas * (1.0 - abar_prev) / (1.0 - abar)
        # the posterior variance is 0 at i = 0: its log is clipped to the value at i = 1
        self.posterior_log_variance_clipped = np.log(np.append(self.posterior_variance[1], self.posterior_variance[1:])
                                                     if self.num_steps > 1 else self.betas)
        self.log_betas = np.log(self.betas)
        self.posterior_mean_coef1 = self.betas * np.sqrt(abar_prev) / (1.0 - abar)
        self.posterior_mean_coef2 = (1.0 - abar_prev) * np.sqrt(1.0 - self.betas) / (1.0 - abar)

    def take(self, array: np.ndarray, index: torch.Tensor | int, like: torch.Tensor) -> torch.Tensor:
        """``array[index]`` as a tensor of ``like``'s dtype/device, broadcastable against ``[N, C]`` (how the
        sampler here and the training loss, :mod:`mmspec.models.recipes.mar_loss`, read a coefficient)."""
        values = torch.as_tensor(array, dtype=torch.float64)[torch.as_tensor(index).cpu()]
        values = values.to(device=like.device, dtype=like.dtype)
        return values.reshape(-1, *([1] * (like.ndim - 1))) if values.ndim else values

    def predict_x0(self, prediction: torch.Tensor, x: torch.Tensor, i: torch.Tensor | int,
                   prediction_type: str = "epsilon") -> torch.Tensor:
        """x0 implied by the network's prediction at x_i: eps (MAR) or v = sqrt(abar) eps - sqrt(1 - abar) x0."""
        if prediction_type == "epsilon":
            return self.take(self.sqrt_recip_alphas_cumprod, i, x) * x - self.take(self.sqrt_recipm1_alphas_cumprod, i, x) * prediction
        return self.take(self.sqrt_alphas_cumprod, i, x) * x - self.take(self.sqrt_one_minus_alphas_cumprod, i, x) * prediction

    def p_mean_variance(self, model_output: torch.Tensor, x: torch.Tensor, i: torch.Tensor | int,
                        clip: float | None = None, prediction_type: str = "epsilon"
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean, log variance and predicted x0 of p(x_{i-1} | x_i) from the network output ``[N, 2C]``
        (eps or v prediction, and variance logits in [-1, 1] interpolating log beta and the log posterior
        variance); ``clip`` bounds the predicted x0 to [-clip, clip] (ADM's ``clip_denoised``)."""
        prediction, v = model_output.chunk(2, dim=-1)
        frac = (v + 1) / 2
        log_var = frac * self.take(self.log_betas, i, x) + (1 - frac) * self.take(self.posterior_log_variance_clipped, i, x)
        x0 = self.predict_x0(prediction, x, i, prediction_type)
        if clip is not None:
            x0 = x0.clamp(-clip, clip)
        mean = self.take(self.posterior_mean_coef1, i, x) * x0 + self.take(self.posterior_mean_coef2, i, x) * x
        return mean, log_var, x0


@lru_cache(maxsize=16)
def diffusion_schedule(sampling_steps: int | None) -> DiffusionSchedule:
    """Cached :class:`DiffusionSchedule` (``None``: the full 1000-step training process)."""
    return DiffusionSchedule(sampling_steps)


# ----------------------------------------------------------------------------------------------------
# the diffusion head (MAR's SimpleMLPAdaLN)
# ----------------------------------------------------------------------------------------------------


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding ``[N, dim]`` of (training-process) timesteps ``[N]``: cosines, then sines."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


class TimestepEmbedder(nn.Module):
    """Timestep -> sinusoidal features (``frequency_dim``) -> Linear-SiLU-Linear -> ``[N, width]``."""

    def __init__(self, width: int, frequency_dim: int = 256) -> None:
        super().__init__()
        self.frequency_dim = frequency_dim
        self.fc1 = nn.Linear(frequency_dim, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        features = timestep_embedding(t, self.frequency_dim).to(self.fc1.weight.dtype)
        return self.fc2(F.silu(self.fc1(features)))


class AdaLNBlock(nn.Module):
    """Residual MLP block whose LayerNorm shift/scale and output gate come from the condition y."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.modulation = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(F.silu(y)).chunk(3, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        return x + gate * self.fc2(F.silu(self.fc1(h)))


class DiffusionHead(nn.Module):
    """The denoiser of one token: ``forward(x_t [N, C], t [N], c [N, cond_dim]) -> [N, 2C]`` (eps and
    variance logits). ``width`` and ``depth`` are MAR's ``diffloss_w`` / ``diffloss_d``."""

    def __init__(self, token_dim: int, cond_dim: int, width: int, depth: int) -> None:
        super().__init__()
        self.token_dim = token_dim
        self.time_embed = TimestepEmbedder(width)
        self.cond_proj = nn.Linear(cond_dim, width)
        self.input_proj = nn.Linear(token_dim, width)
        self.blocks = nn.ModuleList([AdaLNBlock(width) for _ in range(depth)])
        self.out_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.out_modulation = nn.Linear(width, 2 * width)
        self.out_proj = nn.Linear(width, 2 * token_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """MAR's init: xavier linears, small timestep MLP, zero adaLN modulations and output layer."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.time_embed.fc1.weight, std=0.02)
        nn.init.normal_(self.time_embed.fc2.weight, std=0.02)
        for layer in [*(b.modulation for b in self.blocks), self.out_modulation, self.out_proj]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = self.input_proj(x)                       # [N, W]
        y = self.time_embed(t) + self.cond_proj(c)   # [N, W]
        for block in self.blocks:
            h = block(h, y)
        shift, scale = self.out_modulation(F.silu(y)).chunk(2, dim=-1)
        return self.out_proj(self.out_norm(h) * (1 + scale) + shift)  # [N, 2C]


# ----------------------------------------------------------------------------------------------------
# the ViT encoder/decoder
# ----------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention (fused qkv with bias, as timm's ViT) with an optional key mask."""

    def __init__(self, dim: int, num_heads: int, attn_dropout: float = 0.0, proj_dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.attn_dropout = attn_dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                queries: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, N, dim]`` -> ``[B, N, dim]``; with ``queries [B, Q]`` (indices into N) only those rows
        attend (to every key) and ``[B, Q, dim]`` comes back."""
        batch, length, dim = x.shape
        qkv = self.qkv(x).reshape(batch, length, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)                                    # [B, H, N, Dh] each
        if queries is not None:
            q = torch.gather(q, 2, queries[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))
        mask = None if key_mask is None else key_mask[:, None, None, :]  # True = may be attended to
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             dropout_p=self.attn_dropout if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(batch, q.shape[2], dim)))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm ViT block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, attn_dropout: float, proj_dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, attn_dropout, proj_dropout)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), proj_dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                queries: torch.Tensor | None = None) -> torch.Tensor:
        """With ``queries [B, Q]`` only those rows are computed (keys and values still come from all of
        ``x``): ``[B, Q, dim]``, what the full block gives at those rows."""
        residual = x if queries is None else torch.gather(x, 1, queries[..., None].expand(-1, -1, x.shape[-1]))
        x = residual + self.attn(self.norm1(x), key_mask, queries)
        return x + self.mlp(self.norm2(x))


# ----------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------


def sincos_2d(grid: int, dim: int) -> torch.Tensor:
    """2-D sin-cos position features ``[grid * grid, dim]`` (raster order): half of the channels encode
    the row, half the column, each as sines and cosines of geometric frequencies."""
    if dim % 4:
        raise ValueError(f"sin-cos position features need a width divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                                indexing="ij")
    parts = []
    for coord in (rows.reshape(-1), cols.reshape(-1)):
        angles = coord[:, None] * omega[None, :]
        parts += [torch.sin(angles), torch.cos(angles)]
    return torch.cat(parts, dim=1).float()


class MARModel(ModelMixin, ConfigMixin):
    """MAR: masked autoregressive generation of continuous tokens with a diffusion head.

    Config (MAR's names where they exist; defaults are MAR-B at 256 px):
        grid_size: tokens per image side (``img_size / vae_stride / patch_size``; 16 at 256 px, 8 for the
            shapes world's 32x32 images); ``seq_len = grid_size ** 2``.
        token_dim: channels per token (``vae_embed_dim * patch_size**2``; 16).
        encoder_embed_dim, encoder_depth, encoder_num_heads, decoder_*: the two ViTs.
        mlp_ratio: ViT MLP width / embedding width.
        buffer_size: condition slots in front of the tokens (64 in MAR; the text length for text models).
        condition_type: "class" (``num_classes`` labels; the class embedding fills every buffer slot) or
            "text" (word ids ``[B, buffer_size]``, left-padded with -1, one word embedding per slot from a
            ``text_vocab_size``-row table plus a padding row).
        label_drop_prob: training probability of replacing the condition by ``fake_latent`` (CFG).
        mask_ratio_min: masking ratio of training, a Gaussian (mean 1, std 0.25) truncated to
            [mask_ratio_min, 1].
        attn_dropout, proj_dropout: ViT dropouts (MAR: 0.1; default 0 here).
        diffloss_d, diffloss_w: diffusion head depth and width.
        num_sampling_steps: default respaced DDPM steps at generation (MAR: 100).
        diffusion_batch_mul: training noise draws per token (MAR: 4).
        sincos_init: initialise the grid part of the encoder/decoder position tables with 2-D sin-cos
            features (MAE's fixed embedding) instead of N(0, 0.02) (MAR); they stay learned. Only the start
            of training changes (checkpoints load either way); small models learn spatial structure much
            sooner.
        prediction_type: what the head predicts: "epsilon" (MAR) or "v_prediction" (v = sqrt(abar) eps -
            sqrt(1 - abar) x0, Salimans & Ho 2022). eps-prediction's loss barely weighs the high-noise steps,
            where a token's content is decided (at t = 950 the implied x0 costs sqrt(abar) ~ 0.15 of the loss
            scale), so a small head trained briefly samples tokens that ignore their condition; v keeps
            every noise level in the loss. The zoo models use v.
        clip_denoised: bound of the predicted x0 in every sampling step (None: no clipping, as MAR). The
            cosine schedule's first sampling step divides the eps error by sqrt(alpha_bar_999) ~ 5e-5, so
            a small head's imperfect eps at t = 999 throws x0 (and every later step) far off; clipping x0
            to the latents' range, ADM's ``clip_denoised``, removes that (the zoo uses 7 on latents of
            range [-6.6, 5.4]).
    """

    @register_to_config
    def __init__(self, grid_size: int = 16, token_dim: int = 16, encoder_embed_dim: int = 768, encoder_depth: int = 12,
                 encoder_num_heads: int = 12, decoder_embed_dim: int = 768, decoder_depth: int = 12,
                 decoder_num_heads: int = 12, mlp_ratio: float = 4.0, buffer_size: int = 64,
                 condition_type: str = "class", num_classes: int = 1000, text_vocab_size: int | None = None,
                 label_drop_prob: float = 0.1, mask_ratio_min: float = 0.7, attn_dropout: float = 0.0,
                 proj_dropout: float = 0.0, diffloss_d: int = 3, diffloss_w: int = 1024,
                 num_sampling_steps: int = 100, diffusion_batch_mul: int = 4,
                 clip_denoised: float | None = None, sincos_init: bool = False,
                 prediction_type: str = "epsilon") -> None:
        super().__init__()
        if condition_type not in ("class", "text"):
            raise ValueError(f"condition_type must be 'class' or 'text', got {condition_type!r}")
        if condition_type == "text" and not text_vocab_size:
            raise ValueError("a text-conditioned MARModel needs text_vocab_size (the word table's size)")
        for name, value in (("grid_size", grid_size), ("token_dim", token_dim), ("buffer_size", buffer_size),
                            ("diffloss_d", diffloss_d), ("diffloss_w", diffloss_w)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= mask_ratio_min < 1.0:
            raise ValueError(f"mask_ratio_min must be in [0, 1), got {mask_ratio_min}")
        if prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")
        if clip_denoised is not None and not clip_denoised > 0:
            raise ValueError(f"clip_denoised must be positive or None, got {clip_denoised}")
        seq_len = grid_size * grid_size
        enc, dec = encoder_embed_dim, decoder_embed_dim

        # condition
        if condition_type == "class":
            self.class_embedding = nn.Embedding(num_classes, enc)
        else:
            self.text_embedding = nn.Embedding(text_vocab_size + 1, enc)  # last row: padding
        self.fake_latent = nn.Parameter(torch.zeros(1, enc))
        # encoder
        self.z_proj = nn.Linear(token_dim, enc)
        self.z_proj_ln = nn.LayerNorm(enc, eps=1e-6)
        self.encoder_pos_embed = nn.Parameter(torch.zeros(1, seq_len + buffer_size, enc))
        self.encoder_blocks = nn.ModuleList([Block(enc, encoder_num_heads, mlp_ratio, attn_dropout, proj_dropout)
                                             for _ in range(encoder_depth)])
        self.encoder_norm = nn.LayerNorm(enc, eps=1e-6)
        # decoder
        self.decoder_embed = nn.Linear(enc, dec)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, seq_len + buffer_size, dec))
        self.decoder_blocks = nn.ModuleList([Block(dec, decoder_num_heads, mlp_ratio, attn_dropout, proj_dropout)
                                             for _ in range(decoder_depth)])
        self.decoder_norm = nn.LayerNorm(dec, eps=1e-6)
        self.diffusion_pos_embed = nn.Parameter(torch.zeros(1, seq_len, dec))
        # diffusion head
        self.head = DiffusionHead(token_dim, dec, diffloss_w, diffloss_d)
        self._init_weights()

    def _init_weights(self) -> None:
        """MAR's init: N(0, 0.02) embeddings, xavier-uniform linears with zero bias, unit LayerNorms; the
        head keeps its own init."""
        for module in self.modules():
            if module is self.head:  # registered last: everything after it belongs to the head
                break
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm) and module.weight is not None:
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        table = self.class_embedding if self.config.condition_type == "class" else self.text_embedding
        for tensor in (table.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed,
                       self.decoder_pos_embed, self.diffusion_pos_embed):
            nn.init.normal_(tensor, std=0.02)
        if self.config.sincos_init:
            buffer = self.config.buffer_size
            with torch.no_grad():
                for table in (self.encoder_pos_embed, self.decoder_pos_embed):
                    table[0, buffer:] = sincos_2d(self.config.grid_size, table.shape[-1])

    # -- shapes ---------------------------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self.config.grid_size ** 2

    @property
    def token_dim(self) -> int:
        return self.config.token_dim

    # -- condition ------------------------------------------------------------------------------------
    def condition_embedding(self, condition_ids: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        """Buffer contents ``[B, buffer_size, enc]``: class ids ``[B]`` (the class embedding in every slot)
        or word ids ``[B, buffer_size]`` (-1 = padding); rows with ``drop`` True get ``fake_latent``."""
        config = self.config
        if config.condition_type == "class":
            if condition_ids.ndim != 1:
                raise ValueError(f"a class-conditioned MARModel takes class ids [B], got {tuple(condition_ids.shape)}")
            if condition_ids.numel() and (condition_ids.min() < 0 or condition_ids.max() >= config.num_classes):
                raise ValueError(f"class ids must be in [0, {config.num_classes}), got {condition_ids.tolist()}")
            cond = self.class_embedding(condition_ids)[:, None, :].expand(-1, config.buffer_size, -1)
        else:
            if condition_ids.ndim != 2 or condition_ids.shape[1] != config.buffer_size:
                raise ValueError(f"a text-conditioned MARModel takes word ids [B, {config.buffer_size}] (left-padded "
                                 f"with -1), got {tuple(condition_ids.shape)}")
            if condition_ids.numel() and condition_ids.max() >= config.text_vocab_size:
                raise ValueError(f"word ids must be < text_vocab_size={config.text_vocab_size}")
            ids = torch.where(condition_ids < 0, config.text_vocab_size, condition_ids)
            cond = self.text_embedding(ids)
        if drop is not None:
            fake = self.fake_latent.to(cond.dtype)[:, None, :].expand_as(cond)
            cond = torch.where(drop.reshape(-1, 1, 1), fake, cond)
        return cond

    # -- encoder / decoder ----------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, visible: torch.Tensor, condition: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Condition vectors of every position, or of the positions the head will sample.

        Args:
            tokens: ``[B, L, C]`` token values (only visible positions are read).
            visible: bool ``[B, L]``, the tokens generated so far (MAR's ``mask`` is ``~visible``).
            condition: ``[B, buffer_size, enc]`` from :meth:`condition_embedding`.
            positions: optional grid positions ``[B, Q]`` (repeats allowed): the last decoder block then
                computes only those rows (every position still serves as a key), which is all a sampling
                iteration needs; MAR itself computes every position.
        Returns:
            ``z`` ``[B, L, dec]``: the diffusion head's condition at every position (``[B, Q, dec]`` at
            ``positions``; equal to the full result's rows up to floating-point rounding).
        """
        batch, length, _ = tokens.shape
        buffer = self.config.buffer_size
        # 1. encoder input: condition slots + projected tokens, positions, LayerNorm
        x = torch.cat([condition.to(tokens.dtype), self.z_proj(tokens)], dim=1)       # [B, P + L, E]
        x = self.z_proj_ln(x + self.encoder_pos_embed)
        keep = torch.cat([torch.ones(batch, buffer, dtype=torch.bool, device=x.device), visible], dim=1)
        # 2. drop the masked tokens (rows with unequal counts: pad to the longest and mask the keys)
        counts = keep.sum(1)
        width = int(counts.max())
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]   # kept positions first
        key_mask = torch.arange(width, device=x.device)[None, :] < counts[:, None]      # [B, M]
        x = torch.gather(x, 1, order[..., None].expand(-1, -1, x.shape[-1]))             # [B, M, E]
        mask = None if bool(key_mask.all()) else key_mask
        for block in self.encoder_blocks:
            x = block(x, mask)
        x = self.encoder_norm(x)
        # 3. decoder: mask tokens everywhere, encoded tokens back at their positions
        x = self.decoder_embed(x)                                                        # [B, M, D]
        full = self.mask_token.to(x.dtype).expand(batch, buffer + length, -1).clone()
        rows = torch.arange(batch, device=x.device)[:, None].expand(-1, width)
        full[rows[key_mask], order[key_mask]] = x[key_mask]
        x = full + self.decoder_pos_embed
        if positions is None:
            for block in self.decoder_blocks:
                x = block(x)
            return self.decoder_norm(x)[:, buffer:] + self.diffusion_pos_embed            # [B, L, D]
        if positions.ndim != 2 or positions.shape[0] != batch:
            raise ValueError(f"positions must be [B={batch}, Q] grid positions, got {tuple(positions.shape)}")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= length):
            raise ValueError(f"positions must be grid positions in [0, {length}), got {positions.min()}..{positions.max()}")
        queries = positions + buffer
        if len(self.decoder_blocks) == 0:
            x = torch.gather(x, 1, queries[..., None].expand(-1, -1, x.shape[-1]))
        else:
            *blocks, last = self.decoder_blocks
            for block in blocks:
                x = block(x)
            x = last(x, queries=queries)                                                 # [B, Q, D]
        return self.decoder_norm(x) + self.diffusion_pos_embed[0][positions]

    # -- diffusion head -------------------------------------------------------------------------------
    @torch.no_grad()
    def sample_head(self, z: torch.Tensor, noise: torch.Tensor, temperature: float = 1.0,
                    guidance_scale: torch.Tensor | float | None = None, z_uncond: torch.Tensor | None = None,
                    num_steps: int | None = None, record: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Sample tokens with the respaced DDPM, every random number given.

        Args:
            z: ``[N, dec]`` condition vectors of the tokens to sample (the conditional ones under guidance).
            noise: ``[N, T, C]``: ``noise[:, 0]`` is x_T, ``noise[:, k]`` the noise of the k-th denoising
                step (k = 1 .. T-1; the last step, to x_0, adds none, as in MAR).
            temperature: scales the noise of every step (MAR's sampling temperature).
            guidance_scale: classifier-free guidance per token ``[N]`` (or a float) with ``z_uncond``:
                eps = eps_u + s (eps_c - eps_u); the variance comes from the conditional branch (MAR).
            num_steps: respaced steps T (default ``config.num_sampling_steps``); must equal ``noise.shape[1]``.
            record: also return every step's Gaussian, ``means`` and ``variances`` ``[T, N, C]`` (variances
                include the temperature: ``(temperature * sigma)^2``), in sampling order (the last entry is
                the step to x_0). CSpD's density ratio reads them.
        Returns:
            ``(x0 [N, C], means or None, variances or None)``.
        """
        steps = num_steps or self.config.num_sampling_steps
        schedule = diffusion_schedule(steps)
        if noise.ndim != 3 or noise.shape[1] != schedule.num_steps or noise.shape[0] != z.shape[0]:
            raise ValueError(f"noise must have shape [N={z.shape[0]}, T={schedule.num_steps}, C], got "
                             f"{tuple(noise.shape)}")
        clip = getattr(self.config, "clip_denoised", None)
        prediction_type = getattr(self.config, "prediction_type", "epsilon")
        guided = z_uncond is not None
        if guided:
            scale = torch.as_tensor(guidance_scale if guidance_scale is not None else 1.0, dtype=z.dtype,
                                    device=z.device).reshape(-1, 1)
            cond = torch.cat([z, z_uncond])
        else:
            cond = z
        x = noise[:, 0].to(z.dtype)
        means, variances = [], []
        for k, i in enumerate(reversed(range(schedule.num_steps))):
            t = torch.full((x.shape[0],), int(schedule.timesteps[i]), device=x.device, dtype=torch.long)
            if guided:
                out = self.head(torch.cat([x, x]), torch.cat([t, t]), cond)
                (eps_c, var_c), (eps_u, _) = (part.chunk(2, dim=-1) for part in out.chunk(2))
                out = torch.cat([eps_u + scale * (eps_c - eps_u), var_c], dim=-1)  # eps or v: both linear in x0
            else:
                out = self.head(x, t, cond)
            mean, log_var, _ = schedule.p_mean_variance(out, x, i, clip, prediction_type)
            std = torch.exp(0.5 * log_var) * temperature
            x = mean + std * noise[:, k + 1].to(x.dtype) if i > 0 else mean
            if record:
                means.append(mean)
                variances.append(std * std)
        if not record:
            return x, None, None
        return x, torch.stack(means), torch.stack(variances)

    # -- forward pieces of training -------------------------------------------------------------------
    def head_outputs(self, tokens: torch.Tensor, condition_ids: torch.Tensor, masked: torch.Tensor,
                     drop: torch.Tensor, x_t: torch.Tensor, i: torch.Tensor, mul: int) -> torch.Tensor:
        """Diffusion-head outputs ``[N, 2C]`` for the noisy masked tokens ``x_t`` at steps ``i`` (``mul``
        copies of the masked tokens, in ``tokens[masked]`` order) given the visible ones (``drop``: bool
        ``[B]``, rows whose condition is replaced by ``fake_latent``). The forward of a training step
        (:func:`mmspec.models.recipes.mar_loss.mar_loss`), one pass for every masked token."""
        z = self.forward(tokens, ~masked, self.condition_embedding(condition_ids, drop))   # [B, L, D]
        return self.head(x_t, i, z[masked].repeat(mul, 1))

    # -- official checkpoints -------------------------------------------------------------------------
    @classmethod
    def from_mar_checkpoint(cls, path: str | os.PathLike, variant: str | None = None, use_ema: bool = True,
                            torch_dtype: torch.dtype | None = None, weights_only: bool = True,
                            **config: Any) -> MARModel:
        """Load an official MAR checkpoint (``checkpoint-last.pth`` of github.com/LTH14/mar).

        ``use_ema`` reads the ``model_ema`` entry (the weights MAR evaluates), else ``model``. The official
        key layout is mapped by :func:`convert_mar_state_dict`. ``variant`` ("mar_base", "mar_large",
        "mar_huge") sets the sizes of :func:`mar_config` (default: inferred from the weights); keyword
        arguments override config fields (e.g. ``num_sampling_steps``).

        Raises:
            FileNotFoundError: no file. ValueError: not a MAR state dict; missing / unexpected / mis-shaped
            keys are named.
        """
        from mmspec.models.llamagen import checkpoint_dtype, load_checked, load_llamagen_state_dict

        state = load_llamagen_state_dict(path, key="model_ema" if use_ema else "model", weights_only=weights_only)
        mapped = convert_mar_state_dict(state)
        full = {**infer_mar_config(mapped, variant), **config}
        model = cls(**full).to(torch_dtype or checkpoint_dtype(mapped))
        load_checked(model, mapped, path)
        return model.eval()


# ----------------------------------------------------------------------------------------------------
# official checkpoints: sizes and key mapping
# ----------------------------------------------------------------------------------------------------

#: Official MAR sizes (models/mar.py of LTH14/mar; the diffusion heads of the released checkpoints,
#: README: MAR-B 6x1024, MAR-L 8x1280, MAR-H 12x1536).
MAR_VARIANTS: dict[str, dict[str, int]] = {
    "mar_base": dict(encoder_embed_dim=768, encoder_depth=12, encoder_num_heads=12, decoder_embed_dim=768,
                     decoder_depth=12, decoder_num_heads=12, diffloss_d=6, diffloss_w=1024),
    "mar_large": dict(encoder_embed_dim=1024, encoder_depth=16, encoder_num_heads=16, decoder_embed_dim=1024,
                      decoder_depth=16, decoder_num_heads=16, diffloss_d=8, diffloss_w=1280),
    "mar_huge": dict(encoder_embed_dim=1280, encoder_depth=20, encoder_num_heads=16, decoder_embed_dim=1280,
                     decoder_depth=20, decoder_num_heads=16, diffloss_d=12, diffloss_w=1536),
}


def mar_config(variant: str, img_size: int = 256, vae_stride: int = 16, patch_size: int = 1, vae_embed_dim: int = 16,
               **overrides: Any) -> dict[str, Any]:
    """Config of an official MAR variant ("mar_base", "mar_large", "mar_huge") for ImageNet c2i."""
    if variant not in MAR_VARIANTS:
        raise ValueError(f"variant must be one of {list(MAR_VARIANTS)}, got {variant!r}")
    if img_size % (vae_stride * patch_size):
        raise ValueError(f"img_size={img_size} is not a multiple of vae_stride * patch_size")
    return {**MAR_VARIANTS[variant], "grid_size": img_size // vae_stride // patch_size,
            "token_dim": vae_embed_dim * patch_size ** 2, "buffer_size": 64, "condition_type": "class",
            "num_classes": 1000, "mlp_ratio": 4.0, **overrides}


#: (official regex, replacement) rules applied in order to every official key; the first match wins.
OFFICIAL_KEY_RULES: list[tuple[str, str]] = [
    (r"^class_emb\.weight$", "class_embedding.weight"),
    (r"^(encoder|decoder|diffusion)_pos_embed_learned$", r"\1_pos_embed"),
    (r"^diffloss\.net\.time_embed\.mlp\.0\.", "head.time_embed.fc1."),
    (r"^diffloss\.net\.time_embed\.mlp\.2\.", "head.time_embed.fc2."),
    (r"^diffloss\.net\.cond_embed\.", "head.cond_proj."),
    (r"^diffloss\.net\.input_proj\.", "head.input_proj."),
    (r"^diffloss\.net\.res_blocks\.(\d+)\.in_ln\.", r"head.blocks.\1.norm."),
    (r"^diffloss\.net\.res_blocks\.(\d+)\.mlp\.0\.", r"head.blocks.\1.fc1."),
    (r"^diffloss\.net\.res_blocks\.(\d+)\.mlp\.2\.", r"head.blocks.\1.fc2."),
    (r"^diffloss\.net\.res_blocks\.(\d+)\.adaLN_modulation\.1\.", r"head.blocks.\1.modulation."),
    (r"^diffloss\.net\.final_layer\.adaLN_modulation\.1\.", "head.out_modulation."),
    (r"^diffloss\.net\.final_layer\.linear\.", "head.out_proj."),
    # unchanged names: fake_latent, z_proj(_ln), mask_token, encoder/decoder blocks (timm's Block layout:
    # norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2), encoder/decoder norms, decoder_embed
    (r"^(fake_latent|mask_token|z_proj\.|z_proj_ln\.|encoder_norm\.|decoder_norm\.|decoder_embed\.)", r"\1"),
    (r"^(encoder|decoder)_blocks\.(\d+)\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.", r"\1_blocks.\2.\3."),
]


def convert_mar_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an official MAR state dict to :class:`MARModel`'s names (:data:`OFFICIAL_KEY_RULES`).

    Raises ``ValueError`` naming the keys no rule knows (e.g. a state dict of another model)."""
    out, unknown = {}, []
    for name, tensor in state.items():
        for pattern, replacement in OFFICIAL_KEY_RULES:
            if re.match(pattern, name):
                out[re.sub(pattern, replacement, name, count=1)] = tensor
                break
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"not an official MAR state dict: {len(unknown)} unknown keys, e.g. {sorted(unknown)[:8]}")
    return out


def infer_mar_config(state: dict[str, torch.Tensor], variant: str | None = None) -> dict[str, Any]:
    """Config of a (converted) MAR state dict: widths, depths, grid, token width, buffer and head size from
    the tensors; heads from ``variant`` or the official size with that width (else width / 64)."""
    if "z_proj.weight" not in state or "class_embedding.weight" not in state:
        raise ValueError("not a MAR state dict: no 'z_proj.weight' / 'class_embedding.weight'")
    if variant is not None:
        base = mar_config(variant)
    else:
        base = {"buffer_size": 64, "condition_type": "class", "mlp_ratio": 4.0}
    enc = state["z_proj.weight"].shape[0]
    dec = state["decoder_embed.weight"].shape[0]
    heads = {v["encoder_embed_dim"]: v["encoder_num_heads"] for v in MAR_VARIANTS.values()}

    def depth(prefix: str) -> int:
        return len({int(m.group(1)) for k in state if (m := re.match(prefix + r"\.(\d+)\.", k))})

    seq_len = state["diffusion_pos_embed"].shape[1]
    buffer = state["encoder_pos_embed"].shape[1] - seq_len
    grid = int(round(seq_len ** 0.5))
    if grid * grid != seq_len:
        raise ValueError(f"MARModel needs a square token grid; the checkpoint has {seq_len} positions")
    mlp_hidden = state["encoder_blocks.0.mlp.fc1.weight"].shape[0] if "encoder_blocks.0.mlp.fc1.weight" in state else 4 * enc
    inferred = dict(grid_size=grid, token_dim=state["z_proj.weight"].shape[1], encoder_embed_dim=enc,
                    encoder_depth=depth("encoder_blocks"), decoder_embed_dim=dec, decoder_depth=depth("decoder_blocks"),
                    buffer_size=buffer, num_classes=state["class_embedding.weight"].shape[0],
                    diffloss_d=depth("head.blocks"), diffloss_w=state["head.input_proj.weight"].shape[0],
                    mlp_ratio=mlp_hidden / enc, condition_type="class")
    inferred.setdefault("encoder_num_heads", base.get("encoder_num_heads", heads.get(enc, max(1, enc // 64))))
    inferred.setdefault("decoder_num_heads", base.get("decoder_num_heads", heads.get(dec, max(1, dec // 64))))
    return {**{k: v for k, v in base.items() if k in ("num_sampling_steps",)}, **inferred}
