"""GenEval-style prompts of the shapes world: texts, structured metadata and exact scoring rules.

Six categories, named as in GenEval (https://github.com/djghosh13/geneval), with shape kinds playing
the role of GenEval's object classes:

==============  ================================  ==================================================
category        example text                      correct when the image contains
==============  ================================  ==================================================
single_object   "a circle"                        at least one circle
two_object      "a circle and a square"           at least one circle and at least one square
counting        "three triangles"                 exactly three triangles (any colours)
colors          "a red circle"                    at least one red circle
position        "a circle to the left of a        a circle and a square with the circle left of the
                square"                           square (GenEval's relation rule, see
                                                  :func:`~mmspec.world.scene.relations_between`)
color_attr      "a red circle and a blue square"  a red circle and a blue square
==============  ================================  ==================================================

Extra objects are allowed except in counting (as in GenEval). Where GenEval checks the colour or
position of its most confident detection, we check whether any detected object satisfies the
requirement (there is no detection confidence here). An :class:`EvalPrompt` carries the category,
the required objects (shape, colour or None, count) and the relation, so the score is exact.

:func:`make_prompt_set` builds the fixed evaluation set (seeded, its own random stream, never shared
with training data); :func:`sample_prompt` draws prompts for training captions from another stream;
:func:`scene_for_prompt` samples a scene that satisfies a prompt (exactly the named objects).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .scene import (
    COLORS,
    MAX_OBJECTS,
    NAMESPACES,
    RELATIONS,
    SHAPES,
    Scene,
    as_rng,
    check_color,
    check_relation,
    check_shape,
    relations_between,
    sample_related_pair,
    scene_from_specs,
)

CATEGORIES: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
NUMBER_WORDS: dict[int, str] = {0: "zero", 1: "one", 2: "two", 3: "three", 4: "four"}
RELATION_PHRASES: dict[str, str] = {
    "left of": "to the left of",
    "right of": "to the right of",
    "above": "above",
    "below": "below",
}
COUNTS: tuple[int, ...] = (2, 3, 4)


def plural(shape: str) -> str:
    return shape + "s"


def check_category(category: str, name: str = "category") -> str:
    if category not in CATEGORIES:
        raise ValueError(f"{name} must be one of {list(CATEGORIES)}, got {category!r}")
    return category


class HasBox(Protocol):
    """What the scoring rules need from an object: a WorldObject or a DetectedObject both qualify."""

    shape: str
    color: str

    @property
    def bbox(self) -> tuple[float, float, float, float]: ...


@dataclass(frozen=True)
class ObjectSpec:
    """A required object: shape kind, colour name (None = any colour) and how many."""

    shape: str
    color: str | None = None
    count: int = 1

    def __post_init__(self) -> None:
        check_shape(self.shape)
        if self.color is not None:
            check_color(self.color)
        if not isinstance(self.count, int) or not 1 <= self.count <= MAX_OBJECTS:
            raise ValueError(f"count must be an integer in [1, {MAX_OBJECTS}], got {self.count!r}")

    def matches(self, obj: HasBox) -> bool:
        return obj.shape == self.shape and (self.color is None or obj.color == self.color)


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt: its text, category, required objects and (position only) the relation of
    ``objects[0]`` relative to ``objects[1]``."""

    text: str
    category: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None

    def __post_init__(self) -> None:
        check_category(self.category)
        object.__setattr__(self, "objects", tuple(self.objects))
        expected = {"single_object": 1, "colors": 1, "counting": 1}.get(self.category, 2)
        if len(self.objects) != expected:
            raise ValueError(f"a {self.category} prompt needs {expected} object spec(s), got {len(self.objects)}")
        if (self.category == "position") != (self.relation is not None):
            raise ValueError("relation must be given for position prompts and only for them")
        if self.relation is not None:
            check_relation(self.relation)

    def is_satisfied_by(self, objects: Iterable[HasBox]) -> bool:
        """Score a list of objects (ground-truth scene objects or detections) against this prompt."""
        return prompt_satisfied(self, objects)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "category": self.category,
            "objects": [{"shape": o.shape, "color": o.color, "count": o.count} for o in self.objects],
            "relation": self.relation,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalPrompt:
        try:
            objects = tuple(ObjectSpec(o["shape"], o.get("color"), int(o.get("count", 1))) for o in data["objects"])
            return cls(data["text"], data["category"], objects, data.get("relation"))
        except KeyError as err:
            raise ValueError(f"prompt data is missing the key {err}") from None


def prompt_satisfied(prompt: EvalPrompt, objects: Iterable[HasBox]) -> bool:
    """The GenEval-style rule of ``prompt.category`` applied to ``objects`` (see the module docstring)."""
    objects = [o for o in objects]
    matches = [[o for o in objects if spec.matches(o)] for spec in prompt.objects]
    if prompt.category == "counting":
        return len(matches[0]) == prompt.objects[0].count
    if prompt.category in ("single_object", "colors"):
        return len(matches[0]) >= prompt.objects[0].count
    first, second = matches
    if prompt.category == "position":
        return any(
            a is not b and prompt.relation in relations_between(a.bbox, b.bbox) for a in first for b in second
        )
    # two_object / color_attr: two distinct objects, one per spec
    return any(a is not b for a in first for b in second)


def prompt_text(category: str, objects: Sequence[ObjectSpec], relation: str | None = None) -> str:
    """The canonical text of a prompt (the same templates caption the training scenes)."""
    check_category(category)
    o = objects
    if category == "single_object":
        return f"a {o[0].shape}"
    if category == "colors":
        return f"a {o[0].color} {o[0].shape}"
    if category == "counting":
        return f"{NUMBER_WORDS[o[0].count]} {plural(o[0].shape)}"
    if category == "two_object":
        return f"a {o[0].shape} and a {o[1].shape}"
    if category == "position":
        return f"a {o[0].shape} {RELATION_PHRASES[relation]} a {o[1].shape}"
    return f"a {o[0].color} {o[0].shape} and a {o[1].color} {o[1].shape}"


def _make(category: str, objects: Sequence[ObjectSpec], relation: str | None = None) -> EvalPrompt:
    return EvalPrompt(prompt_text(category, objects, relation), category, tuple(objects), relation)


def enumerate_prompts(category: str) -> list[EvalPrompt]:
    """Every distinct prompt of a category (4 single-object, 12 two-object, 12 counting, 36 colour,
    48 position and 864 colour-attribution prompts)."""
    check_category(category)
    pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    if category == "single_object":
        return [_make(category, [ObjectSpec(s)]) for s in SHAPES]
    if category == "colors":
        return [_make(category, [ObjectSpec(s, c)]) for s in SHAPES for c in COLORS]
    if category == "counting":
        return [_make(category, [ObjectSpec(s, None, n)]) for s in SHAPES for n in COUNTS]
    if category == "two_object":
        return [_make(category, [ObjectSpec(a), ObjectSpec(b)]) for a, b in pairs]
    if category == "position":
        return [_make(category, [ObjectSpec(a), ObjectSpec(b)], r) for a, b in pairs for r in RELATIONS]
    return [
        _make(category, [ObjectSpec(a, ca), ObjectSpec(b, cb)])
        for a, b in pairs
        for ca in COLORS
        for cb in COLORS
        if ca != cb
    ]


def sample_prompt(category: str, rng: np.random.Generator | int | None = None) -> EvalPrompt:
    """A random prompt of ``category`` (uniform over :func:`enumerate_prompts`)."""
    rng = as_rng(rng)
    options = _cached_prompts(check_category(category))
    return options[int(rng.integers(len(options)))]


_PROMPT_CACHE: dict[str, list[EvalPrompt]] = {}


def _cached_prompts(category: str) -> list[EvalPrompt]:
    if category not in _PROMPT_CACHE:
        _PROMPT_CACHE[category] = enumerate_prompts(category)
    return _PROMPT_CACHE[category]


def make_prompt_set(n_per_category: int = 100, seed: int = 0, categories: Sequence[str] = CATEGORIES) -> list[EvalPrompt]:
    """The fixed evaluation prompt set: ``n_per_category`` prompts of each category, in category order.

    Within a category the distinct prompts are shuffled with the seed (a stream of its own, apart
    from every training stream) and taken in order, cycling when the category has fewer distinct
    prompts than requested (single_object has 4, so each appears 25 times in the default set: like
    GenEval's several images per prompt, they are scored with different generation seeds).
    """
    if not isinstance(n_per_category, int) or n_per_category < 1:
        raise ValueError(f"n_per_category must be a positive integer, got {n_per_category!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out: list[EvalPrompt] = []
    for ci, category in enumerate(categories):
        options = _cached_prompts(check_category(category))
        rng = np.random.default_rng([NAMESPACES["eval-prompts"], seed, ci])
        order = rng.permutation(len(options))
        out += [options[int(order[i % len(options)])] for i in range(n_per_category)]
    return out


def scene_for_prompt(prompt: EvalPrompt, rng: np.random.Generator | int | None = None) -> Scene:
    """A random scene containing exactly the prompt's objects (so the prompt is its complete caption).

    Unspecified colours and all sizes and positions are random; position prompts get a layout in which
    the relation holds clearly (:func:`~mmspec.world.scene.sample_related_pair`).
    """
    if not isinstance(prompt, EvalPrompt):
        raise ValueError(f"prompt must be an EvalPrompt, got {type(prompt).__name__}")
    rng = as_rng(rng)
    meta = {"category": prompt.category, "caption": prompt.text}
    if prompt.category == "position":
        a, b = prompt.objects
        scene = sample_related_pair(rng, (a.shape, a.color), (b.shape, b.color), prompt.relation)
        return Scene(scene.objects, scene.background, scene.seed, meta)
    specs = [(spec.shape, spec.color, None) for spec in prompt.objects for _ in range(spec.count)]
    return scene_from_specs(rng, specs, meta)
