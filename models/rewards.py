"""Per-frame reward callables for reward-routed speculative video generation (SDVG).

A reward is any callable ``reward(frames, prompt) -> scores`` that scores **one video block**:
``frames`` is a float tensor ``[F, 3, H, W]`` in [0, 1] and ``prompt`` the video's prompt (a string, or a
:class:`~mmspec.world.video.VideoPrompt`); it returns one score per frame (``F`` numbers: list, array or
tensor). :class:`~mmspec.pipelines.ar_video.ARVideoPipeline` calls it for every drafted block and the
core's :class:`~mmspec.reward.RewardRouter` aggregates (worst frame by default) and decides.

* :class:`ShapesFrameReward`: the shapes world's exact per-frame score (the evaluator's
  ``score_video(...).frame_scores``): the fraction of the prompted (shape, colour) pairs found exactly
  once in the frame. ``mode="match"`` weighs each found object by its template-match quality (a finer,
  continuous score for threshold sweeps).
* :class:`ScorerFrameReward`: wraps an image/prompt scorer with ``score(images: list[PIL.Image],
  prompts: list[str]) -> scores`` (the project's ``ImageRewardScorer`` and ``CLIPScorer`` in
  ``mmspec.evaluation``) into a per-frame reward. This module does not import ``mmspec.evaluation``
  (models do not depend on it); the pipeline builds those scorers lazily for ``reward="imagereward"``
  / ``"clip"``.
* :func:`parse_video_prompt`: prompt text -> :class:`~mmspec.world.video.VideoPrompt`.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import PIL.Image
import torch

from mmspec.world import COLORS, DIRECTION_PHRASES, SHAPES, parse_image
from mmspec.world.video import MotionSpec, VideoPrompt

_PHRASE_TO_DIRECTION = {phrase: name for name, phrase in DIRECTION_PHRASES.items()}
_OBJECT_RE = re.compile(
    r"an? (?P<color>{colors}) (?P<shape>{shapes}) moving (?P<direction>{directions})".format(
        colors="|".join(COLORS), shapes="|".join(SHAPES),
        directions="|".join(sorted(_PHRASE_TO_DIRECTION, key=len, reverse=True)))
)


def parse_video_prompt(prompt: str | VideoPrompt) -> VideoPrompt:
    """A video prompt in the world's format ("a red circle moving right and a blue square moving up and to
    the left"; objects joined by ", " and " and ") -> :class:`VideoPrompt`. VideoPrompts pass through."""
    if isinstance(prompt, VideoPrompt):
        return prompt
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string or a VideoPrompt, got {type(prompt).__name__}")
    text = " ".join(prompt.lower().split())
    objects, pos = [], 0
    while pos < len(text):
        if objects:
            for sep in (", ", " and "):
                if text.startswith(sep, pos):
                    pos += len(sep)
                    break
            else:
                break
        found = _OBJECT_RE.match(text, pos)
        if found is None:
            break
        objects.append(MotionSpec(found["shape"], found["color"], _PHRASE_TO_DIRECTION[found["direction"]]))
        pos = found.end()
    if not objects or pos != len(text):
        raise ValueError(f"the shapes reward needs prompts in the shapes world's video format, e.g. 'a red circle "
                         f"moving right and a blue square moving up'; cannot read {prompt!r}")
    try:
        return VideoPrompt(prompt, tuple(objects))
    except ValueError as error:
        raise ValueError(f"prompt {prompt!r}: {error}") from None


def frames_to_uint8(frames: Any) -> np.ndarray:
    """Frames ``[F, 3, H, W]`` float in [0, 1] (tensor) or ``[F, H, W, 3]`` uint8 (array) -> uint8 ``[F, H, W, 3]``."""
    if isinstance(frames, torch.Tensor):
        if frames.ndim != 4 or frames.shape[1] != 3:
            raise ValueError(f"frames must be a tensor [F, 3, H, W], got {tuple(frames.shape)}")
        array = frames.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
        return (array * 255.0 + 0.5).astype(np.uint8)
    array = np.asarray(frames)
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"frames must be [F, 3, H, W] (tensor) or [F, H, W, 3] (array), got {array.shape}")
    if array.dtype != np.uint8:
        array = (np.clip(array.astype(np.float32), 0, 1) * 255.0 + 0.5).astype(np.uint8)
    return array


class ShapesFrameReward:
    """The shapes world's exact per-frame reward.

    ``mode="fraction"`` (default): fraction of the prompt's (shape, colour) pairs found in the frame with
    exactly one matching detection, the evaluator's ``score_video(frames, prompt).frame_scores``.
    ``mode="match"``: each found object counts its template-match quality (in [0.6, 1]) instead of 1.
    """

    def __init__(self, mode: str = "fraction") -> None:
        if mode not in ("fraction", "match"):
            raise ValueError(f"mode must be 'fraction' or 'match', got {mode!r}")
        self.mode = mode
        self._prompts: dict[str, VideoPrompt] = {}

    def _prompt(self, prompt: str | VideoPrompt) -> VideoPrompt:
        if isinstance(prompt, VideoPrompt):
            return prompt
        if prompt not in self._prompts:
            self._prompts[prompt] = parse_video_prompt(prompt)
        return self._prompts[prompt]

    def __call__(self, frames: Any, prompt: str | VideoPrompt) -> list[float]:
        spec = self._prompt(prompt)
        scores = []
        for image in frames_to_uint8(frames):
            detections = parse_image(image)
            total = 0.0
            for obj in spec.objects:
                hits = [d for d in detections if d.shape == obj.shape and d.color == obj.color]
                if len(hits) == 1:
                    total += hits[0].match if self.mode == "match" else 1.0
            scores.append(total / len(spec.objects))
        return scores

    def __repr__(self) -> str:
        return f"ShapesFrameReward(mode={self.mode!r})"


class ScorerFrameReward:
    """Per-frame reward from an image/prompt scorer: ``scorer.score(images, prompts)`` with PIL images and
    strings, one score per pair (``ImageRewardScorer``, ``CLIPScorer``, ...). Frames are upscaled to
    ``image_size`` (nearest neighbour) before scoring when given: reward models expect larger images than
    the shapes world's 32 pixels (they resize internally anyway)."""

    def __init__(self, scorer: Any, name: str = "scorer", image_size: int | None = None) -> None:
        if not callable(getattr(scorer, "score", None)):
            raise ValueError(f"scorer must have a score(images, prompts) method, got {type(scorer).__name__}")
        self.scorer, self.name, self.image_size = scorer, name, image_size

    def __call__(self, frames: Any, prompt: str | VideoPrompt) -> list[float]:
        text = prompt.text if isinstance(prompt, VideoPrompt) else prompt
        images = [PIL.Image.fromarray(f) for f in frames_to_uint8(frames)]
        if self.image_size is not None:
            images = [im.resize((self.image_size, self.image_size), PIL.Image.NEAREST) for im in images]
        scores = self.scorer.score(images, [text] * len(images))
        return [float(s) for s in torch.as_tensor(scores, dtype=torch.float64).reshape(-1)]

    def __repr__(self) -> str:
        return f"ScorerFrameReward({self.name})"
