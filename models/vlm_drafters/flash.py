"""FLASH (arXiv 2505.12728): latent-aware image compression and a semi-autoregressive head.

1. **Latent-aware compression.** C learnable queries attend over the target's top hidden states at an
   image span ``F [N, d]``::

       A = softmax(C F^T)  [C, N]        F^ = A F  [C, d]        E^ = A E  [C, d]

   The draft sees C units instead of N image tokens (FLASH: 576 -> 64 for LLaVA-1.5): feature part F^,
   embedding part E^ (the same mixture of the embeddings the target read, E), at the positions of the span's
   last C tokens. Spans of at most C tokens are kept as they are.
2. **Semi-autoregressive head.** The EAGLE decoder layer (one causal attention block) is followed by
   ``Linear(d, 4d) - SiLU - Linear(4d, K d)``: each pair predicts K future features
   ``f_{i+1} .. f_{i+K}`` (added to the decoder output, so the first one starts as EAGLE's prediction),
   each read by the frozen LM head. One draft forward proposes K tokens: the root pair (pending token,
   its predecessor's feature) gives ``d_1 .. d_K``. Longer chains feed ``(d_j, f_j)`` and take the next K.

Drafts within a block are drawn independently from their own distributions q_k, which is what the core's
exact verification needs (each draft's q given the accepted prefix). Trees are not implemented (chains
only, as in the paper).
"""

from __future__ import annotations

import math

import torch
from diffusers.configuration_utils import register_to_config
from torch import nn

from mmspec.drafters import TreeConfig
from mmspec.models.eagle import FutureReadout
from mmspec.sampling import SamplingConfig

from .base import (
    SpanUnits,
    VisualView,
    VLMDraftHead,
    VLMFeatures,
    VLMHeadDrafter,
    check_positive,
    identity_units,
    last_positions,
    pack_spans,
)


class LatentCompressor(nn.Module):
    """``F^ = softmax(C F^T) F`` with C learnable queries (``[num_latents, d]``); the same weights mix the
    span's input embeddings."""

    def __init__(self, hidden_size: int, num_latents: int) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(num_latents, hidden_size) / math.sqrt(hidden_size))

    def weights(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``A [S, C, N]`` for spans ``features [S, N, d]`` with real tokens ``mask [S, N]``."""
        scores = torch.einsum("cd,snd->scn", self.queries, features)
        return scores.masked_fill(~mask.unsqueeze(1), float("-inf")).softmax(-1)


class FlashHead(VLMDraftHead):
    """FLASH draft model: EAGLE head + K-future readout + latent compressor.

    Args:
        hidden_size / vocab_size / num_attention_heads / ...: as :class:`~.eagle_vlm.EagleVLMHead`
            (``input_norm`` defaults to False, plain EAGLE).
        num_latents: C, compressed units per image span (FLASH: 64).
        num_future: K, features (tokens) proposed per pair and per draft forward (FLASH: 5).
    """

    @register_to_config
    def __init__(self, hidden_size: int, vocab_size: int, num_attention_heads: int = 4,
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None,
                 rope_theta: float = 10000.0, input_norm: bool = False, norm_eps: float = 1e-6,
                 max_position_embeddings: int = 4096, num_latents: int = 64, num_future: int = 5) -> None:
        super().__init__()
        check_positive(num_latents, "num_latents")
        check_positive(num_future, "num_future")
        self._init_head(hidden_size, vocab_size, num_attention_heads, num_key_value_heads, intermediate_size,
                        rope_theta, input_norm, norm_eps, max_position_embeddings)
        self.compressor = LatentCompressor(hidden_size, num_latents)
        self.future = FutureReadout(hidden_size, num_future)
        self.num_future = num_future

    def readout(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, T, d]`` -> K future features ``[B, T, K, d]``."""
        return self.future(features)

    def visual_view(self, features: VLMFeatures, stochastic: bool = False,
                    generator: torch.Generator | None = None) -> VisualView:
        dtype = self.compressor.queries.dtype
        hidden, mask = pack_spans(features.hidden.to(dtype), features.image_spans)
        embeds, _ = pack_spans(features.inputs_embeds.to(dtype), features.image_spans)
        if hidden.shape[0]:
            weights = self.compressor.weights(hidden, mask)  # [S, C, N]
            latent_features, latent_embeds = weights @ hidden, weights @ embeds
        count = self.config.num_latents
        spans, index = [], 0
        for b, row in enumerate(features.image_spans):
            units = []
            for span in row:
                if span[1] - span[0] <= count:
                    units.append(identity_units(features, b, span, dtype))
                else:
                    units.append(SpanUnits(latent_embeds[index], latent_features[index],
                                           last_positions(features, b, span, count)))
                index += 1
            spans.append(units)
        return VisualView(spans)


class FlashDrafter(VLMHeadDrafter):
    """Semi-autoregressive chains with a :class:`FlashHead`: one draft forward proposes K tokens.

    Args:
        model: a bound :class:`FlashHead`.
        num_draft_tokens: chain length (default K = ``model.config.num_future``: one draft forward per round;
            longer chains take further forwards of K tokens each).
        sampling / generator: as :class:`~.base.VLMHeadDrafter`.
        tree: must be None (FLASH drafts chains; a TreeConfig raises NotImplementedError).
        confidence_threshold: dynamic chain length (:func:`~mmspec.drafters.draft_chain`): a block is cut
            after its first draft that every row's head gave less than this probability, and no further
            forward runs; 0 drafts ``num_draft_tokens``.

    Drafting is :class:`~mmspec.models.eagle.EagleDrafter`'s chain in blocks of K (``num_future``) tokens.
    """

    model_class = FlashHead

    def __init__(self, model: FlashHead, num_draft_tokens: int | None = None,
                 sampling: SamplingConfig = SamplingConfig(do_sample=False), tree: TreeConfig | None = None,
                 generator: torch.Generator | None = None, confidence_threshold: float = 0.0) -> None:
        if tree is not None:
            raise NotImplementedError("FlashDrafter drafts chains only (semi-autoregressive blocks of K tokens); "
                                      "EAGLE-2 trees are not implemented for FLASH: pass tree=None")
        if num_draft_tokens is None and isinstance(model, FlashHead):
            num_draft_tokens = model.config.num_future
        super().__init__(model, num_draft_tokens if num_draft_tokens is not None else 1, sampling, None, generator,
                         confidence_threshold=confidence_threshold)
