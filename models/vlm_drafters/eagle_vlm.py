"""EagleVLM (SpecVLM, arXiv 2509.11815): the EAGLE-2 head with an input norm, reading the full image span.

Every image token of the prompt is a draft unit: the embedding the target's language model read there
(the projected vision feature), the target's top feature there and its position. Text is EAGLE's
``[embed(x_{i+1}) ; h_i]`` pairs. The fused input is RMS-normalised before the fc (``input_norm``), which
SpecVLM adds to EAGLE because vision features and token embeddings have very different scales.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import register_to_config

from .base import VisualView, VLMDraftHead, VLMFeatures, VLMHeadDrafter, identity_units


class EagleVLMHead(VLMDraftHead):
    """EAGLE head + input norm over the full image span (the draft attends to all N image tokens).

    Args:
        hidden_size / vocab_size: the target language model's width and vocabulary (checked by
            :meth:`bind_target`).
        num_attention_heads / num_key_value_heads / intermediate_size / rope_theta / norm_eps /
            max_position_embeddings: the head's decoder layer.
        input_norm: RMS-normalise ``[embed ; feature]`` before the fc (True: EagleVLM).
    """

    @register_to_config
    def __init__(self, hidden_size: int, vocab_size: int, num_attention_heads: int = 4,
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None,
                 rope_theta: float = 10000.0, input_norm: bool = True, norm_eps: float = 1e-6,
                 max_position_embeddings: int = 4096) -> None:
        super().__init__()
        self._init_head(hidden_size, vocab_size, num_attention_heads, num_key_value_heads, intermediate_size,
                        rope_theta, input_norm, norm_eps, max_position_embeddings)

    def visual_view(self, features: VLMFeatures, stochastic: bool = False,
                    generator: torch.Generator | None = None) -> VisualView:
        dtype = self.head.fc.weight.dtype
        return VisualView([[identity_units(features, b, span, dtype) for span in row]
                           for b, row in enumerate(features.image_spans)])


class EagleVLMDrafter(VLMHeadDrafter):
    """Chains or EAGLE-2 trees with an :class:`EagleVLMHead`:
    ``EagleVLMDrafter(model, num_draft_tokens=4, sampling=..., tree=TreeConfig(...) | None, generator=None)``."""

    model_class = EagleVLMHead
