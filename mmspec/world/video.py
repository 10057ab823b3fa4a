"""Videos of the shapes world: shapes moving with constant velocity, their captions and narration.

A :class:`VideoClip` holds objects at frame 0 plus one direction (``DIRECTIONS``: four axes and four
diagonals) and speed each; frame t shows every object moved by t * velocity. Samplers keep the image
constraints of :mod:`mmspec.world.scene` in every frame (inside the canvas, never closer than the
minimum gap), keep (colour, shape) pairs distinct within a clip (so identity across frames is
unambiguous) and move every object by ``MIN_TRAVEL`` to ``MAX_TRAVEL`` of the canvas over the clip
(down to ``CROWDED_TRAVEL`` for crowded clips that cannot be placed otherwise), so the direction is
readable. The background (tint and texture) is static; pixel noise changes per
frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .captions import (
    DIRECTION_PHRASES,
    DIRECTIONS,
    article,
    reading_key,
    reading_order,
    region_phrase,
    with_article,
)
from .prompts import NUMBER_WORDS, RELATION_PHRASES
from .render import check_difficulty, check_image_size, render_scene
from .scene import (
    COLORS,
    MARGIN,
    MIN_GAP,
    NAMESPACES,
    SHAPES,
    SIZES,
    Scene,
    WorldObject,
    as_rng,
    check_color,
    check_shape,
    dominant_relation,
    region_name,
)

MAX_VIDEO_OBJECTS = 3
MIN_FRAMES, MAX_FRAMES = 2, 32
MIN_TRAVEL, MAX_TRAVEL = 0.25, 0.45  # distance covered over the clip, canvas fractions
CROWDED_TRAVEL = 0.15  # shortest travel, used only when crowded clips cannot be placed otherwise


def check_direction(direction: str, name: str = "direction") -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"{name} must be one of {list(DIRECTIONS)}, got {direction!r}")
    return direction


def check_num_frames(num_frames: int, name: str = "num_frames") -> int:
    if not isinstance(num_frames, (int, np.integer)) or not MIN_FRAMES <= num_frames <= MAX_FRAMES:
        raise ValueError(f"{name} must be an integer in [{MIN_FRAMES}, {MAX_FRAMES}], got {num_frames!r}")
    return int(num_frames)


@dataclass(frozen=True)
class VideoClip:
    """Objects at frame 0, one direction and speed (canvas fractions per frame) each, and a background."""

    objects: tuple[WorldObject, ...]
    directions: tuple[str, ...]
    speeds: tuple[float, ...]
    num_frames: int = 8
    background: tuple[float, float, float] = (0.0, 0.0, 0.0)
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects", tuple(self.objects))
        object.__setattr__(self, "directions", tuple(check_direction(d) for d in self.directions))
        object.__setattr__(self, "speeds", tuple(float(s) for s in self.speeds))
        if not len(self.objects) == len(self.directions) == len(self.speeds):
            raise ValueError("objects, directions and speeds must have the same length")
        check_num_frames(self.num_frames)

    def velocity(self, i: int) -> tuple[float, float]:
        ux, uy = DIRECTIONS[self.directions[i]]
        return ux * self.speeds[i], uy * self.speeds[i]

    def scene_at(self, t: int) -> Scene:
        """The scene of frame ``t`` (0-based)."""
        if not 0 <= t < self.num_frames:
            raise ValueError(f"frame index must be in [0, {self.num_frames}), got {t}")
        objs = tuple(o.moved(*(t * v for v in self.velocity(i))) for i, o in enumerate(self.objects))
        return Scene(objs, self.background, self.seed)

    def scenes(self) -> list[Scene]:
        return [self.scene_at(t) for t in range(self.num_frames)]

    def to_dict(self) -> dict[str, Any]:
        first = Scene(self.objects, self.background, self.seed).to_dict()
        return {**first, "directions": list(self.directions), "speeds": list(self.speeds), "num_frames": self.num_frames}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VideoClip:
        first = Scene.from_dict(data)
        return cls(first.objects, tuple(data["directions"]), tuple(data["speeds"]), int(data["num_frames"]),
                   first.background, first.seed)


_VIDEO_SIZE_WEIGHTS = {1: (1, 1, 1), 2: (3, 2, 1), 3: (3, 1, 0)}  # small, medium, large by object count


def clip_from_specs(
    rng: np.random.Generator,
    specs: Sequence[tuple[str, str, str]],
    num_frames: int = 8,
    meta: dict[str, Any] | None = None,
    candidates: int | None = None,
) -> VideoClip:
    """A clip of the given (shape, colour, direction) objects; sizes, travel and start points random.

    Vectorised rejection sampling: ``candidates`` layouts (default 16 / 128 / 512 for 1 / 2 / 3 objects) (sizes, travel distances, start points) are
    drawn at once and the first that keeps every frame inside the canvas and every pair of objects
    separated is used. Clips with three objects whose paths must cross may need shorter travel
    (``CROWDED_TRAVEL``); a ValueError says when no layout was found.
    """
    rng = as_rng(rng)
    num_frames = check_num_frames(num_frames)
    n = len(specs)
    if not 1 <= n <= MAX_VIDEO_OBJECTS:
        raise ValueError(f"a clip holds 1 to {MAX_VIDEO_OBJECTS} objects, got {n}")
    for s, c, d in specs:
        check_shape(s), check_color(c), check_direction(d)
    if len({(s, c) for s, c, _ in specs}) != n:
        raise ValueError("objects of a clip must have distinct (shape, color) pairs")
    m = candidates if candidates is not None else {1: 16, 2: 128, 3: 512}[n]
    frac = np.arange(num_frames) / (num_frames - 1)  # [T]
    unit = np.array([DIRECTIONS[d] for _, _, d in specs])  # [n, 2]
    weights = np.asarray(_VIDEO_SIZE_WEIGHTS[n], dtype=float)
    size_names = list(SIZES)
    for attempt in range(24):
        crowded = attempt >= 12
        size_idx = rng.choice(3, size=(m, n), p=weights / weights.sum())  # [M, n]
        sides = np.array([SIZES[k] for k in size_names])[size_idx]  # [M, n]
        lo_t, hi_t = (CROWDED_TRAVEL, MIN_TRAVEL) if crowded else (MIN_TRAVEL, MAX_TRAVEL)
        travel = rng.uniform(lo_t, hi_t, size=(m, n))
        disp = unit[None] * travel[..., None]  # [M, n, 2]
        lo = (MARGIN + sides / 2)[..., None] - np.minimum(disp, 0)  # start range per axis [M, n, 2]
        hi = (1 - MARGIN - sides / 2)[..., None] - np.maximum(disp, 0)
        ok = (lo <= hi).all(axis=(1, 2))  # [M]
        start = lo + rng.uniform(size=(m, n, 2)) * np.maximum(hi - lo, 0)
        centres = start[:, None] + frac[None, :, None, None] * disp[:, None]  # [M, T, n, 2]
        for i in range(n):
            for j in range(i + 1, n):
                gap = np.abs(centres[:, :, i] - centres[:, :, j]) - ((sides[:, i] + sides[:, j]) / 2)[:, None, None]
                ok &= (gap.max(axis=2) >= MIN_GAP - 1e-9).all(axis=1)
        if not ok.any():
            continue
        k = int(np.argmax(ok))
        shades = rng.uniform(-1.0, 1.0, size=(n, 3))
        objects = tuple(
            WorldObject(s, c, size_names[size_idx[k, i]], float(centres[k, 0, i, 0]), float(centres[k, 0, i, 1]),
                        tuple(float(v) for v in shades[i]))
            for i, (s, c, _) in enumerate(specs)
        )
        speeds = tuple(float(v) / (num_frames - 1) for v in travel[k])
        background = tuple(float(v) for v in rng.uniform(0.0, 1.0, size=3))
        return VideoClip(objects, tuple(d for _, _, d in specs), speeds, num_frames, background,
                         int(rng.integers(0, 2**31 - 1)), dict(meta or {}))
    raise ValueError(f"could not place moving objects {list(specs)} in {num_frames} frames with the scene constraints")


def _random_specs(rng: np.random.Generator, n: int) -> list[tuple[str, str, str]]:
    pairs: set[tuple[str, str]] = set()
    while len(pairs) < n:
        pairs.add((SHAPES[int(rng.integers(len(SHAPES)))], tuple(COLORS)[int(rng.integers(len(COLORS)))]))
    names = list(DIRECTIONS)
    return [(s, c, names[int(rng.integers(len(names)))]) for s, c in sorted(pairs)]


def sample_video(
    rng: np.random.Generator | int | None = None, num_objects: int | None = None, num_frames: int = 8
) -> VideoClip:
    """A random clip of 1-3 moving objects (uniform count), each in one of eight directions."""
    rng = as_rng(rng)
    num_frames = check_num_frames(num_frames)
    if num_objects is None:
        num_objects = int(rng.integers(1, MAX_VIDEO_OBJECTS + 1))
    elif not isinstance(num_objects, (int, np.integer)) or not 1 <= num_objects <= MAX_VIDEO_OBJECTS:
        raise ValueError(f"num_objects must be an integer in [1, {MAX_VIDEO_OBJECTS}], got {num_objects!r}")
    for _ in range(50):  # a few direction combinations of three objects cannot be placed: redraw them
        specs = _random_specs(rng, int(num_objects))
        order = rng.permutation(len(specs))
        try:
            return clip_from_specs(rng, [specs[i] for i in order], num_frames)
        except ValueError:
            continue
    raise RuntimeError("could not sample a clip (should not happen)")


def clip_in_reading_order(clip: VideoClip) -> VideoClip:
    """The same clip with its objects (and their directions and speeds) listed in the first frame's
    reading order (top to bottom by region row, then left to right).

    ``caption_video`` and ``narrate_video`` name a clip's objects in list order. For a clip made from a
    prompt that order is the prompt's, but ``sample_video`` draws it at random, and no frame shows it: a
    captioner learning from those texts could not know which object to name first. This order can be
    read off the first frame. The frames are unchanged (objects never overlap, each keeps its shade)."""
    if not isinstance(clip, VideoClip):
        raise ValueError(f"clip must be a VideoClip, got {type(clip).__name__}")
    order = sorted(range(len(clip.objects)), key=lambda i: reading_key(clip.objects[i]))
    return replace(clip, objects=tuple(clip.objects[i] for i in order),
                   directions=tuple(clip.directions[i] for i in order), speeds=tuple(clip.speeds[i] for i in order))


def render_video(clip: VideoClip, image_size: int = 32, difficulty: float = 1.0) -> np.ndarray:
    """Frames of a clip: uint8 [T, H, W, 3] (pixel noise differs per frame, the background does not)."""
    if not isinstance(clip, VideoClip):
        raise ValueError(f"clip must be a VideoClip, got {type(clip).__name__}")
    image_size, difficulty = check_image_size(image_size), check_difficulty(difficulty)
    return np.stack([render_scene(clip.scene_at(t), image_size, difficulty, frame=t) for t in range(clip.num_frames)])


# ----------------------------------------------------------------------------------------------------
# texts
# ----------------------------------------------------------------------------------------------------


def _motion_phrase(obj: WorldObject, direction: str) -> str:
    return f"{with_article(obj.phrase())} moving {DIRECTION_PHRASES[direction]}"


def caption_video(clip: VideoClip) -> str:
    """"a red circle moving right" / "a red circle moving right and a blue square moving up"."""
    parts = [_motion_phrase(o, d) for o, d in zip(clip.objects, clip.directions)]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def narrate_video(clip: VideoClip) -> str:
    """A long narration: every object's look, start, motion and end, plus the layout at the first and
    last frame (60+ words for two or three objects). Deterministic for a clip."""
    first, last = clip.scene_at(0), clip.scene_at(clip.num_frames - 1)
    n = len(clip.objects)
    count = "one shape" if n == 1 else f"{NUMBER_WORDS[n]} shapes"
    sentences = [f"the video shows {count} moving on a dark background."]
    for i, (o, d) in enumerate(zip(clip.objects, clip.directions)):
        end = last.objects[i]
        sentences.append(
            f"{with_article(o.phrase(True))} starts {region_phrase(region_name(o.x, o.y))} and moves "
            f"{DIRECTION_PHRASES[d]}, it ends {region_phrase(region_name(end.x, end.y))}."
        )
    if n >= 2:
        for label, scene in (("at first", first), ("at the end", last)):
            objs = reading_order(scene)
            rels = []
            for a_i in range(len(objs)):
                for b_i in range(a_i + 1, len(objs)):
                    a, b = objs[a_i], objs[b_i]
                    rels.append(f"the {a.phrase()} is {RELATION_PHRASES[dominant_relation(a, b)]} the {b.phrase()}")
            sentences.append(f"{label}, " + ", and ".join(rels) + ".")
        sentences.append("all shapes keep the same speed and direction through the whole clip.")
    else:
        sentences.append(f"the {clip.objects[0].phrase()} keeps the same speed and direction through the whole clip.")
    return " ".join(sentences)


# ----------------------------------------------------------------------------------------------------
# prompts
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MotionSpec:
    """A required moving object: shape, colour and direction."""

    shape: str
    color: str
    direction: str

    def __post_init__(self) -> None:
        check_shape(self.shape), check_color(self.color), check_direction(self.direction)


@dataclass(frozen=True)
class VideoPrompt:
    """A video prompt with its required moving objects (distinct (shape, colour) pairs)."""

    text: str
    objects: tuple[MotionSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects", tuple(self.objects))
        if not 1 <= len(self.objects) <= MAX_VIDEO_OBJECTS:
            raise ValueError(f"a video prompt needs 1 to {MAX_VIDEO_OBJECTS} objects, got {len(self.objects)}")
        if len({(o.shape, o.color) for o in self.objects}) != len(self.objects):
            raise ValueError("objects of a video prompt must have distinct (shape, color) pairs")

    @property
    def category(self) -> str:
        return "single_motion" if len(self.objects) == 1 else "multi_motion"

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "objects": [vars(o).copy() for o in self.objects]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VideoPrompt:
        return cls(data["text"], tuple(MotionSpec(**o) for o in data["objects"]))


def video_prompt_text(objects: Sequence[MotionSpec]) -> str:
    parts = [f"{article(o.color)} {o.color} {o.shape} moving {DIRECTION_PHRASES[o.direction]}" for o in objects]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def sample_video_prompt(rng: np.random.Generator | int | None = None, num_objects: int | None = None) -> VideoPrompt:
    rng = as_rng(rng)
    if num_objects is None:
        num_objects = int(rng.integers(1, 3))
    specs = _random_specs(rng, int(num_objects))
    order = rng.permutation(len(specs))
    objs = tuple(MotionSpec(*specs[i]) for i in order)
    return VideoPrompt(video_prompt_text(objs), objs)


def make_video_prompt_set(n: int = 100, seed: int = 0) -> list[VideoPrompt]:
    """The fixed video evaluation set: ``n`` prompts, half with one moving object and half with two."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    rng = np.random.default_rng([NAMESPACES["eval-videos"], int(seed)])
    return [sample_video_prompt(rng, 1 + (i % 2)) for i in range(n)]


def clip_for_prompt(prompt: VideoPrompt, rng: np.random.Generator | int | None = None, num_frames: int = 8) -> VideoClip:
    """A random clip with exactly the prompt's moving objects (the prompt is its caption)."""
    if not isinstance(prompt, VideoPrompt):
        raise ValueError(f"prompt must be a VideoPrompt, got {type(prompt).__name__}")
    return clip_from_specs(as_rng(rng), [(o.shape, o.color, o.direction) for o in prompt.objects], num_frames,
                           {"caption": prompt.text})
