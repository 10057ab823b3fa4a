"""Entropy-aware and annealed (Cool-SD) relaxed acceptance on discrete AR image models: EAGLE drafts, accepted
with a relaxation that varies per drafted token (:mod:`mmspec.relaxed_rules`).

The pipeline provides what :class:`~mmspec.methods.eagle.EagleConfig` needs, ``codebook_neighbors(k)`` (the
"neighbors" relaxation) and ``transformer.config.block_size`` (the image's tokens, for Cool-SD's schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mmspec.methods.base import (
    BuildRequest,
    MethodPlan,
    check_choice_field,
    check_float_field,
    check_int_field,
    register,
)
from mmspec.methods.eagle import EagleConfig, eagle_drafter
from mmspec.relaxed_rules import RELAXATIONS, CoolRule, EntropyRule, positioned_generate


@dataclass(frozen=True)
class _RelaxedEagleConfig(EagleConfig):
    """EAGLE drafting with a relaxed rule over the codebook's nearest neighbours (or a scaled target mass).

    Attributes (beyond :class:`EagleConfig`'s):
        k: neighbourhood size (None: min(1000, V - 1)); unused with ``relaxation="scaled"``.
        relaxation: "neighbors" (LANTERN++'s relaxed mass: p(x~) plus the nearest neighbours' mass within
            (lam - 1) p(x~)) or "scaled" (lam p(x~), no codebook needed).
    """

    lossless: ClassVar[bool] = False

    k: int | None = None
    relaxation: str = "neighbors"

    def validate(self) -> None:
        super().validate()
        check_int_field(self, "k", 1, optional=True)
        check_choice_field(self, "relaxation", RELAXATIONS)

    def neighbor_table(self, pipeline: Any) -> tuple[torch.Tensor | None, int]:
        """``(neighbors, k)`` for the rule: the pipeline's codebook table, or ``(None, 1)`` when scaled."""
        if self.relaxation == "scaled":
            return None, 1
        vocab = int(pipeline.transformer.config.vocab_size)
        k = min(1000, vocab - 1) if self.k is None else self.k
        if k > vocab - 1:
            raise ValueError(f"{type(self).__name__}.k must be at most the image vocabulary minus one ({vocab - 1}), "
                             f"got {k}")
        return pipeline.codebook_neighbors(k), k


@register("entropy_sd")
@dataclass(frozen=True)
class EntropySDConfig(_RelaxedEagleConfig):
    """Entropy-aware relaxed acceptance (lossy): the relaxation grows with the entropy of the target's
    distribution at each drafted token, lam(H) = 1 + (lam_max - 1) (1 - exp(-H / entropy_scale))
    (:class:`~mmspec.relaxed_rules.EntropyRule`).

    Attributes (beyond :class:`_RelaxedEagleConfig`'s):
        lam_max: the factor approached at high entropy (1: exact sampling).
        entropy_scale: entropy (nats) over which the factor rises.
    """

    lam_max: float = 10.0
    entropy_scale: float = 3.0

    def validate(self) -> None:
        super().validate()
        check_float_field(self, "lam_max", 1.0, 1e6)
        check_float_field(self, "entropy_scale", 0.0, 1e3, low_open=True)

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        neighbors, k = self.neighbor_table(pipeline)
        rule = EntropyRule(neighbors, k=k, greedy=request.greedy, lam_max=self.lam_max, scale=self.entropy_scale)
        return MethodPlan(drafter=eagle_drafter(self, pipeline, request), rule=rule)


@register("cool_sd")
@dataclass(frozen=True)
class CoolSDConfig(_RelaxedEagleConfig):
    """Cool-SD's annealed relaxed acceptance (lossy): the relaxation cools over the image,
    lam(s) = lam_end + (lam_start - lam_end) exp(-decay s) at raster position s in [0, 1]
    (:class:`~mmspec.relaxed_rules.CoolRule`); rejections resample from the TV-optimal residual.

    Attributes (beyond :class:`_RelaxedEagleConfig`'s):
        lam_start: the factor at the image's first token (>= lam_end; 1: exact sampling).
        lam_end: the factor the schedule cools towards (>= 1).
        decay: cooling rate over the image (0: lam_start everywhere, a uniform schedule).
    """

    lam_start: float = 10.0
    lam_end: float = 1.0
    decay: float = 3.0

    def validate(self) -> None:
        super().validate()
        check_float_field(self, "lam_end", 1.0, 1e6)
        check_float_field(self, "lam_start", self.lam_end, 1e6)
        check_float_field(self, "decay", 0.0, 1e3)

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        neighbors, k = self.neighbor_table(pipeline)
        rule = CoolRule(neighbors, k=k, greedy=request.greedy, length=int(pipeline.transformer.config.block_size),
                        lam_start=self.lam_start, lam_end=self.lam_end, decay=self.decay)
        return MethodPlan(drafter=eagle_drafter(self, pipeline, request), rule=rule, loop=positioned_generate)
