"""The exact evaluator: parse an image of the shapes world back into objects and score prompts.

Parsing (:func:`parse_image`), one pass per image:

1. Foreground: pixels whose brightest channel exceeds ``FG_THRESHOLD`` (every palette colour has a
   channel >= 195 and every background stays below ~70 even at difficulty 2, so a pixel is foreground
   when roughly 40 % or more of it is covered by an object).
2. Connected components (8-connectivity, ``scipy.ndimage.label``). Components smaller than ``MIN_PIXELS_FRACTION`` of the
   smallest possible object are noise and ignored. The minimum gap between objects (4 pixels at
   32x32) keeps objects apart even after anti-aliasing and tokenization.
3. Colour: a majority vote of the component's core pixels (within 80 % of its brightest) for their
   nearest palette colour; the measured RGB is the median of the winners; farther than
   ``COLOR_TOLERANCE`` from every palette colour -> "unknown".
4. Coverage: every pixel of a window around the component is projected onto the line from the local
   background colour to the object colour, giving its fractional coverage alpha in [0, 1].
5. Shape and size by analysis-by-synthesis: the renderer's own anti-aliased coverage template of
   every (shape, size) candidate is placed with its centroid on the measured centroid and compared to
   alpha (L1); the two best candidates are refined over sub-pixel shifts. The best one gives shape,
   size class, bounding box and centre; a match quality 1 - L1 / (mass of alpha + mass of template)
   below ``MIN_MATCH`` -> shape "unknown" (a blob that is no shape of the world).

Scoring follows GenEval (:mod:`mmspec.world.prompts`): :func:`score_image` per prompt,
:func:`evaluate` for a set (per-category accuracy and their mean). :func:`score_video` scores clips:
every object present in every frame with the same identity, moving in the prompted direction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy import ndimage

from .prompts import CATEGORIES, EvalPrompt, prompt_satisfied
from .render import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE, SUPERSAMPLE, coverage_patch, glyph_mask, to_uint8
from .scene import COLORS, MAX_OBJECTS, SHAPES, SIZES

FG_THRESHOLD = 110.0
MIN_PIXELS_FRACTION = 0.35
COLOR_TOLERANCE = 90.0
MIN_MATCH = 0.6
ALPHA_FLOOR = 0.1  # coverage below this counts as background (noise suppression), on both sides

_EIGHT_CONNECTED = np.ones((3, 3), dtype=bool)
_PALETTE_NAMES = tuple(COLORS)
_PALETTE = np.asarray([COLORS[c] for c in _PALETTE_NAMES], dtype=np.float32)  # [C, 3]


@dataclass(frozen=True)
class DetectedObject:
    """One object read from an image. Coordinates are fractions of the canvas (like the scene's)."""

    shape: str  # one of SHAPES or "unknown"
    color: str  # one of COLORS or "unknown"
    size: str  # size class of the best template
    x: float  # centre of the bounding box
    y: float
    bbox: tuple[float, float, float, float]  # (x0, y0, x1, y1)
    area: float  # covered area (fraction of the canvas)
    match: float  # template match quality in [0, 1]
    rgb: tuple[float, float, float] = (0.0, 0.0, 0.0)  # measured colour


# ----------------------------------------------------------------------------------------------------
# connected components
# ----------------------------------------------------------------------------------------------------


def label_components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """8-connected components of a boolean mask: (labels int32 [H, W] with 0 = background, count).

    Components are numbered 1..count in raster order of their first pixel (``scipy.ndimage.label``, which
    numbers them so; it replaced a much slower pure-Python union-find).
    """
    labels, count = ndimage.label(np.asarray(mask, dtype=bool), structure=_EIGHT_CONNECTED)
    return labels.astype(np.int32, copy=False), int(count)


# ----------------------------------------------------------------------------------------------------
# templates
# ----------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _centroid_offset(shape: str, side_hi: int) -> tuple[float, float]:
    """Centroid of a glyph relative to its top-left corner, in high-res pixels."""
    m = glyph_mask(shape, side_hi)
    ys, xs = np.nonzero(m)
    return float(xs.mean() + 0.5), float(ys.mean() + 0.5)


def _soft(alpha: np.ndarray) -> np.ndarray:
    return np.clip((alpha - ALPHA_FLOOR) / (1 - 2 * ALPHA_FLOOR), 0.0, 1.0)


@lru_cache(maxsize=64)
def _coverage_bank(sides: tuple[int, ...]) -> np.ndarray:
    """Every coverage patch of the templates of side ``sides`` (high-res pixels) at every sub-pixel phase,
    zero-padded to one size: ``[len(sides), len(SHAPES), ss, ss, S, S]`` indexed (side, shape, phase_y,
    phase_x), so placed templates are gathered in one indexing operation instead of one call each."""
    ss = SUPERSAMPLE
    size = -(-(ss - 1 + max(sides)) // ss)
    bank = np.zeros((len(sides), len(SHAPES), ss, ss, size, size), dtype=np.float32)
    for i, side in enumerate(sides):
        for j, shape in enumerate(SHAPES):
            for phase_y in range(ss):
                for phase_x in range(ss):
                    patch = coverage_patch(shape, side, phase_x, phase_y, ss)
                    bank[i, j, phase_y, phase_x, : patch.shape[0], : patch.shape[1]] = patch
    bank.setflags(write=False)
    return bank


_SHAPE_INDEX = {shape: i for i, shape in enumerate(SHAPES)}


def _template_errors(alpha: np.ndarray, mass: float, placements: list[tuple[str, int, int, int]], wx0: int,
                     wy0: int) -> list[float]:
    """Normalised L1 distances between a coverage window and placed templates ``(shape, side_hi, left,
    top)`` (high-res pixels), all in one array operation: the templates' patches are gathered from
    :func:`_coverage_bank`, scattered into ``[K, h, w]`` windows and reduced per template (the same float32
    sums, element for element, as one template at a time)."""
    ss = SUPERSAMPLE
    wh, ww = alpha.shape
    sides = tuple(sorted({side_hi for _, side_hi, _, _ in placements}))
    bank = _coverage_bank(sides)
    size = bank.shape[-1]
    side_index = np.array([sides.index(side_hi) for _, side_hi, _, _ in placements])
    shape_index = np.array([_SHAPE_INDEX[shape] for shape, _, _, _ in placements])
    left = np.array([p[2] for p in placements])
    top = np.array([p[3] for p in placements])
    patches = bank[side_index, shape_index, top % ss, left % ss]  # [K, S, S]
    py, px = top // ss - wy0, left // ss - wx0  # the patches' top-left pixels in the window
    y_lo, x_lo = min(0, int(py.min())), min(0, int(px.min()))
    canvas = np.zeros((len(placements), max(wh, int(py.max()) + size) - y_lo, max(ww, int(px.max()) + size) - x_lo),
                      dtype=np.float32)
    offsets = np.arange(size)
    canvas[np.arange(len(placements))[:, None, None], (py - y_lo)[:, None, None] + offsets[None, :, None],
           (px - x_lo)[:, None, None] + offsets[None, None, :]] = patches
    stack = _soft(np.ascontiguousarray(canvas[:, -y_lo : wh - y_lo, -x_lo : ww - x_lo]))
    distance = np.abs(stack - alpha).sum(axis=(1, 2))
    total = stack.sum(axis=(1, 2))
    return [float(d) / max(mass + float(t), 1e-6) for d, t in zip(distance, total)]


_REFINE_SHIFTS = [(dx, dy) for dy in (-2, -1, 0, 1, 2) for dx in (-2, -1, 0, 1, 2) if dx or dy]


def _match_templates(alpha: np.ndarray, wx0: int, wy0: int, n: int):
    """Best (error, shape, size, left_hi, top_hi, side_hi) for a coverage window at (wx0, wy0).

    Every (shape, size) candidate whose area is plausible is placed with its centroid on the measured
    centroid; the two best are then refined over sub-pixel shifts of up to half a pixel.
    """
    ss = SUPERSAMPLE
    mass = float(alpha.sum())
    ys, xs = np.mgrid[0 : alpha.shape[0], 0 : alpha.shape[1]]
    cx = float((alpha * (xs + 0.5)).sum() / mass) + wx0  # centroid in low-res pixels
    cy = float((alpha * (ys + 0.5)).sum() / mass) + wy0
    candidates = []
    for size, frac in SIZES.items():
        side_hi = max(1, int(round(frac * n * ss)))
        area = (side_hi / ss) ** 2
        if not 0.25 * area <= mass <= 1.6 * area:
            continue
        for shape in SHAPES:
            ox, oy = _centroid_offset(shape, side_hi)
            candidates.append((shape, size, int(round(cx * ss - ox)), int(round(cy * ss - oy)), side_hi))
    if not candidates:
        return None
    errors = _template_errors(alpha, mass, [(shape, side_hi, left, top) for shape, _, left, top, side_hi in candidates],
                              wx0, wy0)
    coarse = sorted(zip(errors, *zip(*candidates)), key=lambda c: c[0])  # stable: ties keep the candidates' order
    best = coarse[0]
    shifted = [(err, shape, size, left0 + dx, top0 + dy, side_hi)  # both candidates' shifts in one batch
               for err, shape, size, left0, top0, side_hi in coarse[:2] for dx, dy in _REFINE_SHIFTS]
    errors = _template_errors(alpha, mass, [(shape, side_hi, left, top) for _, shape, _, left, top, side_hi in shifted],
                              wx0, wy0)
    for err, (_, shape, size, left, top, side_hi) in zip(errors, shifted):
        if err < best[0]:
            best = (err, shape, size, left, top, side_hi)
    return best


# ----------------------------------------------------------------------------------------------------
# parsing
# ----------------------------------------------------------------------------------------------------


def _check_image(image) -> np.ndarray:
    arr = to_uint8(image)
    h, w, _ = arr.shape
    if h != w:
        raise ValueError(f"image must be square, got {h}x{w}")
    if not MIN_IMAGE_SIZE <= h <= MAX_IMAGE_SIZE:
        raise ValueError(f"image size must be in [{MIN_IMAGE_SIZE}, {MAX_IMAGE_SIZE}], got {h}")
    return arr


def _object_color(img: np.ndarray, bright: np.ndarray, comp: np.ndarray) -> tuple[np.ndarray, str]:
    """Measured RGB and colour name of a component, by majority vote over its core.

    Core: the component's pixels within 80 % of its brightest (anti-aliased edges are dimmer). Each
    core pixel votes for its nearest palette colour; the measured RGB is the median of the winning
    pixels. A vote (unlike a channel-wise median) is not pulled to a third colour when a tokenized
    edge carries a neighbouring colour. Farther than ``COLOR_TOLERANCE`` from the palette: "unknown".
    """
    comp_bright = bright[comp]
    core = img[comp][comp_bright >= 0.8 * comp_bright.max()]  # [P, 3]
    nearest = np.linalg.norm(core[:, None, :] - _PALETTE[None], axis=2).argmin(axis=1)  # [P]
    winner = np.bincount(nearest, minlength=len(_PALETTE)).argmax()
    rgb = np.median(core[nearest == winner], axis=0)
    dist = np.linalg.norm(_PALETTE - rgb[None], axis=1)
    return rgb, (_PALETTE_NAMES[int(dist.argmin())] if dist.min() <= COLOR_TOLERANCE else "unknown")


def parse_image(image) -> list[DetectedObject]:
    """Read the objects of one image (PIL, uint8/float numpy [H, W, 3] or tensor [3, H, W]).

    Returns detections in reading order (top to bottom, then left to right); shapes or colours that
    match nothing in the world are reported as "unknown" (they satisfy no prompt).
    """
    img = _check_image(image).astype(np.float32)  # [N, N, 3]
    n = img.shape[0]
    bright = img.max(axis=2)
    fg = bright > FG_THRESHOLD
    labels, count = label_components(fg)
    if count == 0:
        return []
    sizes = np.bincount(labels.ravel(), minlength=count + 1)
    smallest = 0.5 * (min(SIZES.values()) * n) ** 2  # area of the smallest triangle, in pixels
    keep = [lab for lab in range(1, count + 1) if sizes[lab] >= MIN_PIXELS_FRACTION * smallest]
    # Background: pixels at least one pixel away from any foreground pixel.
    near_fg = fg.copy()
    near_fg[1:] |= fg[:-1]
    near_fg[:-1] |= fg[1:]
    near_fg[:, 1:] |= near_fg[:, :-1].copy()
    near_fg[:, :-1] |= near_fg[:, 1:].copy()
    bg_mask = ~near_fg
    global_bg = np.median(img[bg_mask], axis=0) if bg_mask.any() else np.zeros(3, np.float32)
    big = np.isin(labels, keep)
    pad = 2
    out = []
    for lab in keep:
        comp = labels == lab
        ys, xs = np.nonzero(comp)
        y0, y1 = max(ys.min() - pad, 0), min(ys.max() + pad + 1, n)
        x0, x1 = max(xs.min() - pad, 0), min(xs.max() + pad + 1, n)
        win = img[y0:y1, x0:x1]
        # 3. colour
        rgb, color = _object_color(img, bright, comp)
        # 4. coverage of every window pixel
        local = bg_mask[y0:y1, x0:x1]
        bg = np.median(win[local], axis=0) if local.sum() >= 4 else global_bg
        axis = rgb - bg
        alpha = ((win - bg) @ axis) / max(float(axis @ axis), 1e-6)
        alpha = _soft(np.clip(alpha, 0.0, 1.0)).astype(np.float32)
        others = big[y0:y1, x0:x1] & ~comp[y0:y1, x0:x1]
        if others.any():  # pixels of (or next to) other objects do not belong to this one
            grown = others.copy()
            grown[1:] |= others[:-1]
            grown[:-1] |= others[1:]
            grown[:, 1:] |= grown[:, :-1].copy()
            grown[:, :-1] |= grown[:, 1:].copy()
            alpha[grown] = 0.0
        mass = float(alpha.sum())
        if mass <= 0:
            continue
        # 5. shape and size by template matching
        best = _match_templates(alpha, x0, y0, n)
        if best is None:  # far too small or too large for any object of the world
            shape, size, quality = "unknown", "unknown", 0.0
            bx0, by0 = xs.min() / n, ys.min() / n
            bx1, by1 = (xs.max() + 1) / n, (ys.max() + 1) / n
        else:
            err, shape, size, left, top, side_hi = best
            quality = 1.0 - err
            if quality < MIN_MATCH:
                shape = "unknown"
            side = side_hi / SUPERSAMPLE
            bx0, by0 = left / SUPERSAMPLE / n, top / SUPERSAMPLE / n
            bx1, by1 = bx0 + side / n, by0 + side / n
        out.append(
            DetectedObject(
                shape=shape,
                color=color,
                size=size,
                x=(bx0 + bx1) / 2,
                y=(by0 + by1) / 2,
                bbox=(bx0, by0, bx1, by1),
                area=mass / n**2,
                match=quality,
                rgb=tuple(float(v) for v in rgb),
            )
        )
    out.sort(key=lambda o: (round(o.y * n / 4), o.x))
    return out


# ----------------------------------------------------------------------------------------------------
# scoring images
# ----------------------------------------------------------------------------------------------------


def is_valid_scene(detections: Sequence[DetectedObject]) -> bool:
    """Whether detections could come from a world scene: every object fully identified (shape, colour,
    size) and at most ``MAX_OBJECTS`` of them.

    A real GenEval detector ignores low-confidence blobs; the exact parser reads everything, so an
    image of noise or fragments would otherwise satisfy "a circle" by containing one among many. Such
    images fail every prompt instead.
    """
    if len(detections) > MAX_OBJECTS:
        return False
    return all("unknown" not in (d.shape, d.color, d.size) for d in detections)


def score_image(image, prompt: EvalPrompt) -> bool:
    """Whether an image satisfies a prompt (GenEval rules, see :mod:`mmspec.world.prompts`); images
    that are not valid scenes (:func:`is_valid_scene`) satisfy none."""
    if not isinstance(prompt, EvalPrompt):
        raise ValueError(f"prompt must be an EvalPrompt, got {type(prompt).__name__}")
    detections = parse_image(image)
    return is_valid_scene(detections) and prompt_satisfied(prompt, detections)


@dataclass
class GenEvalResult:
    """Scores of a prompt set: per-category accuracy, their mean (``overall``) and per-image results."""

    per_category: dict[str, float]
    overall: float
    correct: list[bool]
    counts: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        cats = ", ".join(f"{c} {a:.3f} (n={self.counts[c]})" for c, a in self.per_category.items())
        return f"overall {self.overall:.4f}: {cats}"


def evaluate(images: Sequence, prompts: Sequence[EvalPrompt]) -> GenEvalResult:
    """GenEval-style score of one image per prompt (several images of one prompt: repeat the prompt).

    ``overall`` is the mean of the category accuracies over the categories present (GenEval's overall
    score), not the mean over images.
    """
    if len(images) != len(prompts):
        raise ValueError(f"images and prompts must have the same length, got {len(images)} and {len(prompts)}")
    if len(prompts) == 0:
        raise ValueError("prompts must not be empty")
    correct = [score_image(img, p) for img, p in zip(images, prompts)]
    totals = Counter(p.category for p in prompts)
    right = Counter(p.category for p, ok in zip(prompts, correct) if ok)
    per_category = {c: right[c] / totals[c] for c in CATEGORIES if totals[c]}
    overall = float(np.mean(list(per_category.values())))
    return GenEvalResult(per_category, overall, correct, {c: totals[c] for c in per_category})


def scene_matches(detections: Sequence[DetectedObject], scene, position_tolerance: float | None = None) -> bool:
    """Whether detections equal a scene's objects exactly: same multiset of (shape, colour, size) and each
    object's centre within ``position_tolerance`` (default: 1 pixel at 32x32, 1/32) of a detection."""
    tol = 1 / 32 if position_tolerance is None else position_tolerance
    truth = sorted((o.shape, o.color, o.size) for o in scene.objects)
    found = sorted((d.shape, d.color, d.size) for d in detections)
    if truth != found:
        return False
    unused = list(detections)
    for o in scene.objects:
        hit = next(
            (d for d in unused if (d.shape, d.color, d.size) == (o.shape, o.color, o.size)
             and abs(d.x - o.x) <= tol and abs(d.y - o.y) <= tol),
            None,
        )
        if hit is None:
            return False
        unused.remove(hit)
    return True


# ----------------------------------------------------------------------------------------------------
# videos
# ----------------------------------------------------------------------------------------------------


@dataclass
class VideoScore:
    """Score of one clip against a video prompt.

    ``frame_scores[t]``: fraction of the prompted objects found in frame t (right shape and colour,
    exactly one candidate). ``identity``: every prompted object found in every frame with one size
    class throughout. ``motion``: every object's measured direction (from its first to last centre,
    nearest of the eight directions) is the prompted one and no frame-to-frame step goes backwards by
    more than one pixel along it. ``correct`` = identity and motion.
    """

    correct: bool
    identity: bool
    motion: bool
    frame_scores: list[float]
    directions: list[str | None]


def _frames_list(frames) -> list:
    import torch

    if isinstance(frames, np.ndarray) or isinstance(frames, torch.Tensor):
        if frames.ndim != 4:
            raise ValueError(f"frames must be [T, H, W, 3] (numpy) or [T, 3, H, W] (tensor), got {tuple(frames.shape)}")
        return [frames[t] for t in range(frames.shape[0])]
    if isinstance(frames, (list, tuple)):
        return list(frames)
    raise ValueError(f"frames must be an array, a tensor or a list of images, got {type(frames).__name__}")


def measured_direction(dx: float, dy: float, min_travel: float = 0.1) -> str | None:
    """Nearest of the eight directions to a displacement (canvas fractions); None if it is too short."""
    from .captions import DIRECTIONS

    if np.hypot(dx, dy) < min_travel:
        return None
    return max(DIRECTIONS, key=lambda d: DIRECTIONS[d][0] * dx + DIRECTIONS[d][1] * dy)


def score_video(frames, prompt) -> VideoScore:
    """Score a clip (uint8 [T, H, W, 3], tensor [T, 3, H, W] in [0, 1], or a list of images) against a
    :class:`~mmspec.world.video.VideoPrompt`."""
    from .captions import DIRECTIONS
    from .video import VideoPrompt

    if not isinstance(prompt, VideoPrompt):
        raise ValueError(f"prompt must be a VideoPrompt, got {type(prompt).__name__}")
    images = _frames_list(frames)
    if len(images) < 2:
        raise ValueError(f"a clip needs at least 2 frames, got {len(images)}")
    parsed = [parse_image(img) for img in images]
    n = _check_image(images[0]).shape[0]
    tracks: list[list[DetectedObject | None]] = []
    for spec in prompt.objects:
        tracks.append([
            (lambda hits: hits[0] if len(hits) == 1 else None)(
                [d for d in dets if d.shape == spec.shape and d.color == spec.color]
            )
            for dets in parsed
        ])
    frame_scores = [float(np.mean([tr[t] is not None for tr in tracks])) for t in range(len(images))]
    identity = all(all(d is not None for d in tr) and len({d.size for d in tr}) == 1 for tr in tracks)
    directions: list[str | None] = []
    motion = identity
    for spec, tr in zip(prompt.objects, tracks):
        if any(d is None for d in tr):
            directions.append(None)
            motion = False
            continue
        direction = measured_direction(tr[-1].x - tr[0].x, tr[-1].y - tr[0].y)
        directions.append(direction)
        ux, uy = DIRECTIONS[spec.direction]
        steps = [(b.x - a.x) * ux + (b.y - a.y) * uy for a, b in zip(tr[:-1], tr[1:])]
        if direction != spec.direction or min(steps) < -1.0 / n:
            motion = False
    return VideoScore(identity and motion, identity, motion, frame_scores, directions)


@dataclass
class VideoEvalResult:
    accuracy: float  # fraction of clips with correct = True
    identity: float
    motion: float
    frame_score: float  # mean of all frame scores
    scores: list[VideoScore]


def evaluate_videos(videos: Sequence, prompts: Sequence) -> VideoEvalResult:
    """Score one clip per video prompt; means over clips."""
    if len(videos) != len(prompts) or not prompts:
        raise ValueError(f"videos and prompts must be non-empty and of equal length, got {len(videos)} and {len(prompts)}")
    scores = [score_video(v, p) for v, p in zip(videos, prompts)]
    return VideoEvalResult(
        accuracy=float(np.mean([s.correct for s in scores])),
        identity=float(np.mean([s.identity for s in scores])),
        motion=float(np.mean([s.motion for s in scores])),
        frame_score=float(np.mean([np.mean(s.frame_scores) for s in scores])),
        scores=scores,
    )
