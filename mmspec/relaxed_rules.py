"""Relaxed acceptance whose strength varies per drafted token: entropy-aware and annealed (Cool-SD) rules.

Both rules relax the target mass of a drafted token x~ by a factor lam >= 1 that is set per token, and
otherwise share LANTERN++'s form (:class:`~mmspec.rules.LanternRule` with ``lam``): the relaxed mass is
p(x~) + c_J, where c_J is the longest distance-ordered prefix of x~'s k nearest codebook neighbours whose
target mass stays within (lam - 1) p(x~); without a neighbour table ("scaled" relaxation) it is lam p(x~)
itself, which needs nothing from the tokenizer. lam = 1 everywhere is exact speculative sampling.

* :class:`EntropyRule` (entropy-aware acceptance, Ma et al., arXiv 2510.09012): lam grows with the entropy H
  of the target's distribution at the draft's position, lam(H) = 1 + (lam_max - 1) (1 - exp(-H / scale)).
  High-entropy positions are where many codes are interchangeable (flat textures, background) and where
  exact acceptance rejects most drafts; confident positions (edges, object structure) stay near exact.
* :class:`CoolRule` (Cool-SD, Li et al., arXiv 2601.09212): lam follows an annealed schedule over the image,
  lam(s) = lam_end + (lam_start - lam_end) exp(-decay s) at the draft's raster position s in [0, 1]:
  relaxed early, cooling towards ``lam_end`` as the image fills in.

Residual. Cool-SD's TV analysis of relaxed speculative sampling (accept y ~ q with probability a(y), else
draw from r) gives the output distribution q a + (1 - sum q a) r, whose TV distance to p is smallest for
r = norm(max(0, p - q a)) (:func:`tv_optimal_residual`). For every rule whose acceptance is at least the
exact min(1, p/q), as here, that is norm(max(0, p - q)): the exact residual, which both rules use.

Positions. The rules' interface is :class:`~mmspec.rules.AcceptanceRule`'s; they set ``uses_depths``, so
verification calls their :meth:`~mmspec.rules.AcceptanceRule.masses_at` with each token's depth in the
round's draft (1: the token right after the pending one). A depth becomes an image position through an
:class:`ImagePositions` counter that :func:`positioned_generate` advances after every round.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from mmspec.rules import (
    RESIDUAL_EPS,
    AcceptanceRule,
    _check_neighbors,
    _neighbor_mass,
    check_rule_inputs,
    exact_residual,
    gather_token,
)

#: How the relaxed mass is formed: over the codebook neighbours (LANTERN++) or by scaling p(x~) itself.
RELAXATIONS = ("neighbors", "scaled")


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each distribution ``[..., V]`` -> ``[...]`` (0 log 0 = 0)."""
    return -torch.special.xlogy(probs, probs).sum(-1)


def tv_optimal_residual(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, tokens: torch.Tensor,
                        acceptance: torch.Tensor) -> torch.Tensor:
    """Unnormalised norm(max(0, p - q a)), the resampling distribution that minimises the TV distance between
    relaxed speculative sampling and p, given the acceptance probability ``a [..., V]`` of every token
    (q a point mass at ``tokens`` when ``draft_probs`` is None). Where it has no mass, p itself."""
    check_rule_inputs(target_probs, draft_probs)
    q = torch.zeros_like(target_probs).scatter_(-1, tokens.unsqueeze(-1), 1.0) if draft_probs is None \
        else draft_probs
    residual = (target_probs - q * acceptance).clamp_min(0)
    empty = residual.sum(-1, keepdim=True) <= RESIDUAL_EPS
    return torch.where(empty, target_probs, residual)


class ImagePositions:
    """Per row of a decoding call, how many tokens it has generated: the raster position of its next draft.

    A :class:`CoolRule` reads it to place each drafted token in the image; :func:`positioned_generate` resets
    it at the start of a call and advances it by the tokens every round committed.
    """

    def __init__(self) -> None:
        self.offsets: torch.Tensor | None = None

    def reset(self) -> None:
        self.offsets = None

    def advance(self, new_tokens: torch.Tensor) -> None:
        """Count a round's ``new_tokens [B, M]`` (-1 pads what a row did not take)."""
        counts = (new_tokens >= 0).sum(-1)
        self.offsets = counts if self.offsets is None else self.offsets + counts.to(self.offsets.device)

    def positions(self, depths: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Raster positions of tokens shaped like ``like [B, ...]`` at draft ``depths`` (broadcastable to it)."""
        if self.offsets is None:
            raise ValueError("the rule needs each draft's image position, and no decoding round has been counted: "
                             "run it through mmspec.relaxed_rules.positioned_generate (method='cool_sd' does)")
        if self.offsets.shape[0] != like.shape[0]:
            raise ValueError(f"ImagePositions counts {self.offsets.shape[0]} rows but the drafts have {like.shape[0]}")
        offsets = self.offsets.to(like.device).reshape(-1, *([1] * (like.ndim - 1)))
        return offsets + depths.to(like.device) - 1


class DepthAwareRule(AcceptanceRule):
    """A rule whose acceptance depends on where each draft lands: verification calls :meth:`masses_at` with
    each token's depth in the round's draft instead of :meth:`masses`."""

    uses_depths: ClassVar[bool] = True

    def masses_at(self, target_probs: torch.Tensor, draft_probs: torch.Tensor | None, tokens: torch.Tensor,
                  depths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(target_mass, draft_mass)`` like :meth:`masses`; ``depths`` (broadcastable to ``tokens``) counts
        from 1, the token right after the round's pending one."""
        raise NotImplementedError


@dataclass(frozen=True)
class _ScheduledRule(DepthAwareRule):
    """Shared part of the relaxed rules: the relaxed mass for a per-token factor, acceptance and residual.
    Subclasses implement :meth:`factors`."""

    neighbors: torch.Tensor | None = field(default=None, repr=False)
    k: int = 1000
    greedy: bool = False

    def _check_relaxation(self) -> None:
        if self.neighbors is not None:
            _check_neighbors(self.neighbors, self.k)

    def check_vocab(self, vocab_size: int) -> None:
        if self.neighbors is not None and self.neighbors.shape[0] != vocab_size:
            raise ValueError(f"{type(self).__name__} neighbors cover {self.neighbors.shape[0]} tokens but the target "
                             f"vocabulary has {vocab_size}")

    def factors(self, target_probs: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor | None) -> torch.Tensor:
        """The relaxation factor lam >= 1 of every token ``[...]``."""
        raise NotImplementedError

    def relaxed_mass(self, target_probs: torch.Tensor, tokens: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """p(x~) + c_J with the neighbourhood budget (lam - 1) p(x~), or lam p(x~) without a neighbour table."""
        p = gather_token(target_probs, tokens)
        if self.neighbors is None:
            return lam * p
        return p + _neighbor_mass(target_probs, tokens, self.neighbors, self.k, (lam - 1.0) * p)[1]

    def masses_at(self, target_probs, draft_probs, tokens, depths):
        check_rule_inputs(target_probs, draft_probs)
        relaxed = self.relaxed_mass(target_probs, tokens, self.factors(target_probs, tokens, depths))
        if self.greedy:  # accept while the relaxed mass makes x~ the argmax
            is_max = (relaxed >= target_probs.amax(-1)).to(relaxed.dtype)
            return is_max, torch.ones_like(is_max)
        q = torch.ones_like(relaxed) if draft_probs is None else gather_token(draft_probs, tokens)
        return relaxed, q

    def residual(self, target_probs, draft_probs, tokens):
        check_rule_inputs(target_probs, draft_probs)
        if self.greedy:
            return target_probs
        return exact_residual(target_probs, draft_probs, tokens)  # the TV-optimal one (module docstring)


@dataclass(frozen=True)
class EntropyRule(_ScheduledRule):
    """Entropy-aware relaxed acceptance (arXiv 2510.09012): lam(H) = 1 + (lam_max - 1) (1 - exp(-H / scale)),
    H the entropy (nats) of the target's distribution judged at the draft's position.

    Args:
        neighbors: ``[V, k_max]`` nearest other codebook entries per token (see :class:`~mmspec.rules.LanternRule`),
            or None to scale p(x~) itself.
        k: neighbours used (<= k_max).
        lam_max: the factor approached at high entropy (>= 1; 1: exact sampling).
        scale: entropy (nats) over which the factor rises (> 0); the released code's temperature mapping
            uses 3 nats for its exp(-H / 3).
        greedy: greedy decoding: accept while the relaxed mass makes x~ the argmax.
    """

    lam_max: float = 10.0
    scale: float = 3.0

    def __post_init__(self) -> None:
        self._check_relaxation()
        if not (math.isfinite(self.lam_max) and self.lam_max >= 1.0):
            raise ValueError(f"lam_max must be a finite number >= 1, got {self.lam_max}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {self.scale}")

    def factors(self, target_probs, tokens, depths):
        h = entropy(target_probs)
        if tokens.ndim > h.ndim:  # several tokens judged against one distribution
            h = h.unsqueeze(-1)
        return (1.0 + (self.lam_max - 1.0) * -torch.expm1(-h / self.scale)).expand(tokens.shape)

    def masses(self, target_probs, draft_probs, tokens):
        return self.masses_at(target_probs, draft_probs, tokens, None)  # entropy needs no position


@dataclass(frozen=True)
class CoolRule(_ScheduledRule):
    """Cool-SD's annealed relaxed acceptance (arXiv 2601.09212): lam(s) = lam_end + (lam_start - lam_end)
    exp(-decay s) at raster position s = t / (length - 1) of the drafted token t.

    Args:
        neighbors, k, greedy: as :class:`EntropyRule`.
        length: image tokens per row (the raster positions are 0 .. length - 1).
        lam_start: the factor at the first token (>= lam_end; 1: exact sampling everywhere).
        lam_end: the factor the schedule cools towards (>= 1).
        decay: how fast it cools (>= 0; 0: lam_start everywhere, a uniform schedule).
        positions: the per-row counter :func:`positioned_generate` advances (each call of a method builds one).
    """

    length: int = 256
    lam_start: float = 10.0
    lam_end: float = 1.0
    decay: float = 3.0
    positions: ImagePositions = field(default_factory=ImagePositions, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_relaxation()
        if not isinstance(self.length, int) or isinstance(self.length, bool) or self.length < 1:
            raise ValueError(f"length must be a positive integer, got {self.length!r}")
        if not (math.isfinite(self.lam_end) and self.lam_end >= 1.0):
            raise ValueError(f"lam_end must be a finite number >= 1, got {self.lam_end}")
        if not (math.isfinite(self.lam_start) and self.lam_start >= self.lam_end):
            raise ValueError(f"lam_start must be a finite number >= lam_end ({self.lam_end}), got {self.lam_start}")
        if not (math.isfinite(self.decay) and self.decay >= 0):
            raise ValueError(f"decay must be a finite number >= 0, got {self.decay}")

    def schedule(self, positions: torch.Tensor) -> torch.Tensor:
        """lam at raster ``positions`` (any shape; positions past the image count as its last token)."""
        s = (positions.to(torch.float64) / max(self.length - 1, 1)).clamp(0.0, 1.0)
        return self.lam_end + (self.lam_start - self.lam_end) * torch.exp(-self.decay * s)

    def factors(self, target_probs, tokens, depths):
        if depths is None:
            raise ValueError("CoolRule needs each draft's depth in the round (verification passes it through "
                             "masses_at); a loop that calls masses() directly cannot place drafts in the image")
        lam = self.schedule(self.positions.positions(depths, tokens))
        return lam.to(target_probs.dtype).expand(tokens.shape)

    def masses(self, target_probs, draft_probs, tokens):
        return self.masses_at(target_probs, draft_probs, tokens, None)  # raises: positions are needed


def positioned_generate(target: Any, drafter: Any, input_ids: torch.Tensor | None,
                        attention_mask: torch.Tensor | None = None, *, rule: AcceptanceRule | None = None,
                        callback: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                        **kwargs: Any) -> Any:
    """:func:`~mmspec.speculate.speculative_generate` that keeps a :class:`CoolRule`'s image positions: reset
    at the start, advanced by every round's committed tokens (the streaming callback still gets them)."""
    from mmspec.speculate import speculative_generate

    positions = rule.positions if isinstance(rule, CoolRule) else None
    if positions is None:
        return speculative_generate(target, drafter, input_ids, attention_mask, rule=rule, callback=callback,
                                    **kwargs)
    positions.reset()

    def on_round(new_tokens: torch.Tensor, drafted: torch.Tensor) -> None:
        positions.advance(new_tokens)
        if callback is not None:
            callback(new_tokens, drafted)

    try:
        return speculative_generate(target, drafter, input_ids, attention_mask, rule=rule, callback=on_round,
                                    **kwargs)
    finally:
        positions.reset()
