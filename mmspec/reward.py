"""Reward-routed block acceptance for speculative video generation (SDVG, arXiv 2604.17397).

A drafter generates a block of frames; a reward model scores every frame; the block's score is the
worst frame (``aggregate="min"``) or the mean; the block is accepted iff its score >= tau, otherwise
the target regenerates it. The first block is always the target's when ``force_reject_first`` (it
anchors the scene). tau = +inf reproduces target-only generation, tau = -inf draft-only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

RewardFn = Callable[[Any, Any], Any]  # (frames, prompt) -> per-frame scores


@dataclass
class RouteDecision:
    """Outcome for one block of a batch.

    Attributes:
        accept: bool ``[B]``.
        score: ``[B]`` aggregated block reward (NaN where the block was not scored).
        frame_rewards: ``[B, F]`` per-frame rewards (NaN where not scored).
    """

    accept: torch.Tensor
    score: torch.Tensor
    frame_rewards: torch.Tensor


class RewardRouter:
    """Decide per block whether the drafter's frames are good enough to keep.

    Args:
        reward_fn: ``(frames, prompt) -> scores`` with one score per frame: ``[F]`` for a single clip
            or ``[B, F]`` for a batch (tensor, array or nested list).
        tau: acceptance threshold, a real number (may be +-inf, not NaN).
        aggregate: "min" (worst frame, the paper's choice) or "mean".
        force_reject_first: block 0 always goes to the target.
    """

    def __init__(self, reward_fn: RewardFn, tau: float, aggregate: str = "min",
                 force_reject_first: bool = True) -> None:
        if not callable(reward_fn):
            raise ValueError(f"reward_fn must be callable (frames, prompt) -> per-frame scores, got {reward_fn!r}")
        check_aggregate(aggregate)
        if not isinstance(force_reject_first, bool):
            raise ValueError(f"force_reject_first must be True or False, got {force_reject_first!r}")
        self.reward_fn, self.tau, self.aggregate = reward_fn, check_tau(tau), aggregate
        self.force_reject_first = force_reject_first

    def skips_scoring(self, block_index: int) -> bool:
        """True when the decision is known without calling the reward model."""
        return (self.force_reject_first and block_index == 0) or math.isinf(self.tau)

    def __call__(self, frames: Any, prompt: Any, block_index: int, num_frames: int,
                 batch_size: int = 1) -> RouteDecision:
        """Route one block. ``num_frames``/``batch_size`` say how many scores ``reward_fn`` must return."""
        nan = torch.full((batch_size, num_frames), float("nan"))
        if self.force_reject_first and block_index == 0:
            return RouteDecision(torch.zeros(batch_size, dtype=torch.bool), nan[:, 0], nan)
        if math.isinf(self.tau):
            accept = torch.full((batch_size,), self.tau < 0, dtype=torch.bool)
            return RouteDecision(accept, nan[:, 0], nan)
        rewards = torch.as_tensor(self.reward_fn(frames, prompt), dtype=torch.float64)
        if rewards.ndim == 1 and batch_size == 1:
            rewards = rewards.unsqueeze(0)
        if tuple(rewards.shape) != (batch_size, num_frames):
            raise ValueError(f"reward_fn returned scores of shape {tuple(rewards.shape)}; expected one per frame: "
                             f"[{batch_size}, {num_frames}]" + (f" or [{num_frames}]" if batch_size == 1 else ""))
        if torch.isnan(rewards).any():
            raise ValueError("reward_fn returned NaN scores")
        score = aggregate_frame_rewards(rewards, self.aggregate)
        return RouteDecision(score >= self.tau, score, rewards)


AGGREGATES = ("min", "mean")  # how a block's frame rewards combine into its score


def check_tau(tau: Any) -> float:
    """``tau`` as a float: a real number (+-inf allowed); NaN, booleans, strings and tensors are refused
    with a ValueError naming ``tau``."""
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real):
        raise ValueError(f"tau must be a real number (or +-inf), got {type(tau).__name__} {tau!r}")
    if math.isnan(tau):
        raise ValueError("tau must be a real number (or +-inf), got NaN")
    return float(tau)


def check_aggregate(aggregate: Any) -> None:
    """``aggregate`` names one of :data:`AGGREGATES`."""
    if not isinstance(aggregate, str) or aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {', '.join(map(repr, AGGREGATES))}, got {aggregate!r}")


def aggregate_frame_rewards(frame_rewards: torch.Tensor, aggregate: str) -> torch.Tensor:
    """A block's score from its frames' rewards ``[..., F]``: the worst frame (``"min"``) or the mean."""
    check_aggregate(aggregate)
    return frame_rewards.min(-1).values if aggregate == "min" else frame_rewards.mean(-1)
