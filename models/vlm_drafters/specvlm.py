"""SpecVLM (arXiv 2509.11815): EagleVLM with an elastic visual compressor chosen per input by a gate.

Each image span (units = the embedding the target read, the target's feature, the position of every image
token, as in EagleVLM) goes through one of five primitives, with ``s = stride``:

* ``prune``: a random subset of ``ceil(N / s)`` tokens, kept in order (fresh at training; a fixed seed at
  inference, so a prompt always gets the same subset);
* ``pool``: mean of every window of s consecutive tokens (raster order);
* ``conv``: a depthwise 1-D convolution with kernel = stride = s (initialised to the window mean);
* ``resampler``: a 1-layer resampler, 2 learnable queries attending over the span
  (``A = softmax(Q (W_k LN(F))^T / sqrt(d))``, units ``A E`` and ``A F``);
* ``text``: the span is dropped (text-only drafting).

A compressed unit takes the position of the last token of its window (resampler: the span's last 2
positions). The gate reads the target's penultimate hidden states (``hidden_states[-2]``) mean-pooled over
the prompt: ``logits = Linear(LN(mean))`` over the five primitives; training draws a hard Gumbel-softmax
sample (straight-through: the chosen units are scaled by the sample's weight, 1 in value, so the gate gets
gradients), inference takes the argmax. The chosen primitive of each row is reported
(``VLMHeadDrafter.view_info["primitive"]``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import register_to_config
from torch import nn

from mmspec.drafters import TreeConfig
from mmspec.sampling import SamplingConfig, first_argmax

from .base import (
    SpanUnits,
    VisualView,
    VLMDraftHead,
    VLMFeatures,
    VLMHeadDrafter,
    check_positive,
    identity_units,
)

PRIMITIVES = ("prune", "pool", "conv", "resampler", "text")


def _windows(values: torch.Tensor, stride: int) -> torch.Tensor:
    """``[N, d]`` -> ``[ceil(N / s), s, d]`` windows (the last one padded by repeating the final token)."""
    count = math.ceil(values.shape[0] / stride)
    pad = count * stride - values.shape[0]
    if pad:
        values = torch.cat([values, values[-1:].expand(pad, -1)], 0)
    return values.reshape(count, stride, values.shape[-1])


def _window_ends(positions: torch.Tensor, stride: int) -> torch.Tensor:
    """Position of the last real token of every window."""
    ends = torch.arange(stride - 1, positions.shape[0] + stride - 1, stride, device=positions.device)
    return positions[ends.clamp(max=positions.shape[0] - 1)]


class ElasticCompressor(nn.Module):
    """SpecVLM's five compression primitives over a span's units (embedding part, feature part, positions)."""

    def __init__(self, hidden_size: int, stride: int, resampler_queries: int, prune_seed: int, eps: float) -> None:
        super().__init__()
        self.stride, self.prune_seed = stride, prune_seed
        self.conv_embeds = nn.Conv1d(hidden_size, hidden_size, stride, stride=stride, groups=hidden_size)
        self.conv_features = nn.Conv1d(hidden_size, hidden_size, stride, stride=stride, groups=hidden_size)
        for conv in (self.conv_embeds, self.conv_features):
            nn.init.constant_(conv.weight, 1.0 / stride)
            nn.init.zeros_(conv.bias)
        self.queries = nn.Parameter(torch.randn(resampler_queries, hidden_size) * hidden_size ** -0.5)
        self.key_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.key = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, primitive: str, units: SpanUnits, stochastic: bool,
                generator: torch.Generator | None = None) -> SpanUnits:
        embeds, features, positions = units.embeds, units.features, units.positions
        n, s = features.shape[0], self.stride
        if primitive == "text":
            return SpanUnits(embeds[:0], features[:0], positions[:0])
        if primitive == "prune":
            keep = math.ceil(n / s)
            source = generator if stochastic else torch.Generator().manual_seed(self.prune_seed + n)
            index = torch.randperm(n, generator=source)[:keep].sort().values.to(features.device)
            return SpanUnits(embeds[index], features[index], positions[index])
        if primitive == "pool":
            return SpanUnits(_windows(embeds, s).mean(1), _windows(features, s).mean(1), _window_ends(positions, s))
        if primitive == "conv":
            def conv(layer: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:  # [N, d] -> [ceil(N/s), d]
                return layer(_windows(x, s).flatten(0, 1).T.unsqueeze(0))[0].T
            return SpanUnits(conv(self.conv_embeds, embeds), conv(self.conv_features, features),
                             _window_ends(positions, s))
        if primitive == "resampler":
            count = min(self.queries.shape[0], n)
            keys = self.key(self.key_norm(features))  # [N, d]
            weights = (self.queries[:count] @ keys.T / math.sqrt(features.shape[-1])).softmax(-1)  # [q, N]
            return SpanUnits(weights @ embeds, weights @ features, positions[n - count:])
        raise ValueError(f"unknown primitive {primitive!r}; expected one of {PRIMITIVES}")


class SpecVLMHead(VLMDraftHead):
    """SpecVLM draft model: EagleVLM head (input norm) + elastic compressor + gate.

    Args:
        hidden_size / vocab_size / num_attention_heads / ...: as :class:`~.eagle_vlm.EagleVLMHead`
            (``input_norm`` defaults to True: EagleVLM).
        stride: compression factor s of pruning, pooling and convolution (units = ceil(N / s)).
        resampler_queries: queries of the resampler primitive (SpecVLM: 2).
        gate_temperature: Gumbel-softmax temperature in training.
        prune_seed: seed of inference-time random pruning.
    """

    @register_to_config
    def __init__(self, hidden_size: int, vocab_size: int, num_attention_heads: int = 4,
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None,
                 rope_theta: float = 10000.0, input_norm: bool = True, norm_eps: float = 1e-6,
                 max_position_embeddings: int = 4096, stride: int = 4, resampler_queries: int = 2,
                 gate_temperature: float = 1.0, prune_seed: int = 0) -> None:
        super().__init__()
        check_positive(stride, "stride")
        check_positive(resampler_queries, "resampler_queries")
        if not gate_temperature > 0:
            raise ValueError(f"gate_temperature must be > 0, got {gate_temperature}")
        self._init_head(hidden_size, vocab_size, num_attention_heads, num_key_value_heads, intermediate_size,
                        rope_theta, input_norm, norm_eps, max_position_embeddings)
        self.compressor = ElasticCompressor(hidden_size, stride, resampler_queries, prune_seed, norm_eps)
        self.gate = nn.Sequential(nn.LayerNorm(hidden_size, eps=norm_eps), nn.Linear(hidden_size, len(PRIMITIVES)))
        self.primitives = PRIMITIVES

    def gate_logits(self, features: VLMFeatures) -> torch.Tensor:
        """``[B, P]`` gate logits from the target's penultimate states mean-pooled over each prompt."""
        if features.penultimate is None:
            raise ValueError("SpecVLM's gate needs the target's penultimate hidden states: use "
                             "VLMRunner(model, return_hidden=True, return_penultimate=True)")
        mask = features.prompt_mask.unsqueeze(-1).to(self.gate[1].weight.dtype)
        pooled = (features.penultimate.to(mask.dtype) * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return self.gate(pooled)

    def choose(self, logits: torch.Tensor, stochastic: bool,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [B], weight [B])``: a hard Gumbel-softmax sample with straight-through weights (training),
        or the argmax with weight 1 (inference)."""
        if not stochastic:
            return first_argmax(logits), torch.ones(logits.shape[0], dtype=logits.dtype, device=logits.device)
        u = torch.rand(logits.shape, generator=generator, dtype=logits.dtype, device="cpu").to(logits.device)
        gumbel = -torch.log(-torch.log(u.clamp(1e-10, 1 - 1e-10)))
        soft = ((logits + gumbel) / self.config.gate_temperature).softmax(-1)
        index = first_argmax(soft)
        hard = F.one_hot(index, logits.shape[-1]).to(soft.dtype)
        weights = hard - soft.detach() + soft  # 1 in value, d soft in gradient
        return index, weights.gather(1, index.unsqueeze(1)).squeeze(1)

    def visual_view(self, features: VLMFeatures, stochastic: bool = False, generator: torch.Generator | None = None,
                    primitive: str | None = None) -> VisualView:
        """Gate, then compress every span of a row with the row's primitive (``primitive``: force one for
        every row, skipping the gate's choice)."""
        if primitive is not None and primitive not in self.primitives:
            raise ValueError(f"primitive must be one of {self.primitives} or None, got {primitive!r}")
        dtype = self.head.fc.weight.dtype
        logits = self.gate_logits(features)
        probs = logits.softmax(-1)
        if primitive is not None:
            index = torch.full((logits.shape[0],), self.primitives.index(primitive), device=logits.device)
            weight = torch.ones(logits.shape[0], dtype=logits.dtype, device=logits.device)
        else:
            index, weight = self.choose(logits, stochastic, generator)
        spans, names = [], []
        for b, row in enumerate(features.image_spans):
            name = self.primitives[int(index[b])]
            names.append(name)
            units = []
            for span in row:
                full = identity_units(features, b, span, dtype)
                out = self.compressor(name, full, stochastic, generator)
                w = weight[b].to(dtype)
                units.append(SpanUnits(out.embeds * w, out.features * w, out.positions))
            spans.append(units)
        return VisualView(spans, info={"primitive": names, "gate_probs": probs, "gate_index": index})

    def visual_cost(self, features: VLMFeatures) -> torch.Tensor:
        """``[B, P]`` fraction of each row's image tokens every primitive keeps (the budget term's cost)."""
        rows = []
        for row in features.image_spans:
            sizes = [e - s for s, e in row]
            total = max(sum(sizes), 1)
            stride, queries = self.config.stride, self.config.resampler_queries
            kept = [sum(math.ceil(n / stride) for n in sizes)] * 3 + [sum(min(queries, n) for n in sizes), 0]
            rows.append([k / total for k in kept])
        return torch.tensor(rows, dtype=torch.float32, device=features.hidden.device)

    def auxiliary_loss(self, view: VisualView, features: VLMFeatures) -> dict[str, torch.Tensor]:
        """``budget``: expected fraction of image tokens kept under the gate's distribution (differentiable),
        called by the training loss :func:`~mmspec.models.recipes.vlm_drafter_loss.training_loss`, which
        weights it by ``budget_weight``."""
        probs = view.info["gate_probs"]
        return {"budget": (probs * self.visual_cost(features).to(probs.dtype)).sum(-1).mean()}


class SpecVLMDrafter(VLMHeadDrafter):
    """Chains or EAGLE-2 trees with a :class:`SpecVLMHead`; the gate picks a primitive per row (argmax).

    ``SpecVLMDrafter(model, num_draft_tokens=4, sampling=..., tree=TreeConfig(...) | None, generator=None,
    confidence_threshold=0.0, primitive=None)``: ``primitive`` forces one of ``PRIMITIVES`` for every row (ablations, benchmarks).
    The chosen primitives are in ``view_info["primitive"]`` after each prefill. Needs
    ``VLMRunner(model, return_hidden=True, return_penultimate=True)``.
    """

    model_class = SpecVLMHead

    def __init__(self, model: SpecVLMHead, num_draft_tokens: int = 4,
                 sampling: SamplingConfig = SamplingConfig(do_sample=False), tree: TreeConfig | None = None,
                 generator: torch.Generator | None = None, confidence_threshold: float = 0.0,
                 primitive: str | None = None) -> None:
        if primitive is not None and primitive not in PRIMITIVES:
            raise ValueError(f"primitive must be one of {PRIMITIVES} or None, got {primitive!r}")
        super().__init__(model, num_draft_tokens, sampling, tree, generator, confidence_threshold)
        self.primitive = primitive

    def visual_view(self, features: VLMFeatures) -> VisualView:
        return self.model.visual_view(features, stochastic=False, primitive=self.primitive)
