"""Speculative Jacobi decoding (SJD) and Grouped Speculative Decoding (GSD): training-free drafting in which
the target refines a window of draft slots itself; GSD accepts a draft when the target's mass on a group
of tokens around it is large enough.

The pipeline provides the transformer (its ``config.vocab_size``) and ``codebook_embeddings()`` (GSD's
embedding distances; None skips that filter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

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
from mmspec.rules import GroupedRule


@register("sjd")
@dataclass(frozen=True)
class SJDConfig(MethodConfig):
    """Speculative Jacobi decoding (lossless).

    Attributes:
        window: draft slots verified per round (the paper uses 16 for images).
        init: how fresh slots are filled: "random" (uniform tokens) or "left" (a copy of the slot before).
    """

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


@register("gsd")
@dataclass(frozen=True)
class GSDConfig(SJDConfig):
    """GSD: Jacobi drafts accepted by group mass (lossy).

    Attributes (beyond :class:`SJDConfig`'s):
        group_size: G, the draft and its G - 1 neighbours in the target's probability ranking.
        prob_threshold: a neighbour y joins the group only if |p(y) - p(draft)| is below this (1.0: no filter).
        distance_threshold: ... and its codebook embedding lies closer than this to the draft's (inf: no filter).
    """

    group_size: int = 10
    prob_threshold: float = 0.15
    distance_threshold: float = math.inf

    def validate(self) -> None:
        super().validate()
        check_int_field(self, "group_size", 1, 4096)
        check_float_field(self, "prob_threshold", 0.0, 1.0, low_open=True)
        check_float_field(self, "distance_threshold", 0.0, math.inf, low_open=True, allow_inf=True)

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        rule = GroupedRule(G=self.group_size, prob_threshold=self.prob_threshold,
                           embeddings=pipeline.codebook_embeddings(), distance_threshold=self.distance_threshold,
                           greedy=request.greedy)
        return MethodPlan(drafter=self.drafter(pipeline, request), rule=rule)
