"""The LlamaGen VQ image tokenizer (VQ-16 / VQ-8) with the official parameter names.

A taming-transformers style convolutional autoencoder with a vector quantiser (LlamaGen, Sun et al.
2024, https://arxiv.org/abs/2406.06525): the encoder halves the resolution ``len(ch_mult) - 1`` times
(16x for VQ-16: a 256 px image becomes a 16x16 token grid), ``quant_conv`` maps to the code width
(8), each vector is replaced by its nearest codebook entry (16384 entries, both sides L2-normalised:
nearest = largest cosine), and ``post_quant_conv`` + the decoder map codes back to pixels.

Images are float ``[B, 3, H, W]`` in ``[-1, 1]`` (LlamaGen's convention, unlike the shapes-world
tokenizers of :mod:`mmspec.models.tokenizers`, which use ``[0, 1]``).
:meth:`LlamaGenVQModel.codebook_neighbors` gives the latent neighbourhoods B_k(x) of LANTERN / MuLo-SD.
Only inference is implemented (no VQ/commitment/GAN losses).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from mmspec.neighbors import nearest_neighbors
from mmspec.validation import checks_enabled

from .llamagen import checkpoint_dtype, load_checked, load_llamagen_state_dict

# ----------------------------------------------------------------------------------------------------
# building blocks (official parameter names)
# ----------------------------------------------------------------------------------------------------


class ResnetBlock(nn.Module):
    """GroupNorm-SiLU-Conv twice, with a 1x1 ``nin_shortcut`` when the width changes."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels, eps=1e-6)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, out_channels, eps=1e-6)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all positions of a feature map (1x1 conv projections)."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels, eps=1e-6)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        n = self.norm(x)
        q, k, v = (conv(n).flatten(2).transpose(1, 2) for conv in (self.q, self.k, self.v))  # [B, HW, C]
        out = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(C)) v
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, h, w))


class Downsample(nn.Module):
    """Stride-2 3x3 conv after padding one pixel right and bottom (halves H and W)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest-neighbour x2, then a 3x3 conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _level(res: list[nn.Module], attn: list[nn.Module], resample: tuple[str, nn.Module] | None) -> nn.Module:
    """One resolution level: ``res`` blocks, ``attn`` blocks (lowest resolution only), a resampler."""
    level = nn.Module()
    level.res, level.attn = nn.ModuleList(res), nn.ModuleList(attn)
    if resample is not None:
        setattr(level, resample[0], resample[1])
    return level


def _middle(channels: int, dropout: float, groups: int) -> nn.ModuleList:
    return nn.ModuleList([ResnetBlock(channels, channels, dropout, groups), AttnBlock(channels, groups),
                          ResnetBlock(channels, channels, dropout, groups)])


class Encoder(nn.Module):
    """Image ``[B, in, H, W]`` -> features ``[B, z_channels, H/f, W/f]``, f = 2^(levels-1)."""

    def __init__(self, in_channels: int, ch: int, ch_mult: list[int], num_res_blocks: int, dropout: float,
                 z_channels: int, groups: int) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        width = ch
        for i, mult in enumerate(ch_mult):
            last = i == len(ch_mult) - 1
            res, attn = [], []
            for _ in range(num_res_blocks):
                res.append(ResnetBlock(width, ch * mult, dropout, groups))
                width = ch * mult
                if last:
                    attn.append(AttnBlock(width, groups))
            self.conv_blocks.append(_level(res, attn, None if last else ("downsample", Downsample(width))))
        self.mid = _middle(width, dropout, groups)
        self.norm_out = nn.GroupNorm(groups, width, eps=1e-6)
        self.conv_out = nn.Conv2d(width, z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.conv_blocks:
            for i, block in enumerate(level.res):
                h = block(h)
                if len(level.attn):
                    h = level.attn[i](h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Features ``[B, z_channels, h, w]`` -> image ``[B, out, h*f, w*f]``; levels run from the lowest
    resolution up, each with ``num_res_blocks + 1`` blocks."""

    def __init__(self, z_channels: int, ch: int, ch_mult: list[int], num_res_blocks: int, dropout: float,
                 out_channels: int, groups: int) -> None:
        super().__init__()
        width = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, width, 3, padding=1)
        self.mid = _middle(width, dropout, groups)
        self.conv_blocks = nn.ModuleList()
        for i in reversed(range(len(ch_mult))):
            res, attn = [], []
            for _ in range(num_res_blocks + 1):
                res.append(ResnetBlock(width, ch * ch_mult[i], dropout, groups))
                width = ch * ch_mult[i]
                if i == len(ch_mult) - 1:
                    attn.append(AttnBlock(width, groups))
            self.conv_blocks.append(_level(res, attn, None if i == 0 else ("upsample", Upsample(width))))
        self.norm_out = nn.GroupNorm(groups, width, eps=1e-6)
        self.conv_out = nn.Conv2d(width, out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            for i, block in enumerate(level.res):
                h = block(h)
                if len(level.attn):
                    h = level.attn[i](h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    """Nearest-entry quantiser over ``embedding [codebook_size, embed_dim]`` (cosine when l2-normalised)."""

    def __init__(self, codebook_size: int, embed_dim: int, l2_norm: bool) -> None:
        super().__init__()
        self.l2_norm = l2_norm
        self.embedding = nn.Embedding(codebook_size, embed_dim)
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / codebook_size, 1.0 / codebook_size)
            if l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, dim=-1))

    def codebook(self) -> torch.Tensor:
        """The entries codes are compared with and decoded from: ``[V, embed_dim]`` (normalised if l2)."""
        weight = self.embedding.weight
        return F.normalize(weight, dim=-1) if self.l2_norm else weight

    def nearest(self, z: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """Codebook index of each row of ``z [N, embed_dim]`` -> LongTensor ``[N]``."""
        codebook = self.codebook()
        if self.l2_norm:
            z = F.normalize(z, dim=-1)
        sq = (codebook * codebook).sum(-1)  # [V]
        # |z - e|^2 = |z|^2 + |e|^2 - 2 z.e; |z|^2 is constant per row
        return torch.cat([(sq - 2 * part @ codebook.T).argmin(-1) for part in z.split(chunk)]) if len(z) else \
            torch.zeros(0, dtype=torch.long, device=z.device)


# ----------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------


class LlamaGenVQModel(ModelMixin, ConfigMixin):
    """LlamaGen's VQ tokenizer (defaults: VQ-16, codebook 16384 x 8, 256 px -> 16 x 16 tokens).

    Config (names as LlamaGen's ``ModelArgs`` where they exist):
        codebook_size, codebook_embed_dim, codebook_l2_norm: the codebook and whether codes and entries
            are L2-normalised before the nearest-entry search (LlamaGen: True).
        encoder_ch_mult, decoder_ch_mult: channel multipliers per resolution level (VQ-16:
            [1, 1, 2, 2, 4], 16x down-sampling; VQ-8: [1, 2, 2, 4]).
        z_channels: encoder output width (256). dropout_p: ResNet dropout (0).
        ch, num_res_blocks, in_channels, out_channels, norm_groups: fixed in LlamaGen's code (128, 2, 3,
            3, 32); configurable here for tiny test models (widths must be multiples of norm_groups).

    ``decode`` returns LlamaGen's pixel range ``decode_range`` = (-1, 1); pipelines map it to [0, 1].
    """

    decode_range: tuple[float, float] = (-1.0, 1.0)

    @register_to_config
    def __init__(self, codebook_size: int = 16384, codebook_embed_dim: int = 8, codebook_l2_norm: bool = True,
                 encoder_ch_mult: list[int] | tuple[int, ...] = (1, 1, 2, 2, 4),
                 decoder_ch_mult: list[int] | tuple[int, ...] = (1, 1, 2, 2, 4), z_channels: int = 256,
                 dropout_p: float = 0.0, ch: int = 128, num_res_blocks: int = 2, in_channels: int = 3,
                 out_channels: int = 3, norm_groups: int = 32) -> None:
        super().__init__()
        for name, value in (("codebook_size", codebook_size), ("codebook_embed_dim", codebook_embed_dim),
                            ("z_channels", z_channels), ("ch", ch), ("num_res_blocks", num_res_blocks),
                            ("in_channels", in_channels), ("out_channels", out_channels),
                            ("norm_groups", norm_groups)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, mult in (("encoder_ch_mult", encoder_ch_mult), ("decoder_ch_mult", decoder_ch_mult)):
            if not len(mult) or any(not isinstance(m, int) or m < 1 or (ch * m) % norm_groups for m in mult):
                raise ValueError(f"{name} must be positive integers with ch * mult divisible by norm_groups="
                                 f"{norm_groups}, got {list(mult)} (ch={ch})")
        if len(encoder_ch_mult) != len(decoder_ch_mult):
            raise ValueError("encoder_ch_mult and decoder_ch_mult must have the same number of levels")
        self.encoder = Encoder(in_channels, ch, list(encoder_ch_mult), num_res_blocks, dropout_p, z_channels,
                               norm_groups)
        self.decoder = Decoder(z_channels, ch, list(decoder_ch_mult), num_res_blocks, dropout_p, out_channels,
                               norm_groups)
        self.quantize = VectorQuantizer(codebook_size, codebook_embed_dim, codebook_l2_norm)
        self.quant_conv = nn.Conv2d(z_channels, codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(codebook_embed_dim, z_channels, 1)

    @property
    def vocab_size(self) -> int:
        return self.config.codebook_size

    @property
    def downsample_factor(self) -> int:
        """Pixels per token side (16 for VQ-16)."""
        return 2 ** (len(self.config.encoder_ch_mult) - 1)

    def codebook_embeddings(self) -> torch.Tensor:
        """``[V, codebook_embed_dim]`` entries as used for quantisation (normalised when l2)."""
        return self.quantize.codebook().detach()

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images ``[B, 3, H, W]`` in ``[-1, 1]`` -> token grid LongTensor ``[B, H/f, W/f]``."""
        f, c = self.downsample_factor, self.config.in_channels
        if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != c \
                or not images.is_floating_point():
            got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"images must be a float tensor [B, {c}, H, W], got {got}")
        if images.shape[2] % f or images.shape[3] % f or min(images.shape[2:]) == 0:
            raise ValueError(f"images height and width must be positive multiples of {f}, got "
                             f"{images.shape[2]}x{images.shape[3]}")
        if checks_enabled() and images.numel() and (images.min() < -1.001 or images.max() > 1.001):
            raise ValueError(f"images must have values in [-1, 1] (LlamaGen's range; map [0, 1] images with "
                             f"2 * x - 1), got min {images.min().item():.3g}, max {images.max().item():.3g}")
        param = self.quant_conv.weight
        z = self.quant_conv(self.encoder(images.to(device=param.device, dtype=param.dtype)))  # [B, e, h, w]
        b, e, h, w = z.shape
        return self.quantize.nearest(z.permute(0, 2, 3, 1).reshape(-1, e)).view(b, h, w)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """token grid ``[B, h, w]`` -> images ``[B, 3, h*f, w*f]`` (clamped to ``[-1, 1]`` by default)."""
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 3 or tokens.is_floating_point():
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be an integer token grid [B, h, w], got {got}")
        v = self.config.codebook_size
        if checks_enabled() and tokens.numel() and (tokens.min() < 0 or tokens.max() >= v):
            raise ValueError(f"tokens has ids outside [0, {v}) (min {int(tokens.min())}, max {int(tokens.max())})")
        codes = self.quantize.codebook()[tokens.to(self.quant_conv.weight.device).long()]  # [B, h, w, e]
        images = self.decoder(self.post_quant_conv(codes.permute(0, 3, 1, 2)))
        return images.clamp(-1.0, 1.0) if clamp else images

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Reconstruction ``decode(encode(images))`` (no gradients through the quantiser)."""
        return self.decode(self.encode(images))

    def codebook_neighbors(self, k: int, chunk: int = 1024) -> torch.Tensor:
        """The k nearest OTHER codebook entries of every entry (L2 between the entries used for
        quantisation), nearest first: LongTensor ``[V, k]``; equally distant entries by index
        (:func:`~mmspec.neighbors.nearest_neighbors`, float64, ``chunk`` rows at a time)."""
        return nearest_neighbors(self.quantize.codebook(), k, chunk)

    @classmethod
    def from_llamagen_checkpoint(cls, path: str | os.PathLike, *, key: str | None = None, weights_only: bool = True,
                                 torch_dtype: torch.dtype | None = None, **config: Any) -> LlamaGenVQModel:
        """Load an official LlamaGen VQ checkpoint (e.g. ``vq_ds16_c2i.pt``, ``vq_ds16_t2i.pt``).

        Same file handling as :meth:`LlamaGenTransformer.from_llamagen_checkpoint` (``ckpt["model"]`` /
        ``["module"]`` / ``["state_dict"]`` / the dict itself, prefixes stripped, the usage buffer
        ``quantize.codebook_used`` dropped). The architecture is inferred from the weights (codebook,
        widths, channel multipliers, blocks per level); ``codebook_l2_norm`` (True) cannot be and may
        be passed. ``torch_dtype`` defaults to the checkpoint's float dtype. Bad files raise ValueError
        naming missing/unexpected/mis-shaped keys.
        """
        state = load_llamagen_state_dict(path, key=key, weights_only=weights_only,
                                         drop=(r"^quantize\.codebook_used$",))
        model = cls(**{**infer_vq_config(state), **config}).to(torch_dtype or checkpoint_dtype(state))
        load_checked(model, state, path)
        return model.eval()


def infer_vq_config(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Architecture fields readable from a LlamaGen VQ state dict."""
    needed = ("quantize.embedding.weight", "encoder.conv_in.weight", "quant_conv.weight", "decoder.conv_out.weight")
    if any(name not in state for name in needed):
        raise ValueError(f"not a LlamaGen VQ state dict: it lacks {[n for n in needed if n not in state]}")
    size, embed = state["quantize.embedding.weight"].shape
    ch, in_channels = state["encoder.conv_in.weight"].shape[:2]

    def multipliers(prefix: str) -> list[int]:
        levels = sorted({int(m.group(1)) for k in state if (m := re.match(rf"{prefix}\.conv_blocks\.(\d+)\.", k))})
        widths = [state.get(f"{prefix}.conv_blocks.{i}.res.0.conv1.weight") for i in levels]
        if not widths or any(w is None for w in widths):
            raise ValueError(f"not a LlamaGen VQ state dict: {prefix}.conv_blocks.*.res.0.conv1 missing")
        return [int(w.shape[0]) // int(ch) for w in widths]

    blocks = {int(m.group(1)) for k in state if (m := re.match(r"encoder\.conv_blocks\.0\.res\.(\d+)\.", k))}
    return dict(codebook_size=int(size), codebook_embed_dim=int(embed), ch=int(ch), in_channels=int(in_channels),
                z_channels=int(state["quant_conv.weight"].shape[1]),
                out_channels=int(state["decoder.conv_out.weight"].shape[0]),
                encoder_ch_mult=multipliers("encoder"), decoder_ch_mult=multipliers("decoder")[::-1],
                num_res_blocks=max(blocks) + 1)
