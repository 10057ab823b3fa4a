"""Speculative Jacobi decoding (SJD) and Grouped Speculative Decoding (GSD): training-free drafting in which
the target refines a window of draft slots itself; GSD accepts a draft when the target's mass on a group
of tokens around it is large enough.

The pipeline provides the transformer (its ``config.vocab_size``; its ``get_input_embeddings()`` for GSD's
distance filter in the language model's input-embedding space) and ``codebook_embeddings()`` (the filter in
the tokenizer's codebook space; None skips it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mmspec.drafters import JacobiDrafter
from mmspec.methods.base import (
    BuildRequest,
    MethodConfig,
    MethodPlan,
    check_choice_field,
    check_float_field,
    check_int_field,
    register,
)
from mmspec.rules import GROUP_WINDOWS, GroupedRule


@register("sjd")
@dataclass(frozen=True)
class SJDConfig(MethodConfig):
    """Speculative Jacobi decoding (lossless).

    Attributes:
        window: draft slots verified per round (the paper uses 16 for images).
        init: how fresh slots are filled: "random" (uniform tokens) or "left" (a copy of the slot before).
    """

    lossless: ClassVar[bool] = True

    pipelines: ClassVar[tuple[str, ...]] = ("ar_image",)

    window: int = 16
    init: str = "random"

    def validate(self) -> None:
        check_int_field(self, "window", 1, 1024)
        check_choice_field(self, "init", ("random", "left"))

    def drafter(self, pipeline: Any, request: BuildRequest) -> JacobiDrafter:
        return JacobiDrafter(int(pipeline.transformer.config.vocab_size), window=self.window,
                             sampling=request.sampling, init=self.init, generator=request.generator)

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        return MethodPlan(drafter=self.drafter(pipeline, request))


#: Where GSD's embedding-distance filter measures: the tokenizer's codebook vectors or the language model's
#: input embeddings of the image tokens (the released code's space).
DISTANCE_SPACES = ("codebook", "input_embeddings")


@register("gsd")
@dataclass(frozen=True)
class GSDConfig(SJDConfig):
    """GSD: Jacobi drafts accepted by group mass (lossy).

    Attributes (beyond :class:`SJDConfig`'s):
        group_size: G, the draft and its G - 1 neighbours in the target's probability ranking.
        prob_threshold: a neighbour y joins the group only if |p(y) - p(draft)| is below this (1.0: no filter).
        distance_threshold: ... and its embedding lies closer than this to the draft's (inf: no filter).
        group_window: "symmetric" (default) or "official", the released code's mirror-image window with its
            fallback to plain min(1, p/q) near the bottom of the ranking (see :class:`~mmspec.rules.GroupedRule`).
        distance_space: the embeddings ``distance_threshold`` measures in: "codebook" (the tokenizer's
            codebook vectors) or "input_embeddings" (the transformer's input embedding of each token).

    The released code's settings: ``group_size=14, prob_threshold=0.15, group_window="official",
    distance_space="input_embeddings", distance_threshold=math.sqrt(0.5)`` (it thresholds squared distances
    at 0.5).
    """

    lossless: ClassVar[bool] = False

    group_size: int = 10
    prob_threshold: float = 0.15
    distance_threshold: float = math.inf
    group_window: str = "symmetric"
    distance_space: str = "codebook"

    def validate(self) -> None:
        super().validate()
        check_int_field(self, "group_size", 1, 4096)
        check_float_field(self, "prob_threshold", 0.0, 1.0, low_open=True)
        check_float_field(self, "distance_threshold", 0.0, math.inf, low_open=True, allow_inf=True)
        check_choice_field(self, "group_window", GROUP_WINDOWS)
        check_choice_field(self, "distance_space", DISTANCE_SPACES)

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        rule = GroupedRule(G=self.group_size, prob_threshold=self.prob_threshold,
                           embeddings=self.distance_embeddings(pipeline), distance_threshold=self.distance_threshold,
                           greedy=request.greedy, window=self.group_window)
        return MethodPlan(drafter=self.drafter(pipeline, request), rule=rule)

    def distance_embeddings(self, pipeline: Any) -> torch.Tensor | None:
        """The ``[V, D]`` table the distance filter measures in, or None when there is no filter (an infinite
        ``distance_threshold``) or, in codebook space, the tokenizer exposes no codebook."""
        if math.isinf(self.distance_threshold):
            return None
        if self.distance_space == "codebook":
            return pipeline.codebook_embeddings()
        return input_embedding_table(pipeline.transformer)


def input_embedding_table(transformer: Any) -> torch.Tensor:
    """The transformer's input embedding of every token of its vocabulary, ``[V, D]`` (the embedding
    module applied to ``0 .. V-1``, so modules that project a table, like Janus' image embedding, count)."""
    get = getattr(transformer, "get_input_embeddings", None)
    if get is None:
        raise ValueError(f"GSDConfig.distance_space='input_embeddings' needs a transformer with "
                         f"get_input_embeddings(); {type(transformer).__name__} has none")
    module = get()
    vocab = int(transformer.config.vocab_size)
    weight = getattr(module, "weight", None)
    if isinstance(module, torch.nn.Embedding) and weight is not None and weight.shape[0] == vocab:
        return weight.detach()
    device = next(module.parameters()).device
    with torch.no_grad():
        return module(torch.arange(vocab, device=device)).detach()
