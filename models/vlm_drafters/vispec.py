"""ViSpec (arXiv 2509.15235): a vision adaptor compresses each image into a few tokens and a global vector.

**Vision adaptor.** ``num_q`` learnable queries do one non-causal multi-head cross-attention over the input
embeddings ``E [N, d]`` of an image span (what the target's language model read there)::

    [o_1 .. o_{num_q}] = MHA(queries, LN(E), LN(E))

The first ``num_q - 1`` outputs replace the image span in the draft sequence: their embedding part is o_j,
their feature part the target's top features at the span's last ``num_q - 1`` positions, and they take the
position ids of those last image tokens; text keeps its original positions (so the draft sequence has a
gap where the image was). The last output is the image's global vector g.

**Global fusion.** Every text token after the row's first image gets its input feature replaced by
``h' = img_fc([h ; g])`` (``img_fc: Linear(2d, d)`` initialised to ``[I | 0]``, so an untrained adaptor
changes nothing), including every token drafted or committed after the prompt. A row with several images
uses the mean of their g.

**Training** adds the anti-shortcut self-rollout (``mtp_steps = 1``): a second pass feeds the head its own
predicted features in place of the target's and is distilled to the same targets
(:func:`mmspec.models.recipes.vlm_drafter_loss.training_loss`).
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import register_to_config
from torch import nn

from .base import (
    SpanUnits,
    VisualView,
    VLMDraftHead,
    VLMFeatures,
    VLMHeadDrafter,
    check_positive,
    last_positions,
    pack_spans,
)


class VisionAdaptor(nn.Module):
    """``num_queries`` learnable queries, one multi-head cross-attention over a span's input embeddings."""

    def __init__(self, hidden_size: int, num_queries: int, num_heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} must be divisible by adaptor_heads {num_heads}")
        self.queries = nn.Parameter(torch.randn(num_queries, hidden_size) * hidden_size ** -0.5)
        self.norm = nn.LayerNorm(hidden_size, eps=eps)
        self.attention = nn.MultiheadAttention(hidden_size, num_heads, batch_first=True)

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``embeds [S, N, d]`` (real tokens ``mask [S, N]``) -> ``[S, num_queries, d]``."""
        keys = self.norm(embeds)
        queries = self.queries.unsqueeze(0).expand(embeds.shape[0], -1, -1)
        out, _ = self.attention(queries, keys, keys, key_padding_mask=~mask, need_weights=False)
        return out


class ViSpecHead(VLMDraftHead):
    """ViSpec draft model: EAGLE head + vision adaptor + global-feature fusion (``img_fc``).

    Args:
        hidden_size / vocab_size / num_attention_heads / ...: as :class:`~.eagle_vlm.EagleVLMHead`
            (``input_norm`` defaults to False, plain EAGLE).
        num_queries: num_q (ViSpec: 2): ``num_q - 1`` image tokens per image plus the global vector.
        adaptor_heads: heads of the adaptor's cross-attention (default: ``num_attention_heads``).
    """

    default_rollout_steps = 1

    @register_to_config
    def __init__(self, hidden_size: int, vocab_size: int, num_attention_heads: int = 4,
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None,
                 rope_theta: float = 10000.0, input_norm: bool = False, norm_eps: float = 1e-6,
                 max_position_embeddings: int = 4096, num_queries: int = 2, adaptor_heads: int | None = None) -> None:
        super().__init__()
        check_positive(num_queries, "num_queries")
        self._init_head(hidden_size, vocab_size, num_attention_heads, num_key_value_heads, intermediate_size,
                        rope_theta, input_norm, norm_eps, max_position_embeddings)
        self.adaptor = VisionAdaptor(hidden_size, num_queries, adaptor_heads or num_attention_heads, norm_eps)
        self.img_fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        with torch.no_grad():  # [I | 0]: h' = h until trained
            self.img_fc.weight.zero_()
            self.img_fc.weight[:, :hidden_size] = torch.eye(hidden_size)

    def condition_features(self, hidden: torch.Tensor, global_feature: torch.Tensor | None,
                           fuse_global: torch.Tensor | None) -> torch.Tensor:
        """``h' = img_fc([h ; g])`` where ``fuse_global`` (``[B, T]`` or ``[B, 1]``) is True."""
        if global_feature is None:
            return hidden
        if fuse_global is None:
            raise ValueError("ViSpecHead: global_feature needs fuse_global (which slots to fuse)")
        g = global_feature.unsqueeze(1).expand(-1, hidden.shape[1], -1)
        fused = self.img_fc(torch.cat([hidden, g], -1))
        return torch.where(fuse_global.unsqueeze(-1), fused, hidden)

    def visual_view(self, features: VLMFeatures, stochastic: bool = False,
                    generator: torch.Generator | None = None) -> VisualView:
        dtype = self.img_fc.weight.dtype
        batch, width = features.hidden.shape[0], self.config.hidden_size
        embeds, mask = pack_spans(features.inputs_embeds.to(dtype), features.image_spans)
        outputs = self.adaptor(embeds, mask) if embeds.shape[0] else None  # [S, num_q, d]
        tokens = self.config.num_queries - 1
        spans, globals_, index = [], [], 0
        for b, row in enumerate(features.image_spans):
            units, row_globals = [], []
            for start, end in row:
                m = min(tokens, end - start)
                units.append(SpanUnits(outputs[index, :m], features.hidden[b, end - m:end].to(dtype),
                                       last_positions(features, b, (start, end), m)))
                row_globals.append(outputs[index, -1])
                index += 1
            spans.append(units)
            globals_.append(torch.stack(row_globals).mean(0) if row_globals else
                            features.hidden.new_zeros(width, dtype=dtype))
        has_global = torch.tensor([bool(row) for row in features.image_spans], device=features.hidden.device)
        return VisualView(spans, torch.stack(globals_) if batch else None, has_global)


class ViSpecDrafter(VLMHeadDrafter):
    """Chains or EAGLE-2 trees with a :class:`ViSpecHead`:
    ``ViSpecDrafter(model, num_draft_tokens=4, sampling=..., tree=TreeConfig(...) | None, generator=None)``."""

    model_class = ViSpecHead
