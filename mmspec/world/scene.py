"""Scenes of the shapes world: the structured ground truth that images, captions and scores come from.

A scene is a small set of coloured shapes on a dark background, described in canvas-independent
units: every coordinate is a fraction of the (square) canvas side, x grows to the right and y grows
downwards, so "above" means a smaller y. The same scene renders at any image size (see
:mod:`mmspec.world.render`) and the exact evaluator (:mod:`mmspec.world.evaluator`) reads the same
description back from the pixels.

Scene constraints (they are what makes exact parsing possible, and every sampler here keeps them):

* shapes: ``SHAPES`` (circle, square, triangle pointing up, diamond), each as wide as it is tall;
* sizes: three classes whose side lengths (``SIZES``: 0.22 / 0.30 / 0.40 of the canvas, i.e. 7 / 9.6 /
  12.8 pixels at 32x32) differ by more than 35 %, so the class is readable from the area alone;
* colours: ``COLORS``, nine saturated colours at least 100 apart in RGB (Euclidean, 0-255 scale) and all
  with a channel >= 195, so that even the hardest shade jitter leaves each colour nearest to its own name
  and far brighter than any background;
* every object lies inside the canvas with a margin of ``MARGIN`` (1 pixel at 32x32);
* objects never overlap: the gap between any two bounding boxes is at least ``MIN_GAP`` along x or
  along y (4 pixels at 32x32, one 4x4 token patch), so objects stay separate connected components even
  after anti-aliasing and tokenization;
* 1 to 4 objects (``MAX_OBJECTS``). Crowded draws that cannot be placed are redrawn with smaller sizes.

Randomness: every sampler takes a ``numpy.random.Generator`` (or an int seed); datasets derive one
generator per index from ``(namespace, seed, index)`` with :func:`rng_for`, so a sample depends only on
its index and base seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")

# Base RGB of each colour name (0-255). Pairwise Euclidean distance >= 100 (tested), max channel >= 195.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 30, 30),
    "orange": (250, 135, 0),
    "yellow": (240, 232, 40),
    "green": (40, 195, 60),
    "cyan": (40, 215, 225),
    "blue": (45, 85, 245),
    "purple": (160, 60, 235),
    "pink": (250, 125, 195),
    "white": (235, 235, 235),
}

# Side length of each size class as a fraction of the canvas side.
SIZES: dict[str, float] = {"small": 0.22, "medium": 0.30, "large": 0.40}

MARGIN = 0.03  # minimum distance between an object's bounding box and the canvas border
MIN_GAP = 0.125  # minimum gap between two bounding boxes (along x or along y)
MAX_OBJECTS = 4
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
OPPOSITE_RELATION = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}

# Salts that keep the random streams of different uses apart (training data never shares a stream with
# the evaluation prompt set or held-out scenes).
NAMESPACES: dict[str, int] = {
    "train": 11,
    "val": 12,
    "test": 13,
    "eval-prompts": 21,
    "eval-videos": 22,
    "tokenizer-train": 31,
    "tokenizer-heldout": 32,
}


# ----------------------------------------------------------------------------------------------------
# validation and randomness helpers
# ----------------------------------------------------------------------------------------------------


def check_shape(shape: str, name: str = "shape") -> str:
    if shape not in SHAPES:
        raise ValueError(f"{name} must be one of {list(SHAPES)}, got {shape!r}")
    return shape


def check_color(color: str, name: str = "color") -> str:
    if color not in COLORS:
        raise ValueError(f"{name} must be one of {list(COLORS)}, got {color!r}")
    return color


def check_size(size: str, name: str = "size") -> str:
    if size not in SIZES:
        raise ValueError(f"{name} must be one of {list(SIZES)}, got {size!r}")
    return size


def check_relation(relation: str, name: str = "relation") -> str:
    if relation not in RELATIONS:
        raise ValueError(f"{name} must be one of {list(RELATIONS)}, got {relation!r}")
    return relation


def as_rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    """A numpy Generator from a Generator, an int seed or None (fresh entropy)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or (isinstance(rng, (int, np.integer)) and not isinstance(rng, bool)):
        return np.random.default_rng(rng)
    raise ValueError(f"rng must be a numpy Generator, an int seed or None, got {type(rng).__name__}")


def rng_for(namespace: str, seed: int, index: int) -> np.random.Generator:
    """The generator of sample ``index`` in stream ``namespace`` with base ``seed`` (independent streams)."""
    if namespace not in NAMESPACES:
        raise ValueError(f"namespace must be one of {list(NAMESPACES)}, got {namespace!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not isinstance(index, (int, np.integer)) or index < 0:
        raise ValueError(f"index must be a non-negative integer, got {index!r}")
    return np.random.default_rng([NAMESPACES[namespace], int(seed), int(index)])


# ----------------------------------------------------------------------------------------------------
# objects and scenes
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorldObject:
    """One shape: kind, colour name, size class, centre (x, y) in canvas fractions, shade jitter.

    ``shade`` is the per-instance colour jitter in unit scale (each channel in [-1, 1]); the renderer
    multiplies it by an amplitude that grows with the difficulty, so one scene renders flat at
    difficulty 0 and jittered at difficulty 1 or 2.
    """

    shape: str
    color: str
    size: str
    x: float
    y: float
    shade: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        check_shape(self.shape)
        check_color(self.color)
        check_size(self.size)
        for name in ("x", "y"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.floating)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number (fraction of the canvas), got {value!r}")
        if len(self.shade) != 3 or any(not -1.0 <= float(s) <= 1.0 for s in self.shade):
            raise ValueError(f"shade must be three numbers in [-1, 1], got {self.shade!r}")
        object.__setattr__(self, "x", float(self.x))
        object.__setattr__(self, "y", float(self.y))
        object.__setattr__(self, "shade", tuple(float(s) for s in self.shade))

    @property
    def extent(self) -> float:
        """Side length of the bounding box (canvas fraction)."""
        return SIZES[self.size]

    @property
    def bbox(self) -> tuple[float, float, float, float]:
        """(x0, y0, x1, y1) in canvas fractions."""
        h = self.extent / 2
        return (self.x - h, self.y - h, self.x + h, self.y + h)

    def moved(self, dx: float, dy: float) -> WorldObject:
        return replace(self, x=self.x + dx, y=self.y + dy)

    def phrase(self, with_size: bool = False) -> str:
        """"red circle" / "small red circle"."""
        return f"{self.size} {self.color} {self.shape}" if with_size else f"{self.color} {self.shape}"


@dataclass(frozen=True)
class Scene:
    """Objects plus the background: a unit tint (scaled by the difficulty) and a seed for noise/texture."""

    objects: tuple[WorldObject, ...]
    background: tuple[float, float, float] = (0.0, 0.0, 0.0)
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        objects = tuple(self.objects)
        if not all(isinstance(o, WorldObject) for o in objects):
            raise ValueError("objects must be WorldObject instances")
        object.__setattr__(self, "objects", objects)
        if len(self.background) != 3 or any(not 0.0 <= float(b) <= 1.0 for b in self.background):
            raise ValueError(f"background must be three numbers in [0, 1], got {self.background!r}")
        object.__setattr__(self, "background", tuple(float(b) for b in self.background))
        if not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))

    def __len__(self) -> int:
        return len(self.objects)

    def count(self, shape: str | None = None, color: str | None = None) -> int:
        """Number of objects matching the given shape and/or colour."""
        if shape is not None:
            check_shape(shape)
        if color is not None:
            check_color(color)
        return sum(
            (shape is None or o.shape == shape) and (color is None or o.color == color) for o in self.objects
        )

    def is_valid(self) -> bool:
        """Whether the scene keeps the constraints the exact evaluator relies on (see module docstring)."""
        return 1 <= len(self.objects) <= MAX_OBJECTS and all(inside_canvas(o) for o in self.objects) and all(
            separated(a, b) for i, a in enumerate(self.objects) for b in self.objects[i + 1 :]
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "objects": [
                {"shape": o.shape, "color": o.color, "size": o.size, "x": o.x, "y": o.y, "shade": list(o.shade)}
                for o in self.objects
            ],
            "background": list(self.background),
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scene:
        if not isinstance(data, dict) or "objects" not in data:
            raise ValueError("scene data must be a dict with an 'objects' list")
        objects = tuple(
            WorldObject(o["shape"], o["color"], o["size"], o["x"], o["y"], tuple(o.get("shade", (0, 0, 0))))
            for o in data["objects"]
        )
        return cls(objects, tuple(data.get("background", (0, 0, 0))), int(data.get("seed", 0)))


def inside_canvas(obj: WorldObject, margin: float = MARGIN) -> bool:
    x0, y0, x1, y1 = obj.bbox
    return x0 >= margin - 1e-9 and y0 >= margin - 1e-9 and x1 <= 1 - margin + 1e-9 and y1 <= 1 - margin + 1e-9


def separated(a: WorldObject, b: WorldObject, gap: float = MIN_GAP) -> bool:
    """True when the bounding boxes are at least ``gap`` apart along x or along y."""
    ax0, ay0, ax1, ay1 = a.bbox
    bx0, by0, bx1, by1 = b.bbox
    gap_x = max(bx0 - ax1, ax0 - bx1)
    gap_y = max(by0 - ay1, ay0 - by1)
    return max(gap_x, gap_y) >= gap - 1e-9


# ----------------------------------------------------------------------------------------------------
# spatial relations
# ----------------------------------------------------------------------------------------------------


def relations_between(
    box_a: Sequence[float], box_b: Sequence[float], margin: float = 0.1
) -> set[str]:
    """The spatial relations of box A relative to box B, GenEval-style.

    Boxes are (x0, y0, x1, y1). The centre offset A - B is shrunk on each axis by ``margin`` times the
    sum of the two boxes' sides (small offsets do not count), then normalised by the length of the
    raw offset; a relation holds when its axis component exceeds 0.5 (within about 60 degrees of the
    axis). Diagonal layouts can satisfy two relations ("left of" and "above"). This follows the rule of
    the GenEval protocol (https://github.com/djghosh13/geneval), written here from its description.
    """
    ax0, ay0, ax1, ay1 = box_a
    bx0, by0, bx1, by1 = box_b
    off = np.array([(ax0 + ax1) / 2 - (bx0 + bx1) / 2, (ay0 + ay1) / 2 - (by0 + by1) / 2])
    dims = np.array([(ax1 - ax0) + (bx1 - bx0), (ay1 - ay0) + (by1 - by0)])
    shrunk = np.sign(off) * np.maximum(np.abs(off) - margin * dims, 0.0)
    norm = float(np.hypot(*off))
    if norm < 1e-9 or np.all(np.abs(shrunk) < 1e-6):
        return set()
    ux, uy = shrunk / norm
    out = set()
    if ux < -0.5:
        out.add("left of")
    if ux > 0.5:
        out.add("right of")
    if uy < -0.5:
        out.add("above")
    if uy > 0.5:
        out.add("below")
    return out


def dominant_relation(a: WorldObject, b: WorldObject) -> str:
    """The single relation of A relative to B along the axis of the larger centre offset.

    For scenes that keep the constraints this relation is always among :func:`relations_between`
    (the minimum gap makes the dominant offset large enough), so a caption built from it scores true.
    """
    dx, dy = a.x - b.x, a.y - b.y
    if abs(dx) >= abs(dy):
        return "left of" if dx < 0 else "right of"
    return "above" if dy < 0 else "below"


def region_name(x: float, y: float) -> str:
    """Coarse location on a 3x3 grid: "top left", "top", ..., "center", ..., "bottom right"."""
    col = "left" if x < 1 / 3 else ("right" if x > 2 / 3 else "")
    row = "top" if y < 1 / 3 else ("bottom" if y > 2 / 3 else "")
    if row and col:
        return f"{row} {col}"
    return row or col or "center"


# ----------------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------------

_SIZE_ORDER = ("small", "medium", "large")


_COLOR_NAMES = tuple(COLORS)


def _random_color(rng: np.random.Generator) -> str:
    return _COLOR_NAMES[int(rng.integers(len(_COLOR_NAMES)))]


def _random_shade(rng: np.random.Generator) -> tuple[float, float, float]:
    return tuple(float(v) for v in rng.uniform(-1.0, 1.0, size=3))


def _random_position(rng: np.random.Generator, extent: float) -> tuple[float, float]:
    lo, hi = MARGIN + extent / 2, 1 - MARGIN - extent / 2
    return float(rng.uniform(lo, hi)), float(rng.uniform(lo, hi))


def place_objects(
    rng: np.random.Generator,
    specs: Sequence[tuple[str, str, str]],
    tries: int = 64,
) -> tuple[WorldObject, ...] | None:
    """Place objects given as (shape, color, size) at random positions that keep the constraints.

    Sequential rejection sampling, vectorised: for each object ``tries`` candidate centres are drawn
    at once and the first one clear of the objects already placed is kept; the whole placement is
    restarted a few times before giving up (None: the caller shrinks sizes and retries).
    """
    sides = np.array([SIZES[size] for _, _, size in specs])
    for _restart in range(8):
        centres = np.zeros((len(specs), 2))
        for i, side in enumerate(sides):
            lo, hi = MARGIN + side / 2, 1 - MARGIN - side / 2
            cand = rng.uniform(lo, hi, size=(tries, 2))  # [T, 2]
            if i:
                # gap between boxes along each axis: |c - c'| - (s + s') / 2, [T, i, 2]
                gaps = np.abs(cand[:, None, :] - centres[None, :i, :]) - (side + sides[None, :i, None]) / 2
                ok = (gaps.max(axis=2) >= MIN_GAP - 1e-9).all(axis=1)
                if not ok.any():
                    break
                cand = cand[int(np.argmax(ok)) :]
            centres[i] = cand[0]
        else:
            shades = rng.uniform(-1.0, 1.0, size=(len(specs), 3))
            return tuple(
                WorldObject(shape, color, size, float(c[0]), float(c[1]), tuple(float(v) for v in sh))
                for (shape, color, size), c, sh in zip(specs, centres, shades)
            )
    return None


def _shrink(sizes: list[str], rng: np.random.Generator) -> bool:
    """Make one of the largest objects one class smaller; False when all are already small."""
    ranks = [_SIZE_ORDER.index(s) for s in sizes]
    if max(ranks) == 0:
        return False
    candidates = [i for i, r in enumerate(ranks) if r == max(ranks)]
    i = candidates[int(rng.integers(len(candidates)))]
    sizes[i] = _SIZE_ORDER[ranks[i] - 1]
    return True


def random_size(rng: np.random.Generator, num_objects: int) -> str:
    """Size class, biased towards smaller sizes in crowded scenes."""
    weights = {1: (1, 1, 1), 2: (1, 1, 1), 3: (2, 2, 1), 4: (3, 2, 1)}[min(max(num_objects, 1), 4)]
    u = rng.uniform(0.0, sum(weights))
    return _SIZE_ORDER[0 if u < weights[0] else (1 if u < weights[0] + weights[1] else 2)]


def scene_from_specs(
    rng: np.random.Generator,
    specs: Sequence[tuple[str, str | None, str | None]],
    meta: dict[str, Any] | None = None,
) -> Scene:
    """A scene containing exactly the given objects; None colour/size entries are drawn at random."""
    rng = as_rng(rng)
    if not 1 <= len(specs) <= MAX_OBJECTS:
        raise ValueError(f"a scene holds 1 to {MAX_OBJECTS} objects, got {len(specs)}")
    shapes = [check_shape(s[0]) for s in specs]
    colors = [check_color(c) if c is not None else _random_color(rng) for _, c, _ in specs]
    fixed_size = [s[2] is not None for s in specs]
    sizes = [check_size(s[2]) if s[2] is not None else random_size(rng, len(specs)) for s in specs]
    while True:
        objects = place_objects(rng, list(zip(shapes, colors, sizes)))
        if objects is not None:
            break
        free = [s for s, f in zip(sizes, fixed_size) if not f]
        if not free or not _shrink(free, rng):
            raise ValueError(f"cannot place objects of sizes {sizes} on the canvas with the scene constraints")
        it = iter(free)
        sizes = [next(it) if not f else s for s, f in zip(sizes, fixed_size)]
    return _finish_scene(rng, objects, meta)


def _finish_scene(rng: np.random.Generator, objects: Sequence[WorldObject], meta: dict | None) -> Scene:
    background = tuple(float(v) for v in rng.uniform(0.0, 1.0, size=3))
    seed = int(rng.integers(0, 2**31 - 1))
    return Scene(tuple(objects), background, seed, dict(meta or {}))


def sample_scene(
    rng: np.random.Generator | int | None = None,
    num_objects: int | None = None,
    min_objects: int = 1,
    max_objects: int = MAX_OBJECTS,
) -> Scene:
    """A random scene: 1-4 objects (uniform) with random shapes, colours, sizes and positions.

    Shapes and colours may repeat (so counting questions are non-trivial).
    """
    rng = as_rng(rng)
    if not (isinstance(min_objects, int) and isinstance(max_objects, int)) or not (
        1 <= min_objects <= max_objects <= MAX_OBJECTS
    ):
        raise ValueError(
            f"need 1 <= min_objects <= max_objects <= {MAX_OBJECTS}, got {min_objects}, {max_objects}"
        )
    if num_objects is None:
        num_objects = int(rng.integers(min_objects, max_objects + 1))
    elif not isinstance(num_objects, (int, np.integer)) or not 1 <= num_objects <= MAX_OBJECTS:
        raise ValueError(f"num_objects must be an integer in [1, {MAX_OBJECTS}], got {num_objects!r}")
    specs = [(SHAPES[int(i)], None, None) for i in rng.integers(0, len(SHAPES), size=int(num_objects))]
    return scene_from_specs(rng, specs, {"category": "scene"})


def sample_related_pair(
    rng: np.random.Generator,
    a: tuple[str, str | None],
    b: tuple[str, str | None],
    relation: str,
    candidates: int = 64,
) -> Scene:
    """Two objects (shape, color-or-None) with A clearly ``relation`` B.

    "Clearly": the offset along the relation's axis is at least the two half sides plus the minimum
    gap, and the cross-axis offset is at most half of it, so the GenEval rule (:func:`relations_between`)
    gives the relation and not its opposite. Vectorised rejection sampling over ``candidates`` layouts.
    """
    rng = as_rng(rng)
    check_relation(relation)
    shapes = [check_shape(a[0], "a shape"), check_shape(b[0], "b shape")]
    colors = [check_color(c) if c is not None else _random_color(rng) for _, c in (a, b)]
    horizontal = relation in ("left of", "right of")
    sign = -1.0 if relation in ("left of", "above") else 1.0
    side_values = np.array([SIZES[s] for s in _SIZE_ORDER])
    for _ in range(100):
        idx = rng.integers(0, 3, size=(candidates, 2))  # size classes of A and B
        sides = side_values[idx]  # [M, 2]
        lo, hi = MARGIN + sides / 2, 1 - MARGIN - sides / 2
        cx = lo + rng.uniform(size=(candidates, 2)) * (hi - lo)  # x of A, B
        cy = lo + rng.uniform(size=(candidates, 2)) * (hi - lo)
        dx, dy = cx[:, 0] - cx[:, 1], cy[:, 0] - cy[:, 1]
        along, cross = (dx, dy) if horizontal else (dy, dx)
        ok = (along * sign >= sides.sum(1) / 2 + MIN_GAP) & (np.abs(cross) <= 0.5 * np.abs(along))
        for k in np.flatnonzero(ok):
            shade = rng.uniform(-1.0, 1.0, size=(2, 3))
            objs = [
                WorldObject(shapes[j], colors[j], _SIZE_ORDER[int(idx[k, j])], float(cx[k, j]), float(cy[k, j]),
                            tuple(float(v) for v in shade[j]))
                for j in range(2)
            ]
            if relation in relations_between(objs[0].bbox, objs[1].bbox) and separated(*objs):
                return _finish_scene(rng, objs, None)
    raise RuntimeError("could not place a related pair (should not happen with the default sizes)")
