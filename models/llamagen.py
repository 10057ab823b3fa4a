"""A LlamaGen-compatible autoregressive image transformer (class- or text-conditioned).

LlamaGen (Sun et al. 2024, https://arxiv.org/abs/2406.06525) generates an image as a raster sequence
of VQ codes with a plain Llama decoder: RMSNorm, SwiGLU, rotary attention, no biases. The condition
(a class label, or projected text-encoder features) is a prefix of ``cls_token_num`` tokens; image
token k follows at sequence position ``C + k``. Rotary embeddings are 2-D: half of every head's
rotation pairs turn with the token's grid row, half with its column.

This file re-implements that architecture with the parameter names of the official code
(``tok_embeddings``, ``cls_embedding.*``, ``layers.{i}.attention.wqkv`` ...), so the official
checkpoints load directly (:meth:`LlamaGenTransformer.from_llamagen_checkpoint`), and with the
forward contract of :class:`mmspec.runner.CausalLMRunner` (2-D or 4-D attention masks, per-row
position ids, the project's :class:`~mmspec.cache.KVCache` with rollback), so the same model serves as
speculation target and as draft model.

Two behaviours of the official code are kept on purpose because checkpoints depend on them:

* LlamaGen's rotary table holds ``(cos, sin) = (0, 0)`` at condition positions, so the queries and keys
  of condition tokens are **zero**: every attention score involving a condition key is 0 and condition
  tokens reach the image tokens through their values only.
* The unconditional (classifier-free guidance) condition is an extra class id ``num_classes`` (c2i) or
  a fixed random buffer ``cls_embedding.uncond_embedding`` of caption features (t2i).

Deviations: dropout defaults to 0 (LlamaGen trains with 0.1; set ``token_dropout_p`` etc.), the output
layer starts random instead of zero (so untrained models are not uniform), and ``text_vocab_size`` adds
a learned word embedding in front of the caption projection for the project's T5-free zoo models.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from mmspec.cache import KVCache
from mmspec.validation import checks_enabled

# Official LlamaGen GPT sizes (autoregressive/models/gpt.py): width -> heads, used to infer n_head.
LLAMAGEN_PRESETS: dict[str, dict[str, int]] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),     # 111M, c2i
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),    # 343M, c2i
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),   # 775M, c2i (and t2i "GPT-XL" 775M)
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),  # 1.4B, c2i
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),  # 3.9B, c2i
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
}
_HEADS_BY_WIDTH = {p["dim"]: p["n_head"] for p in LLAMAGEN_PRESETS.values()}


@dataclass
class ARImageOutput:
    """Output of :meth:`LlamaGenTransformer.forward`.

    Attributes:
        logits: ``[B, T, V]`` next-image-token logits of the T input slots (float32, or float64 for
            float64 models).
        past_key_values: the KV cache after this call (None when ``use_cache=False``).
        hidden_states: when asked, ``n_layer + 1`` tensors ``[B, T, dim]``: the input embeddings, the
            outputs of layers 1..n_layer-1, and last the final *normed* hidden state fed to ``output``.
    """

    logits: torch.Tensor
    past_key_values: KVCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class LlamaGenKVCache(KVCache):
    """:class:`~mmspec.cache.KVCache` that also remembers, per row, where the image starts.

    ``condition_length [B]`` is set by the prefill (1 + the last condition position), so an image
    token at position p sits at grid index ``p - condition_length``; rows with padded conditions keep
    LlamaGen's grid positions although their sequence positions count valid tokens only.
    """

    condition_length: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------------
# building blocks (official parameter names)
# ----------------------------------------------------------------------------------------------------


def find_multiple(n: int, k: int) -> int:
    """Smallest multiple of k that is >= n."""
    return n if n % k == 0 else n + k - n % k


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU width as in Llama/LlamaGen: 2/3 of 4*dim, optionally scaled, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return find_multiple(hidden, multiple_of)


class RMSNorm(nn.Module):
    """RMSNorm computed in (at least) float32, as LlamaGen does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(compute), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class LabelEmbedder(nn.Module):
    """Class id -> one condition token ``[B, 1, dim]``; row ``num_classes`` is the null class (CFG)."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float) -> None:
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), dim)
        self.num_classes = num_classes

    def forward(self, labels: torch.Tensor, drop: torch.Tensor | None) -> torch.Tensor:
        if drop is not None:
            labels = torch.where(drop, self.num_classes, labels)
        return self.embedding_table(labels).unsqueeze(1)  # [B, 1, dim]


class MLP(nn.Module):
    """Caption projection: Linear -> GELU(tanh) -> Linear, no biases."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """Caption features ``[B, C, caption_dim]`` -> condition tokens ``[B, C, dim]``.

    Dropped rows (CFG's unconditional half) take the fixed buffer ``uncond_embedding``
    ``[cls_token_num, caption_dim]``; a condition shorter than ``cls_token_num`` is LlamaGen's left-padded
    layout with the padding left out, so it takes the buffer's last C rows.
    """

    def __init__(self, caption_dim: int, dim: int, token_num: int) -> None:
        super().__init__()
        self.cap_proj = MLP(caption_dim, dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)

    def forward(self, caption: torch.Tensor, drop: torch.Tensor | None) -> torch.Tensor:
        if drop is not None:
            uncond = self.uncond_embedding[self.uncond_embedding.shape[0] - caption.shape[1]:]  # [C, caption_dim]
            caption = torch.where(drop[:, None, None], uncond.to(caption.dtype), caption)
        return self.cap_proj(caption)


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention with one fused qkv projection and 2-D RoPE."""

    def __init__(self, dim: int, n_head: int, n_kv_head: int, attn_dropout_p: float, resid_dropout_p: float) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, dim // n_head
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.attn_dropout_p = attn_dropout_p
        self.resid_dropout = nn.Dropout(resid_dropout_p)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        b, t, d = x.shape
        heads, kv_heads = self.n_head, self.n_kv_head
        qk, v = self.wqkv(x).split([d + kv_heads * self.head_dim, kv_heads * self.head_dim], dim=-1)
        qk = apply_rotary(qk.view(b, t, heads + kv_heads, self.head_dim), rope)  # q and k rotate together
        q, k = qk.split([heads, kv_heads], dim=2)
        v = v.view(b, t, kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, hd]
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, Hkv, S+T, hd]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
            dropout_p=self.attn_dropout_p if self.training else 0.0,
            enable_gqa=kv_heads != heads)  # [B, H, T, hd]
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(b, t, d)))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int, dropout_p: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.ffn_dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class TransformerBlock(nn.Module):
    """Pre-norm Llama block with optional stochastic depth (drop path)."""

    def __init__(self, config: Any, drop_path: float) -> None:
        super().__init__()
        n_kv = config.n_kv_head if config.n_kv_head is not None else config.n_head
        self.attention = Attention(config.dim, config.n_head, n_kv, config.attn_dropout_p, config.resid_dropout_p)
        hidden = ffn_hidden_dim(config.dim, config.multiple_of, config.ffn_dim_multiplier)
        self.feed_forward = FeedForward(config.dim, hidden, config.ffn_dropout_p)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.drop_path = drop_path

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_path == 0.0:
            return x
        keep = torch.rand(x.shape[0], 1, 1, device=x.device) >= self.drop_path  # one draw per sample
        return x * keep.to(x.dtype) / (1.0 - self.drop_path)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        h = x + self._drop(self.attention(self.attention_norm(x), rope, mask, cache, layer))
        return h + self._drop(self.feed_forward(self.ffn_norm(h)))


# ----------------------------------------------------------------------------------------------------
# 2-D rotary embeddings
# ----------------------------------------------------------------------------------------------------


def rope_2d(grid_index: torch.Tensor, grid_size: int, head_dim: int, base: float,
            dtype: torch.dtype, condition_rope: str = "zero") -> torch.Tensor:
    """LlamaGen's 2-D RoPE for image grid indices ``[B, T]``: complex ``cos + i sin`` ``[B, T, 1, head_dim/2]``.

    Pair j < head_dim/4 of a head rotates by ``row * f_j``, pair head_dim/4 + j by ``col * f_j`` with
    ``f_j = 1 / base^(2j / (head_dim/2))`` and ``(row, col) = divmod(k, grid_size)``. Negative indices are
    condition tokens and get LlamaGen's all-zero entry (their q and k vanish), or with
    ``condition_rope="identity"`` the unit entry (q and k kept unrotated). Indices past the grid
    (drafts beyond the last token, which generation discards) continue the row count. ``dtype`` is the
    real dtype the rotation is computed in (float32, or float64 for float64 models).
    """
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2, device=grid_index.device, dtype=dtype)[: half // 2] / half))
    k = grid_index.clamp_min(0)
    row, col = (k // grid_size).to(dtype), (k % grid_size).to(dtype)
    angles = torch.cat([row[..., None] * freqs, col[..., None] * freqs], dim=-1)  # [B, T, head_dim/2]
    if condition_rope == "identity":  # condition tokens: angle 0, magnitude 1
        angles = angles * (grid_index >= 0).to(dtype)[..., None]
        magnitude = torch.ones_like(angles)
    else:
        magnitude = (grid_index >= 0).to(dtype)[..., None].expand_as(angles)  # 0 for condition tokens
    return torch.polar(magnitude, angles).unsqueeze(2)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
    """Rotate the interleaved pairs ``(x[2j], x[2j+1])`` of ``x [B, T, H, hd]`` by ``rope [B, T, 1, hd/2]``
    (complex); None = condition tokens only, which LlamaGen zeroes."""
    if rope is None:
        return torch.zeros_like(x)
    pairs = torch.view_as_complex(x.to(rope.real.dtype).unflatten(-1, (-1, 2)).contiguous())  # [B, T, H, hd/2]
    return torch.view_as_real(pairs * rope).flatten(-2).to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------


class LlamaGenTransformer(ModelMixin, ConfigMixin):
    """LlamaGen GPT: Llama decoder over ``[condition tokens, image tokens]`` with 2-D RoPE.

    Config (names as LlamaGen's ``ModelArgs``; defaults are GPT-B c2i at 256 px):
        dim, n_layer, n_head: width, depth, heads; n_kv_head: grouped-query heads (None = n_head).
        multiple_of, ffn_dim_multiplier: SwiGLU width (2/3 * 4 * dim, scaled, rounded up).
        rope_base, norm_eps, initializer_range: RoPE base, RMSNorm epsilon, init std.
        token_dropout_p, attn_dropout_p, resid_dropout_p, ffn_dropout_p, drop_path_rate: training
            regularisation (LlamaGen: 0.1, 0, 0.1, 0.1, 0; here all 0 by default).
        vocab_size: image codebook size (16384 for VQ-16).
        num_classes, class_dropout_prob: c2i labels; ``class_dropout_prob > 0`` adds the null class
            ``num_classes`` (needed for CFG) and is the label-dropout rate of :meth:`forward_train`.
        caption_dim: t2i caption feature width (2048 for flan-t5-xl).
        model_type: "c2i" (one class token) or "t2i" (``cls_token_num`` caption tokens).
        cls_token_num: condition tokens (1 for c2i, 120 for LlamaGen t2i).
        block_size: image tokens, a square grid (256 = 16x16 for 256 px, 576 for 384 px, 1024 for 512 px).
        text_vocab_size: t2i only: embed word ids with a learned ``text_embeddings`` table
            ``[text_vocab_size, caption_dim]`` in front of the caption projection (no T5 needed), plus
            a learned ``text_positions`` table ``[cls_token_num, caption_dim]`` indexed by word order
            (word embeddings carry no order of their own, unlike T5 features).
        condition_rope: "zero" (LlamaGen: the condition tokens' q and k are zeroed, so every image token
            attends to them with one shared logit, an unweighted bag of condition tokens) or "identity"
            (their q and k are kept, unrotated: content-based attention over the words; the project's
            zoo models use it, since word-level conditioning through the zeroed path learns very slowly).
    """

    @register_to_config
    def __init__(self, dim: int = 768, n_layer: int = 12, n_head: int = 12, n_kv_head: int | None = None,
                 multiple_of: int = 256, ffn_dim_multiplier: float | None = None, rope_base: float = 10000.0,
                 norm_eps: float = 1e-5, initializer_range: float = 0.02, token_dropout_p: float = 0.0,
                 attn_dropout_p: float = 0.0, resid_dropout_p: float = 0.0, ffn_dropout_p: float = 0.0,
                 drop_path_rate: float = 0.0, num_classes: int = 1000, caption_dim: int = 2048,
                 class_dropout_prob: float = 0.1, model_type: str = "c2i", vocab_size: int = 16384,
                 cls_token_num: int = 1, block_size: int = 256, text_vocab_size: int | None = None,
                 condition_rope: str = "zero") -> None:
        super().__init__()
        _check_config(dim, n_layer, n_head, n_kv_head, model_type, cls_token_num, block_size, vocab_size,
                      num_classes, text_vocab_size)
        if condition_rope not in ("zero", "identity"):
            raise ValueError(f"condition_rope must be 'zero' (LlamaGen) or 'identity', got {condition_rope!r}")
        self.grid_size = int(round(block_size**0.5))
        if model_type == "c2i":
            self.cls_embedding: nn.Module = LabelEmbedder(num_classes, dim, class_dropout_prob)
        else:
            self.cls_embedding = CaptionEmbedder(caption_dim, dim, cls_token_num)
            if text_vocab_size is not None:
                self.text_embeddings = nn.Embedding(text_vocab_size, caption_dim)
                self.text_positions = nn.Embedding(cls_token_num, caption_dim)
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.tok_dropout = nn.Dropout(token_dropout_p)
        rates = torch.linspace(0, drop_path_rate, n_layer).tolist()
        self.layers = nn.ModuleList(TransformerBlock(self.config, rate) for rate in rates)
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)

    # --- interface used by runners and draft heads ----------------------------------------------------

    @property
    def hidden_size(self) -> int:
        return self.config.dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def head_dim(self) -> int:
        return self.config.dim // self.config.n_head

    def get_input_embeddings(self) -> nn.Embedding:
        return self.tok_embeddings

    def get_output_embeddings(self) -> nn.Linear:
        return self.output

    def new_cache(self, batch_size: int, max_length: int | None = None) -> LlamaGenKVCache:
        """An empty growable KV cache for ``batch_size`` rows (model dtype and device)."""
        c = self.config
        length = max_length if max_length is not None else c.cls_token_num + c.block_size + 64
        n_kv = c.n_kv_head if c.n_kv_head is not None else c.n_head
        param = self.tok_embeddings.weight
        return LlamaGenKVCache(c.n_layer, batch_size, n_kv, self.head_dim, length, dtype=param.dtype,
                               device=param.device)

    # --- condition ------------------------------------------------------------------------------------

    def embed_condition(self, condition_ids: torch.Tensor | None = None, condition_embeds: torch.Tensor | None = None,
                        condition_drop: torch.Tensor | None = None) -> torch.Tensor:
        """Condition tokens ``[B, C, dim]`` from class ids, word ids or caption features.

        Args:
            condition_ids: c2i: class ids ``[B]`` or ``[B, 1]``; t2i with ``text_vocab_size``: word ids
                ``[B, C]`` (negative ids are padding and embed to zero features, like LlamaGen's
                zero-padded T5 features).
            condition_embeds: t2i: caption features ``[B, C, caption_dim]`` (e.g. flan-t5-xl).
            condition_drop: bool ``[B]``: rows that get the unconditional embedding (CFG).
        """
        c = self.config
        if (condition_ids is None) == (condition_embeds is None):
            raise ValueError("the condition (the prefill, input_ids=None) needs exactly one of condition_ids and "
                             "condition_embeds")
        device = self.tok_embeddings.weight.device
        if c.model_type == "c2i":
            if condition_embeds is not None:
                raise ValueError("a c2i model takes class ids (condition_ids [B]), not condition_embeds")
            labels = _as_long(condition_ids, "condition_ids")
            if labels.ndim == 2 and labels.shape[1] == 1:
                labels = labels[:, 0]
            if labels.ndim != 1:
                raise ValueError(f"condition_ids of a c2i model must be class ids [B] or [B, 1], "
                                 f"got {tuple(condition_ids.shape)}")
            _check_range(labels, c.num_classes, "condition_ids")
            drop = _check_drop(condition_drop, labels.shape[0], c.class_dropout_prob > 0)
            return self.cls_embedding(labels.to(device), drop)
        if condition_ids is not None:
            if c.text_vocab_size is None:
                raise ValueError("this t2i model has no text embedding (text_vocab_size=None): pass caption "
                                 "features as condition_embeds [B, C, caption_dim]")
            words = _as_long(condition_ids, "condition_ids")
            if words.ndim != 2:
                raise ValueError(f"condition_ids of a t2i model must be word ids [B, C], got {tuple(words.shape)}")
            _check_range(words, c.text_vocab_size, "condition_ids", allow_negative=True)
            words = words.to(device)
            valid = words >= 0
            order = (valid.long().cumsum(-1) - 1).clamp(0, c.cls_token_num - 1)  # word index (too long: checked below)
            caption = (self.text_embeddings(words.clamp_min(0)) + self.text_positions(order)) * valid.unsqueeze(-1).to(
                self.text_embeddings.weight.dtype)  # [B, C, caption_dim]
        else:
            caption = condition_embeds
            if not isinstance(caption, torch.Tensor) or caption.ndim != 3 or caption.shape[-1] != c.caption_dim:
                got = tuple(caption.shape) if isinstance(caption, torch.Tensor) else type(caption).__name__
                raise ValueError(f"condition_embeds must be [B, C, {c.caption_dim}] caption features, got {got}")
            caption = caption.to(device=device, dtype=self.tok_embeddings.weight.dtype)
        if not 1 <= caption.shape[1] <= c.cls_token_num:
            raise ValueError(f"the condition has {caption.shape[1]} tokens; this model takes 1..{c.cls_token_num} "
                             "(use pad_condition to truncate/left-pad as LlamaGen does)")
        drop = _check_drop(condition_drop, caption.shape[0], True)
        return self.cls_embedding(caption, drop)

    def pad_condition(self, condition: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaGen's t2i condition layout: keep the first ``cls_token_num`` valid tokens, left-pad.

        Args:
            condition: word ids ``[B, C]`` or caption features ``[B, C, caption_dim]``.
            mask: ``[B, C]`` 1 for real tokens (default all). Tokens are packed left to right.
        Returns:
            ``(condition [B, cls_token_num(, caption_dim)], attention_mask LongTensor [B, cls_token_num])``
            with padding as word id -1 / zero features and mask 0 on the left.
        """
        n = self.config.cls_token_num
        if mask is None:
            mask = torch.ones(condition.shape[:2], dtype=torch.long, device=condition.device)
        if mask.shape != condition.shape[:2]:
            raise ValueError(f"mask {tuple(mask.shape)} must match the condition's [B, C] {tuple(condition.shape[:2])}")
        pad_value = -1 if not condition.is_floating_point() else 0
        out = torch.full((condition.shape[0], n, *condition.shape[2:]), pad_value, dtype=condition.dtype,
                         device=condition.device)
        out_mask = torch.zeros(condition.shape[0], n, dtype=torch.long, device=condition.device)
        for b in range(condition.shape[0]):
            real = condition[b][mask[b].bool()][:n]  # the first n valid tokens (LlamaGen truncation)
            if len(real):
                out[b, n - len(real):] = real
                out_mask[b, n - len(real):] = 1
        return out, out_mask

    # --- forward --------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: KVCache | None = None,
                use_cache: bool = True, output_hidden_states: bool = False,
                condition_ids: torch.Tensor | None = None, condition_embeds: torch.Tensor | None = None,
                condition_drop: torch.Tensor | None = None) -> ARImageOutput:
        """Prefill (a condition) or decode (image tokens) T new slots after S cached ones.

        Args:
            input_ids: image tokens ``[B, T]`` (decoding); None for the prefill, whose tokens are the
                condition (``condition_ids`` / ``condition_embeds`` / ``condition_drop``, see
                :meth:`embed_condition`).
            attention_mask: 2-D ``[B, S+T]`` key mask (1 = real slot; causal order is added) or 4-D bool
                ``[B, 1, T, S+T]`` visibility (used as given, e.g. draft trees). Every query also sees
                its own slot (as in LlamaGen's masks), so padding rows stay finite.
            position_ids: ``[B, T]`` sequence positions: condition tokens before the image, image token
                k at ``condition_length + k`` (per row; tree nodes may share positions). Default:
                ``S + arange(T)``.
            past_key_values: a :class:`~mmspec.cache.KVCache` (:meth:`new_cache`); created when None
                and ``use_cache``.
        Returns:
            :class:`ARImageOutput`; the prefill's last logits predict the first image token.
        """
        prefill = input_ids is None
        if prefill:
            h = self.embed_condition(condition_ids, condition_embeds, condition_drop)  # [B, C, dim]
        else:
            if condition_ids is not None or condition_embeds is not None:
                raise ValueError("pass either input_ids (image tokens) or a condition (prefill), not both; "
                                 "use forward_train for teacher forcing")
            if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
                raise ValueError(f"input_ids must be image tokens [B, T], got "
                                 f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids!r}")
            _check_range(input_ids, self.config.vocab_size, "input_ids")
            h = self.tok_embeddings(input_ids)  # [B, T, dim]
        batch, new = h.shape[:2]
        cache = past_key_values  # used when given; a new one is started when None and use_cache
        if cache is None and use_cache:
            cache = self.new_cache(batch)
        past = cache.get_seq_length() if cache is not None else 0
        if cache is not None and cache.keys.shape[1] != batch:
            raise ValueError(f"past_key_values holds {cache.keys.shape[1]} rows, the input {batch}")
        if position_ids is None:
            position_ids = torch.arange(past, past + new, device=h.device).expand(batch, new)
        elif tuple(position_ids.shape) != (batch, new):
            raise ValueError(f"position_ids must have shape {(batch, new)}, got {tuple(position_ids.shape)}")
        position_ids = position_ids.to(h.device)
        mask, key_mask = self._attention_mask(attention_mask, batch, new, past, h.device)

        if prefill:  # condition tokens: LlamaGen's rotary entry is zero (or the identity)
            rope = None
            if self.config.condition_rope == "identity":
                rope = rope_2d(torch.full_like(position_ids, -1), self.grid_size, self.head_dim, self.config.rope_base,
                               torch.promote_types(h.dtype, torch.float32), "identity")
            if isinstance(cache, LlamaGenKVCache):
                valid = key_mask[:, past:] if key_mask is not None else torch.ones_like(position_ids, dtype=torch.bool)
                cache.condition_length = torch.where(valid, position_ids, -1).max(-1).values + 1  # [B]
        else:
            start = getattr(cache, "condition_length", None)
            start = torch.full((batch,), self.config.cls_token_num, device=h.device) if start is None else start
            grid_index = position_ids - start.to(h.device).unsqueeze(-1)  # [B, T]
            rope = rope_2d(grid_index, self.grid_size, self.head_dim, self.config.rope_base,
                           torch.promote_types(h.dtype, torch.float32), self.config.condition_rope)
        logits, hidden = self._decoder(h, rope, mask, cache, output_hidden_states)
        return ARImageOutput(logits, cache, hidden)

    def _attention_mask(self, attention_mask: torch.Tensor | None, batch: int, new: int, past: int,
                        device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Bool visibility ``[B, 1, T, S+T]`` (None = plain causal) and the 2-D key mask if one was given."""
        total = past + new
        query = torch.arange(past, total, device=device).unsqueeze(-1)  # [T, 1] slot of each query
        diagonal = torch.arange(total, device=device) == query  # [T, S+T]
        if attention_mask is None:
            if past == 0:
                return None, None
            return (torch.arange(total, device=device) <= query).expand(batch, 1, new, total), None
        if attention_mask.ndim == 2:
            if tuple(attention_mask.shape) != (batch, total):
                raise ValueError(f"a 2-D attention_mask must have shape [B, S+T] = {(batch, total)}, "
                                 f"got {tuple(attention_mask.shape)}")
            keys = attention_mask.to(device).bool()
            causal = torch.arange(total, device=device) <= query  # [T, S+T]
            return ((keys[:, None, :] & causal) | diagonal).unsqueeze(1), keys
        if attention_mask.ndim == 4:
            if tuple(attention_mask.shape) != (batch, 1, new, total):
                raise ValueError(f"a 4-D attention_mask must have shape [B, 1, T, S+T] = {(batch, 1, new, total)}, "
                                 f"got {tuple(attention_mask.shape)}")
            if attention_mask.dtype != torch.bool:
                raise ValueError(f"a 4-D attention_mask must be bool (True = attend), got {attention_mask.dtype}")
            return attention_mask.to(device) | diagonal, None
        raise ValueError(f"attention_mask must be 2-D [B, S+T] or 4-D [B, 1, T, S+T], got {tuple(attention_mask.shape)}")

    def _decoder(self, h: torch.Tensor, rope: torch.Tensor | None, mask: torch.Tensor | None,
                 cache: KVCache | None, output_hidden_states: bool) -> tuple[torch.Tensor, tuple | None]:
        """The layer stack and head: embeddings ``[B, T, dim]`` -> logits ``[B, T, V]``."""
        h = self.tok_dropout(h)
        hidden: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                hidden.append(h)
            h = layer(h, rope, mask, cache, i)
        h = self.norm(h)
        logits = self.output(h)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return logits, (tuple(hidden) + (h,)) if output_hidden_states else None

    def forward_train(self, condition_ids: torch.Tensor | None = None, image_tokens: torch.Tensor | None = None,
                      condition_drop: torch.Tensor | None = None, *, condition_embeds: torch.Tensor | None = None,
                      condition_mask: torch.Tensor | None = None, return_hidden: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing: logits ``[B, N, V]`` whose row k predicts ``image_tokens[:, k]`` from the
        condition and ``image_tokens[:, :k]``.

        Args:
            condition_ids / condition_embeds: the condition (see :meth:`embed_condition`).
            image_tokens: LongTensor ``[B, N]``, the raster-order codes of the image (N <= block_size).
            condition_drop: bool ``[B]`` rows trained unconditionally; default in training mode: each row
                with probability ``class_dropout_prob`` (LlamaGen's label dropout for CFG), in eval: none.
            condition_mask: ``[B, C]`` 1 for real condition tokens (padding hidden from every query).
            return_hidden: also return the top (normed) hidden states of every input position
                ``[B, C + N - 1, dim]`` (condition tokens, then image tokens but the last): the features
                an EAGLE head is trained on.
        """
        if not isinstance(image_tokens, torch.Tensor) or image_tokens.ndim != 2 or image_tokens.shape[1] < 1:
            raise ValueError("image_tokens must be a LongTensor [B, N] with N >= 1")
        if image_tokens.shape[1] > self.config.block_size:
            raise ValueError(f"image_tokens has {image_tokens.shape[1]} tokens, block_size is {self.config.block_size}")
        _check_range(image_tokens, self.config.vocab_size, "image_tokens")
        batch, n = image_tokens.shape
        if condition_drop is None and self.training and self.config.class_dropout_prob > 0:
            condition_drop = torch.rand(batch, device=image_tokens.device) < self.config.class_dropout_prob
        cond = self.embed_condition(condition_ids, condition_embeds, condition_drop)  # [B, C, dim]
        c = cond.shape[1]
        h = torch.cat([cond, self.tok_embeddings(image_tokens[:, :-1])], dim=1)  # [B, C+N-1, dim]
        index = torch.arange(-c, n - 1, device=h.device).expand(batch, -1)  # grid index, < 0: condition
        rope = rope_2d(index, self.grid_size, self.head_dim, self.config.rope_base,
                       torch.promote_types(h.dtype, torch.float32), self.config.condition_rope)
        mask = None
        if condition_mask is not None:
            if tuple(condition_mask.shape) != (batch, c):
                raise ValueError(f"condition_mask must have shape {(batch, c)}, got {tuple(condition_mask.shape)}")
            keys = torch.cat([condition_mask.to(h.device).bool(),
                              torch.ones(batch, n - 1, dtype=torch.bool, device=h.device)], 1)
            mask, _ = self._attention_mask(keys, batch, c + n - 1, 0, h.device)
        logits, hidden = self._decoder(h, rope, mask, None, return_hidden)
        if return_hidden:
            return logits[:, c - 1:], hidden[-1]
        return logits[:, c - 1:]

    # --- official checkpoints ---------------------------------------------------------------------------

    @classmethod
    def from_llamagen_checkpoint(cls, path: str | os.PathLike, *, key: str | None = None, weights_only: bool = True,
                                 torch_dtype: torch.dtype | None = None, **config: Any) -> LlamaGenTransformer:
        """Load an official LlamaGen GPT checkpoint (``.pt``/``.pth``/``.bin``/``.safetensors``).

        The state dict is ``ckpt[key]`` or the first of ``ckpt["model"]``, ``["module"]``,
        ``["state_dict"]``, or the file itself; ``module.`` / ``_orig_mod.`` prefixes are stripped and
        recomputed buffers (``freqs_cis``, ``causal_mask``, KV caches) dropped. Config fields not given
        are inferred from the weights (width, depth, vocabulary, model type, classes, caption width,
        condition length of t2i, grouped-query heads; heads from the official sizes); ``block_size``
        defaults to 256 (256 px): pass 576 for 384 px c2i models and 1024 for 512 px t2i models.
        ``key`` picks another entry (e.g. ``"ema"``); ``torch_dtype`` defaults to the checkpoint's float
        dtype; ``weights_only=False`` unpickles arbitrary objects (trusted files only).

        Raises:
            FileNotFoundError: no file at ``path``. ValueError: not a LlamaGen GPT state dict, listing
            missing, unexpected and mis-shaped keys.
        """
        state = load_llamagen_state_dict(path, key=key, weights_only=weights_only,
                                         drop=(r"(^|\.)freqs_cis$", r"(^|\.)causal_mask$", r"\.kv_cache\."))
        full = {**infer_gpt_config(state, config), **config}
        model = cls(**full).to(torch_dtype or checkpoint_dtype(state))
        load_checked(model, state, path)
        return model.eval()


# ----------------------------------------------------------------------------------------------------
# checkpoint plumbing (shared with llamagen_vq.py)
# ----------------------------------------------------------------------------------------------------


def load_llamagen_state_dict(path: str | os.PathLike, key: str | None = None, weights_only: bool = True,
                             drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Read a LlamaGen checkpoint file and return its cleaned state dict (see
    :meth:`LlamaGenTransformer.from_llamagen_checkpoint`); ``drop`` holds regexes of keys to discard."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {path!r}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        ckpt: Any = load_file(path)
    else:
        try:
            with torch.serialization.safe_globals([argparse.Namespace]):  # LlamaGen stores its args
                ckpt = torch.load(path, map_location="cpu", weights_only=weights_only)
        except Exception as error:  # an unpickling error names the class it refused
            raise ValueError(f"could not read {path!r} as a torch checkpoint ({error}); if the file is trusted "
                             "and pickles other objects, pass weights_only=False") from error
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path!r} holds a {type(ckpt).__name__}, not a checkpoint dict")
    if key is not None:
        if key not in ckpt:
            raise ValueError(f"{path!r} has no entry {key!r} (entries: {sorted(map(str, ckpt))[:10]})")
        state = ckpt[key]
    else:
        state = next((ckpt[k] for k in ("model", "module", "state_dict") if k in ckpt), ckpt)
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path!r} does not hold a state dict under 'model', 'module', 'state_dict' or at the top "
                         f"level (entries: {sorted(map(str, ckpt))[:10]})")
    cleaned = {}
    for name, tensor in state.items():
        while name.startswith(("module.", "_orig_mod.")):
            name = name.split(".", 1)[1]
        name = name.replace("._orig_mod.", ".")
        if any(re.search(pattern, name) for pattern in drop):
            continue
        cleaned[name] = tensor
    return cleaned


def checkpoint_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """The most common floating dtype of a state dict (float32 if it has none)."""
    counts: dict[torch.dtype, int] = {}
    for tensor in state.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def load_checked(model: nn.Module, state: dict[str, torch.Tensor], path: Any) -> None:
    """``model.load_state_dict(state)`` that names missing, unexpected and mis-shaped keys in a ValueError."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
                    for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or shapes:
        parts = [f"{label} ({len(items)}): {', '.join(items[:12])}{' ...' if len(items) > 12 else ''}"
                 for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                                      ("shape mismatches", shapes)) if items]
        raise ValueError(f"{type(model).__name__} cannot load {os.fspath(path)!r}: " + "; ".join(parts))
    model.load_state_dict(state, strict=True)


def infer_gpt_config(state: dict[str, torch.Tensor], given: dict[str, Any]) -> dict[str, Any]:
    """Config fields readable from a LlamaGen GPT state dict (fields in ``given`` win)."""
    if "tok_embeddings.weight" not in state:
        raise ValueError("not a LlamaGen GPT state dict: no 'tok_embeddings.weight' "
                         f"(keys start with {sorted(state)[:5]})")
    vocab, dim = state["tok_embeddings.weight"].shape
    layers = {int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))}
    out: dict[str, Any] = dict(vocab_size=int(vocab), dim=int(dim), n_layer=max(layers) + 1 if layers else 0)
    if "cls_embedding.embedding_table.weight" in state:
        rows = state["cls_embedding.embedding_table.weight"].shape[0]
        dropout = given.get("class_dropout_prob", 0.1)
        out.update(model_type="c2i", cls_token_num=1, num_classes=int(rows) - int(dropout > 0))
    elif "cls_embedding.cap_proj.fc1.weight" in state:
        out.update(model_type="t2i", caption_dim=int(state["cls_embedding.cap_proj.fc1.weight"].shape[1]))
        if "cls_embedding.uncond_embedding" in state:
            out["cls_token_num"] = int(state["cls_embedding.uncond_embedding"].shape[0])
        if "text_embeddings.weight" in state:
            out["text_vocab_size"] = int(state["text_embeddings.weight"].shape[0])
    n_head = given.get("n_head", _HEADS_BY_WIDTH.get(int(dim)))
    if n_head is None:
        raise ValueError(f"cannot infer n_head for width {dim} (not an official LlamaGen size): pass n_head=")
    out["n_head"] = n_head
    if "layers.0.attention.wqkv.weight" in state and dim % n_head == 0:
        rows = state["layers.0.attention.wqkv.weight"].shape[0] // (dim // n_head)
        if rows != 3 * n_head and (rows - n_head) % 2 == 0:
            out["n_kv_head"] = (rows - n_head) // 2
    return out


# ----------------------------------------------------------------------------------------------------
# small checks
# ----------------------------------------------------------------------------------------------------


def _check_config(dim: int, n_layer: int, n_head: int, n_kv_head: int | None, model_type: str, cls_token_num: int,
                  block_size: int, vocab_size: int, num_classes: int, text_vocab_size: int | None) -> None:
    for name, value in (("dim", dim), ("n_layer", n_layer), ("n_head", n_head), ("cls_token_num", cls_token_num),
                        ("block_size", block_size), ("vocab_size", vocab_size), ("num_classes", num_classes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dim % n_head or (dim // n_head) % 4:
        raise ValueError(f"dim={dim} must split into n_head={n_head} heads of a size divisible by 4 (2-D RoPE)")
    if n_kv_head is not None and (n_kv_head < 1 or n_head % n_kv_head):
        raise ValueError(f"n_kv_head={n_kv_head} must divide n_head={n_head}")
    if model_type not in ("c2i", "t2i"):
        raise ValueError(f"model_type must be 'c2i' or 't2i', got {model_type!r}")
    if model_type == "c2i" and cls_token_num != 1:
        raise ValueError(f"a c2i model has one class token: cls_token_num must be 1, got {cls_token_num}")
    if int(round(block_size**0.5)) ** 2 != block_size:
        raise ValueError(f"block_size must be a square number of grid tokens (e.g. 16*16), got {block_size}")
    if text_vocab_size is not None and (model_type != "t2i" or text_vocab_size < 1):
        raise ValueError(f"text_vocab_size is for t2i models and must be positive, got {text_vocab_size!r} "
                         f"with model_type={model_type!r}")


def _as_long(ids: Any, name: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of ids")
    return ids.long()


def _check_range(ids: torch.Tensor, size: int, name: str, allow_negative: bool = False) -> None:
    if ids.is_floating_point():
        raise ValueError(f"{name} must be an integer tensor of ids, got {ids.dtype}")
    if checks_enabled() and ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if high >= size or (low < 0 and not allow_negative):
            raise ValueError(f"{name} has ids outside [0, {size}) (min {low}, max {high})")


def _check_drop(drop: torch.Tensor | None, batch: int, has_null: bool) -> torch.Tensor | None:
    if drop is None:
        return None
    if not isinstance(drop, torch.Tensor) or drop.shape != (batch,):
        raise ValueError(f"condition_drop must be a bool tensor [B] = [{batch}]")
    if not has_null and bool(drop.any()):
        raise ValueError("condition_drop needs the null class, but this model has class_dropout_prob=0")
    return drop.bool()
