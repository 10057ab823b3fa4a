"""SDVG and draft-only decoding on block-causal video models.

``"sdvg"`` (:class:`SDVGConfig`): the drafter proposes each block, a reward model scores its decoded frames,
the core's :class:`~mmspec.reward.RewardRouter` aggregates them (worst frame by default) and keeps the block
iff the score reaches tau; the target regenerates rejected blocks (lossy, like SDVG itself).
``"draft"`` (:class:`DraftConfig`): the drafter makes every block (the quality floor).

Both run the core's block loop :func:`~mmspec.video_blocks.generate_blocks`; the pipeline provides
``drafter``, ``draft_settings(steps, guidance)`` (its saved drafter defaults) and ``get_reward(name, kwargs)``
(reward scorers built once per pipeline).

Rewards: "shapes" (the shapes world's exact per-frame score,
:class:`~mmspec.models.rewards.ShapesFrameReward`), "imagereward" and "clip" (the evaluation scorers, imported
lazily by :func:`resolve_reward`; they need local weights given in ``reward_kwargs``), or any callable
``(frames [F, 3, H, W] in [0, 1], prompt) -> F scores``. A callable works in a config passed to a call; a
stored settings file names its reward.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch

from mmspec.methods.base import (
    BuildRequest,
    MethodConfig,
    MethodPlan,
    check_bool_field,
    check_choice_field,
    check_float_field,
    check_int_field,
    register,
)
from mmspec.reward import AGGREGATES, RewardRouter
from mmspec.validation import check_guidance_scale

REWARDS = ("shapes", "imagereward", "clip")
#: the most drafter steps a config accepts (a drafter is meant to take fewer steps than the target)
MAX_DRAFT_STEPS = 1000


@dataclass(frozen=True)
class DrafterSampling(MethodConfig):
    """How the drafter samples its blocks (the base of the video methods that draft).

    Attributes:
        draft_num_inference_steps: the drafter's denoising steps per block, evenly spaced from 1000 and at most
            the target's; it starts from the block's shared noise. None: the pipeline's saved
            ``draft_num_inference_steps``, else the target's timesteps. A reflow-distilled drafter drafts in 1.
        draft_guidance_scale: the drafter's classifier-free guidance. None: the pipeline's saved
            ``draft_guidance_scale``, else the target's (the call's ``guidance_scale``).
    """

    pipelines: ClassVar[tuple[str, ...]] = ("video",)

    draft_num_inference_steps: int | None = None
    draft_guidance_scale: float | None = None

    def validate(self) -> None:
        check_int_field(self, "draft_num_inference_steps", 1, MAX_DRAFT_STEPS, optional=True)
        if self.draft_guidance_scale is not None:
            check_guidance_scale(self.draft_guidance_scale, f"{type(self).__name__}.draft_guidance_scale")

    def block_drafter(self, pipeline: Any) -> Any:
        """The pipeline's drafter with this config's sampling (the pipeline's saved defaults for None)."""
        from mmspec.video_blocks import VideoDrafter

        if pipeline.drafter is None:
            raise ValueError(f"method={self.name!r} needs a drafter; this pipeline has none")
        steps, scale = pipeline.draft_settings(self.draft_num_inference_steps, self.draft_guidance_scale)
        return VideoDrafter(pipeline.drafter, steps, scale)


@register("draft")
@dataclass(frozen=True)
class DraftConfig(DrafterSampling):
    """Draft-only video: the drafter makes every block, the target never runs (the quality floor)."""

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        return MethodPlan(drafter=self.block_drafter(pipeline))  # the default loop: a drafter, no router


@register("sdvg")
@dataclass(frozen=True)
class SDVGConfig(DrafterSampling):
    """SDVG: reward-routed drafted blocks (lossy: an accepted block is the drafter's).

    Attributes (beyond :class:`DrafterSampling`'s):
        tau: the threshold on a block's aggregated reward (+inf: every block the target's, exactly target-only;
            -inf: every drafted block accepted).
        reward: "shapes", "imagereward", "clip" or a callable ``(frames [F, 3, H, W] in [0, 1], prompt) ->
            F scores`` (a callable cannot be stored in a settings file).
        reward_kwargs: settings of a named reward (``{"mode": "match"}`` for "shapes"; local weight files for
            "imagereward" and "clip", see :func:`resolve_reward`); None: none.
        aggregate: "min" (the worst frame, the paper's) or "mean" over a block's frames.
        force_reject_first: block 0 is always the target's (SDVG's scene anchor; not with a context).
        refine_rejected_from: None (SDVG's rule): the target regenerates a rejected block from its noise, all
            its steps. One of the target's timesteps below the first (750 of 1000/750/500/250): the target
            refines the rejected draft instead, SDEdit-style, from the draft noised to that timestep along its
            path to the block's noise (750: 3 of 4 passes). It must be one of the call's timesteps.
        lazy_target_cache: write accepted blocks into the target's cache inside its next denoising pass
            (False: by a pass of their own right after each block, the paper's description).
    """

    tau: float = 0.0
    reward: str | Callable = "shapes"
    reward_kwargs: Mapping[str, Any] | None = None
    aggregate: str = "min"
    force_reject_first: bool = True
    refine_rejected_from: float | None = None
    lazy_target_cache: bool = True

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        if isinstance(self.tau, bool) or not isinstance(self.tau, numbers.Real):
            raise ValueError(f"{name}.tau must be a number (or +-inf), got {self.tau!r}")
        if self.tau != self.tau:
            raise ValueError(f"{name}.tau must be a number or +-inf, got NaN")
        if not (callable(self.reward) and not isinstance(self.reward, str)) and self.reward not in REWARDS:
            raise ValueError(f"{name}.reward must be one of {list(REWARDS)} or a callable (frames, prompt) -> "
                             f"per-frame scores, got {self.reward!r}")
        if self.reward_kwargs is not None:
            if not isinstance(self.reward_kwargs, Mapping) or not all(isinstance(k, str) for k in self.reward_kwargs):
                raise ValueError(f"{name}.reward_kwargs must be None or a mapping of setting names to values, got "
                                 f"{self.reward_kwargs!r}")
            if self.reward_kwargs and not isinstance(self.reward, str):
                raise ValueError(f"{name}.reward_kwargs {sorted(self.reward_kwargs)} only apply to named rewards, "
                                 "not to a callable")
        check_choice_field(self, "aggregate", AGGREGATES)
        check_bool_field(self, "force_reject_first")
        check_float_field(self, "refine_rejected_from", 0.0, 1000.0, low_open=True, optional=True)
        check_bool_field(self, "lazy_target_cache")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "") -> SDVGConfig:
        """Plain values (a settings file): the reward is a name there, never a callable."""
        reward = values.get("reward", "shapes")
        if not isinstance(reward, str):
            where = f" in {source}" if source else ""
            raise ValueError(f"{cls.__name__}.reward{where} must be a reward name {list(REWARDS)}: stored settings "
                             f"name their reward; pass a callable in a config (method={cls.__name__}(reward=fn)), "
                             f"got {reward!r}")
        return super().from_dict(values, source=source)

    def to_dict(self) -> dict[str, Any]:
        """Plain values; a callable reward has none (a settings file stores reward names only)."""
        if not isinstance(self.reward, str):
            raise ValueError(f"{type(self).__name__}.reward is a callable ({_reward_name(self.reward)}), which a "
                             f"settings file cannot store: store a reward name {list(REWARDS)} and pass the callable "
                             "in the config of a call")
        values = super().to_dict()
        values["reward_kwargs"] = None if self.reward_kwargs is None else dict(self.reward_kwargs)
        return values

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        from mmspec.video_blocks import generate_blocks

        drafter = self.block_drafter(pipeline)
        reward = BatchReward(pipeline.get_reward(self.reward, self.reward_kwargs), _reward_name(self.reward))
        router = RewardRouter(reward, float(self.tau), self.aggregate, self.force_reject_first)
        loop = partial(generate_blocks, router=router, refine_rejected_from=self.refine_rejected_from,
                       lazy_target_cache=self.lazy_target_cache)
        return MethodPlan(drafter=drafter, loop=loop)


def _reward_name(reward: str | Callable) -> str:
    return getattr(reward, "__name__", repr(reward))


def resolve_reward(reward: str | Callable, **reward_kwargs: Any) -> Callable:
    """A per-frame reward callable from a name or a callable.

    * ``"shapes"``: :class:`~mmspec.models.rewards.ShapesFrameReward` (kwargs: ``mode``);
    * ``"imagereward"``: ``mmspec.evaluation.imagereward.ImageRewardScorer`` (kwargs: ``weights``,
      ``med_config``, ``tokenizer``, optional ``device``, ``vision``, ``image_size``), imported here, lazily;
    * ``"clip"``: ``mmspec.evaluation.clip_score.CLIPScorer`` (kwargs: ``model``, ``pretrained``, optional
      ``device``, ``image_size``), imported here, lazily;
    * a callable: returned as is (``reward_kwargs`` must be empty).
    """
    from mmspec.models.rewards import ScorerFrameReward, ShapesFrameReward

    if callable(reward) and not isinstance(reward, str):
        if reward_kwargs:
            raise ValueError(f"reward_kwargs {sorted(reward_kwargs)} only apply to named rewards, not to a callable")
        return reward
    if reward == "shapes":
        return ShapesFrameReward(**reward_kwargs)
    if reward == "imagereward":
        missing = [k for k in ("weights", "med_config", "tokenizer") if k not in reward_kwargs]
        if missing:
            raise ValueError(f"reward='imagereward' needs local weights: pass reward_kwargs with {missing} (the "
                             "ImageReward.pt checkpoint, its med_config.json and a bert-base-uncased tokenizer "
                             "folder; nothing is downloaded)")
        kwargs = dict(reward_kwargs)
        image_size = kwargs.pop("image_size", 224)
        from mmspec.evaluation.imagereward import ImageRewardScorer  # lazy: methods do not import evaluation

        return ScorerFrameReward(ImageRewardScorer(**kwargs), "imagereward", image_size)
    if reward == "clip":
        if "pretrained" not in reward_kwargs:
            raise ValueError("reward='clip' needs reward_kwargs={'model': ..., 'pretrained': <local weights file>} "
                             "(pretrained=None builds random weights, for tests only)")
        kwargs = dict(reward_kwargs)
        image_size = kwargs.pop("image_size", 224)
        from mmspec.evaluation.clip_score import CLIPScorer  # lazy: methods do not import evaluation

        return ScorerFrameReward(CLIPScorer(**kwargs), "clip", image_size)
    raise ValueError(f"reward must be one of {list(REWARDS)} or a callable (frames, prompt) -> per-frame scores, "
                     f"got {reward!r}")


class BatchReward:
    """A per-video reward applied to every video of a block: scores ``[B, F]``; checks one score per frame."""

    def __init__(self, reward: Callable, name: str) -> None:
        self.reward, self.name = reward, name

    def __call__(self, frames: torch.Tensor, prompts: Sequence[Any]) -> torch.Tensor:
        rows = []
        for video, prompt in zip(frames, prompts):  # video [F, 3, H, W]
            scores = self.reward(video, prompt)
            try:
                scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
            except (TypeError, ValueError, RuntimeError) as error:
                raise ValueError(f"reward {self.name} must return one number per frame, got {type(scores).__name__}: "
                                 f"{error}") from None
            if scores.numel() != video.shape[0]:
                raise ValueError(f"reward {self.name} returned {scores.numel()} scores for a block of "
                                 f"{video.shape[0]} frames: it must return one score per frame")
            rows.append(scores)
        return torch.stack(rows)
