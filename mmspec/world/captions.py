"""Texts about scenes: short captions, detailed descriptions, question/answer pairs, the vocabulary.

* :func:`caption_scene` - one complete short caption ("a small red circle to the left of a large blue
  square"); every object is named, so a text-to-image model trained on it learns not to add objects.
  Category-driven captions (GenEval templates) come from :mod:`mmspec.world.prompts`.
* :func:`describe_scene` - a detailed description naming every object with colour, size and location,
  then counts and every pairwise relation (60-120 words for scenes of 3-4 objects); the VLM target
  is trained to produce these, so decoding is long enough for speculation to matter.
* :func:`qa_pairs` - simple questions with exact one- or two-word answers ("how many red shapes are
  there?" -> "two").
* :func:`vocabulary` - every word any generator of the world can emit (captions, prompts,
  descriptions, questions, answers, video captions and narrations), for word-level text tokenizers;
  :func:`split_words` is the matching word splitter (punctuation becomes separate words).

All texts are lower-case words separated by single spaces, with ",", "." and "?" attached to the
preceding word (split_words separates them).
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from .prompts import NUMBER_WORDS, RELATION_PHRASES, plural
from .scene import (
    COLORS,
    RELATIONS,
    SHAPES,
    SIZES,
    Scene,
    WorldObject,
    as_rng,
    dominant_relation,
    region_name,
    relations_between,
)

REGIONS: tuple[str, ...] = (
    "top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right"
)

# Motion directions of the video world: unit vectors in canvas coordinates (y grows downwards).
_D = 1 / np.sqrt(2)
DIRECTIONS: dict[str, tuple[float, float]] = {
    "right": (1.0, 0.0),
    "left": (-1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
    "up-right": (_D, -_D),
    "up-left": (-_D, -_D),
    "down-right": (_D, _D),
    "down-left": (-_D, _D),
}
DIRECTION_PHRASES: dict[str, str] = {
    "right": "right",
    "left": "left",
    "up": "up",
    "down": "down",
    "up-right": "up and to the right",
    "up-left": "up and to the left",
    "down-right": "down and to the right",
    "down-left": "down and to the left",
}

#: What a word is: a run of lower-case letters, or one punctuation mark ("," "." "?").
WORD_PATTERN = r"[a-z]+|[,.?]"
_WORD_RE = re.compile(WORD_PATTERN)


def split_words(text: str) -> list[str]:
    """Lower-case words and punctuation marks (",", ".", "?") of a text, in order."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    return _WORD_RE.findall(text.lower())


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def with_article(phrase: str) -> str:
    return f"{article(phrase)} {phrase}"


def _join(items: list[str]) -> str:
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def region_phrase(region: str) -> str:
    """"in the top left", "at the top", "on the left", "in the center", ..."""
    if region in ("top", "bottom"):
        return f"at the {region}"
    if region in ("left", "right"):
        return f"on the {region}"
    return f"in the {region}"


def _region_phrase(obj: WorldObject) -> str:
    return region_phrase(region_name(obj.x, obj.y))


def reading_key(obj: WorldObject) -> tuple[int, float, float]:
    """Sort key of :func:`reading_order`: region row (top to bottom), then x, then y."""
    return int(min(obj.y * 3, 2.999)), obj.x, obj.y


def reading_order(scene: Scene) -> list[WorldObject]:
    """Objects sorted top to bottom by region row, then left to right."""
    return sorted(scene.objects, key=reading_key)


def referring_names(scene: Scene) -> dict[int, str]:
    """A shortest unambiguous noun phrase (without article) for each object, keyed by its index.

    Tries "red circle", then "small red circle", then "small red circle in the top left" (two objects of the
    same colour, shape and size never share a region: the minimum gap keeps their centres more than a
    third of the canvas apart along x or y).
    """
    objs = scene.objects
    names: dict[int, str] = {}
    for i, o in enumerate(objs):
        same = [p for j, p in enumerate(objs) if j != i and p.shape == o.shape and p.color == o.color]
        if not same:
            names[i] = o.phrase()
        elif all(p.size != o.size for p in same):
            names[i] = o.phrase(with_size=True)
        else:
            names[i] = f"{o.phrase(with_size=True)} {_region_phrase(o)}"
    return names


# ----------------------------------------------------------------------------------------------------
# captions and descriptions
# ----------------------------------------------------------------------------------------------------


def caption_scene(scene: Scene) -> str:
    """A complete short caption naming every object (size, colour, shape) and where it is.

    One object: "a small red circle in the top left"; two: "a small red circle to the left of a large
    blue square" (the first object in reading order, related to the second by the dominant axis);
    three or four: "a small red circle in the top left, a ... in the center and a ... in the bottom right".
    """
    objs = reading_order(scene)
    if not objs:
        raise ValueError("scene has no objects to caption")
    if len(objs) == 1:
        return f"{with_article(objs[0].phrase(True))} {_region_phrase(objs[0])}"
    if len(objs) == 2:
        a, b = objs
        rel = RELATION_PHRASES[dominant_relation(a, b)]
        return f"{with_article(a.phrase(True))} {rel} {with_article(b.phrase(True))}"
    return _join([f"{with_article(o.phrase(True))} {_region_phrase(o)}" for o in objs])


def _count_phrase(n: int, noun: str) -> str:
    return f"{NUMBER_WORDS[n]} {noun if n == 1 else plural(noun)}"


def describe_scene(scene: Scene) -> str:
    """A detailed description: every object with size, colour and location, counts, colours shared by
    several objects and the relation of every pair. Deterministic for a scene."""
    objs = scene.objects
    if not objs:
        raise ValueError("scene has no objects to describe")
    order = sorted(range(len(objs)), key=lambda i: (int(min(objs[i].y * 3, 2.999)), objs[i].x))
    names = referring_names(scene)
    n = len(objs)
    sentences = [
        f"the image shows {'one shape' if n == 1 else NUMBER_WORDS[n] + ' shapes'} on a dark background."
    ]
    for rank, i in enumerate(order):
        o = objs[i]
        lead = "there is" if rank == 0 else "next, there is"
        sentences.append(f"{lead} {with_article(o.phrase(True))} {_region_phrase(o)} of the image.")
    if n >= 2:
        shape_counts = Counter(o.shape for o in objs)
        parts = [_count_phrase(shape_counts[s], s) for s in SHAPES if shape_counts[s]]
        first = next(sh for sh in SHAPES if shape_counts[sh])
        verb = "is" if shape_counts[first] == 1 else "are"  # agrees with the first noun
        sentences.append(f"in total there {verb} {_join(parts)}.")
        color_counts = Counter(o.color for o in objs)
        for c in COLORS:
            if color_counts[c] >= 2:
                sentences.append(f"{NUMBER_WORDS[color_counts[c]]} of the shapes are {c}.")
        for ai in range(len(order)):
            for bi in range(ai + 1, len(order)):
                i, j = order[ai], order[bi]
                rel = RELATION_PHRASES[dominant_relation(objs[i], objs[j])]
                sentences.append(f"the {names[i]} is {rel} the {names[j]}.")
    else:
        o = objs[0]
        sentences.append(f"the {o.shape} is {o.size} and {o.color}, and nothing else is in the image.")
    return " ".join(sentences)


# ----------------------------------------------------------------------------------------------------
# question / answer pairs
# ----------------------------------------------------------------------------------------------------


def _qa_count(scene: Scene) -> list[tuple[str, str]]:
    objs = scene.objects
    shape_counts = Counter(o.shape for o in objs)
    color_counts = Counter(o.color for o in objs)
    out = [("how many shapes are there?", NUMBER_WORDS[len(objs)])]
    out += [(f"how many {c} shapes are there?", NUMBER_WORDS[color_counts[c]]) for c in COLORS]
    out += [(f"how many {plural(s)} are there?", NUMBER_WORDS[shape_counts[s]]) for s in SHAPES]
    return out


def _qa_color(scene: Scene) -> list[tuple[str, str]]:
    counts = Counter(o.shape for o in scene.objects)
    return [(f"what color is the {o.shape}?", o.color) for o in scene.objects if counts[o.shape] == 1]


def _qa_shape(scene: Scene) -> list[tuple[str, str]]:
    counts = Counter(o.color for o in scene.objects)
    return [(f"what shape is the {o.color} object?", o.shape) for o in scene.objects if counts[o.color] == 1]


def _unique(scene: Scene) -> list[WorldObject]:
    pairs = Counter((o.color, o.shape) for o in scene.objects)
    return [o for o in scene.objects if pairs[(o.color, o.shape)] == 1]


def _qa_where(scene: Scene) -> list[tuple[str, str]]:
    return [(f"where is the {o.phrase()}?", region_name(o.x, o.y)) for o in _unique(scene)]


def _qa_size(scene: Scene) -> list[tuple[str, str]]:
    return [(f"what size is the {o.phrase()}?", o.size) for o in _unique(scene)]


def _qa_exists(scene: Scene) -> list[tuple[str, str]]:
    present = {(o.color, o.shape) for o in scene.objects}
    return [(f"is there {with_article(c)} {s}?", "yes" if (c, s) in present else "no") for c in COLORS for s in SHAPES]


def _qa_relation(scene: Scene) -> list[tuple[str, str]]:
    unique = _unique(scene)
    out = []
    for a in unique:
        for b in unique:
            if a is b:
                continue
            rels = relations_between(a.bbox, b.bbox)
            for r in RELATIONS:
                out.append((f"is the {a.phrase()} {RELATION_PHRASES[r]} the {b.phrase()}?", "yes" if r in rels else "no"))
    return out


QA_KINDS = {
    "count": _qa_count,
    "color": _qa_color,
    "shape": _qa_shape,
    "where": _qa_where,
    "size": _qa_size,
    "exists": _qa_exists,
    "relation": _qa_relation,
}


#: How each question template starts, in matching order, and its kind (``QA_KINDS``; counting split into
#: all shapes / one colour / one shape). Used to break question accuracy down by template.
_QA_TEMPLATES = (
    ("how many shapes are there?", "count (all)"), ("how many ", None), ("what color is the ", "color"),
    ("what shape is the ", "shape"), ("where is the ", "where"), ("what size is the ", "size"),
    ("is there ", "exists"), ("is the ", "relation"),
)


def qa_kind(question: str) -> str:
    """The template of a world question: a key of ``QA_KINDS``, with counting split into "count (all)",
    "count (color)" and "count (shape)". Raises ``ValueError`` for text no template produces."""
    for start, kind in _QA_TEMPLATES:
        if question.startswith(start) and question.endswith("?"):
            if kind is None:  # "how many <colour> shapes" or "how many <shapes>"
                return "count (color)" if question.endswith(" shapes are there?") else "count (shape)"
            return kind
    raise ValueError(f"not a question of the world's templates: {question!r}")


def qa_pairs(scene: Scene) -> list[tuple[str, str]]:
    """Every question of the world's templates that has an exact answer for this scene.

    Kinds (``QA_KINDS``): counting (total, per colour, per shape, absent ones -> "zero"), colour of a
    unique shape, shape of a unique colour, location and size of a unique (colour, shape), existence
    (yes/no) and pairwise relations (yes/no, GenEval's relation rule).
    """
    return [pair for fn in QA_KINDS.values() for pair in fn(scene)]


def sample_qa(scene: Scene, rng: np.random.Generator | int | None = None) -> tuple[str, str]:
    """One question/answer pair: a question kind drawn uniformly among the kinds that apply to the scene,
    then a question of that kind (existence questions: half about something present)."""
    rng = as_rng(rng)
    kinds = list(QA_KINDS)
    for k in rng.permutation(len(kinds)):
        kind = kinds[int(k)]
        group = QA_KINDS[kind](scene)
        if not group:
            continue
        if kind == "exists" and rng.uniform() < 0.5:
            group = [pair for pair in group if pair[1] == "yes"]
        return group[int(rng.integers(len(group)))]
    raise ValueError("scene has no objects to ask about")


# ----------------------------------------------------------------------------------------------------
# vocabulary
# ----------------------------------------------------------------------------------------------------

_TEMPLATE_WORDS = (
    "a an the and of to in on at is are there next shows image shape shapes dark background total "
    "nothing else how many what color where size object yes no it moving moves starts ends video first "
    "end all keep keeps same speed direction through whole clip"
)


def vocabulary() -> list[str]:
    """Every word the world's text generators can emit (sorted), punctuation marks included."""
    words = set(_TEMPLATE_WORDS.split())
    words |= {",", ".", "?"}
    words |= set(SHAPES) | {plural(s) for s in SHAPES} | set(COLORS) | set(SIZES)
    words |= set(NUMBER_WORDS.values())
    for phrase in list(RELATION_PHRASES.values()) + list(REGIONS) + list(DIRECTION_PHRASES.values()):
        words |= set(phrase.split())
    return sorted(words)
