"""The GenEval protocol (Ghosh et al. 2023, https://github.com/djghosh13/geneval), for COCO objects and
for the shapes world.

GenEval scores text-to-image models on six categories of compositional prompts by detecting objects
in the generated images: ``single_object``, ``two_object``, ``counting``, ``colors``, ``position`` and
``color_attr``. A prompt's metadata row (JSON lines, the official format) says what must be present::

    {"tag": "counting", "include": [{"class": "clock", "count": 2}],
     "exclude": [{"class": "clock", "count": 3}], "prompt": "a photo of two clocks"}

``include`` clauses are ANDed (at least ``count`` objects of the class; optional ``color``; optional
``position: [relation, index]``, the relation of these objects to those of include clause ``index``);
``exclude`` clauses are ORed (failing when ``count`` or more are present). The score of a category is
the fraction of its images judged correct; the overall GenEval score is the mean of the six category
accuracies.

Two worlds:

* ``coco``: the real protocol. The official prompt file (553 prompts over the 80 COCO classes) cannot
  be downloaded here, so :func:`generate_coco_metadata` rebuilds it from GenEval's templates: the same
  class list, templates and sampling procedure (numpy ``default_rng(43)``, 100 draws per task, exact
  duplicates removed), which yields 553 prompts (80/99/80/94/100/100). The official file is accepted
  by path wherever a metadata file is read. Detection is pluggable: any callable returning boxes,
  labels and scores (:class:`Detections`), e.g. :class:`TransformersDetector` for a transformers object
  detector with local weights (GenEval's own detector is Mask2Former from mmdetection, which is not
  installed here: numbers with another detector are not comparable with published GenEval scores).
  Colours are classified on the detected boxes by a CLIP zero-shot classifier
  (:class:`CLIPColorClassifier`, GenEval's method; GenEval uses open_clip ViT-L-14 "openai" weights).
  The thresholds are GenEval's defaults (:class:`GenEvalOptions`).
* ``shapes``: the shapes world's prompt set (:func:`mmspec.world.prompts.make_prompt_set`) written in
  the same format (with ``"world": "shapes"``), scored by the world's exact evaluator
  (:mod:`mmspec.world.evaluator`): the image is parsed back into objects and the prompt checked by the
  world's GenEval rules, with no detector or colour classifier needed.

Image layout (GenEval's): ``IMAGEDIR/<index:05d>/metadata.jsonl`` (the prompt's row) and
``IMAGEDIR/<index:05d>/samples/<k:04d>.png``. Each row says its world, so ``evaluate`` needs a detector
(and a colour classifier) only for COCO rows.

Command line::

    python -m mmspec.evaluation.geneval prompts --world coco --out geneval_prompts.jsonl
    python -m mmspec.evaluation.geneval prompts --world shapes --out shapes_prompts.jsonl
    python -m mmspec.evaluation.geneval generate --world shapes --ground-truth --outdir runs/gt
    accelerate launch -m mmspec.evaluation.geneval generate --pipeline mmspec/shapes-t2i --method eagle ...
    python -m mmspec.evaluation.geneval evaluate runs/gt --out runs/gt/results.jsonl
    python -m mmspec.evaluation.geneval evaluate IMAGEDIR --detector PATH \\
        --clip-model ViT-L-14 --clip-pretrained PATH --out results.jsonl
    python -m mmspec.evaluation.geneval summary results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmspec.validation import positive_int_argument

from .distributed import process_index_and_count, shard_indices
from .files import (
    IMAGE_EXTENSIONS,
    open_rgb,
    read_jsonl,
    save_image_atomic,
    write_json_atomic,
    write_jsonl_atomic,
    write_text_atomic,
)

CATEGORIES: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

# GenEval's class list: the 80 COCO classes in COCO order, with GenEval's names for three of them
# ("computer mouse", "tv remote", "computer keyboard" instead of "mouse", "remote", "keyboard").
COCO_CLASSES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book",
    "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
COCO_COLORS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")

# Detector label names (COCO / Pascal VOC spellings found in model configs) -> GenEval class names.
LABEL_ALIASES: dict[str, str] = {
    "mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard",
    "tvmonitor": "tv", "tv monitor": "tv", "motorbike": "motorcycle", "aeroplane": "airplane",
    "sofa": "couch", "diningtable": "dining table", "pottedplant": "potted plant", "hair dryer": "hair drier",
    "cellphone": "cell phone", "mobile phone": "cell phone",
}

OFFICIAL_SEED = 43
OFFICIAL_DRAWS_PER_TASK = 100


# ----------------------------------------------------------------------------------------------
# Prompt metadata: COCO (rebuilt from GenEval's templates)
# ----------------------------------------------------------------------------------------------


def _with_article(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _plural(word: str) -> str:
    return f"{word}es" if word.endswith("s") else f"{word}s"


def generate_coco_metadata(
    seed: int = OFFICIAL_SEED, draws_per_task: int = OFFICIAL_DRAWS_PER_TASK, classnames: Sequence[str] = COCO_CLASSES
) -> list[dict]:
    """GenEval's evaluation metadata, rebuilt deterministically from its templates.

    The procedure of GenEval's prompt generator (described in its repository): one single-object prompt
    per class (in a random order), then ``draws_per_task`` random draws for each of two_object,
    counting (2-4 objects), colors, position and color_attr, all from one numpy ``default_rng(seed)``
    stream, then exact duplicates removed keeping the first. Colour prompts never colour a "person".
    With the defaults this gives the 553 prompts of GenEval's published file.
    """
    classnames = list(classnames)
    if len(set(classnames)) != len(classnames) or len(classnames) < 2:
        raise ValueError("classnames must hold at least two distinct names")
    n = len(classnames)
    person = classnames.index("person") if "person" in classnames else 0
    rng = np.random.default_rng(seed)
    rows: list[dict] = []

    for i in rng.choice(n, size=n, replace=False):
        rows.append({"tag": "single_object", "include": [{"class": classnames[i], "count": 1}],
                     "prompt": f"a photo of {_with_article(classnames[i])}"})
    for _ in range(draws_per_task):
        a, b = rng.choice(n, size=2, replace=False)
        rows.append({"tag": "two_object",
                     "include": [{"class": classnames[a], "count": 1}, {"class": classnames[b], "count": 1}],
                     "prompt": f"a photo of {_with_article(classnames[a])} and {_with_article(classnames[b])}"})
    for _ in range(draws_per_task):
        i = rng.choice(n)
        k = int(rng.integers(2, 4, endpoint=True))
        rows.append({"tag": "counting", "include": [{"class": classnames[i], "count": k}],
                     "exclude": [{"class": classnames[i], "count": k + 1}],
                     "prompt": f"a photo of {NUMBER_WORDS[k]} {_plural(classnames[i])}"})
    for _ in range(draws_per_task):
        i = (rng.choice(n - 1) + 1 + person) % n  # any class but "person"
        color = COCO_COLORS[rng.choice(len(COCO_COLORS))]
        rows.append({"tag": "colors", "include": [{"class": classnames[i], "count": 1, "color": color}],
                     "prompt": f"a photo of {_with_article(color)} {classnames[i]}"})
    for _ in range(draws_per_task):
        a, b = rng.choice(n, size=2, replace=False)
        relation = RELATIONS[rng.choice(len(RELATIONS))]
        rows.append({"tag": "position",
                     "include": [{"class": classnames[b], "count": 1},
                                 {"class": classnames[a], "count": 1, "position": [relation, 0]}],
                     "prompt": f"a photo of {_with_article(classnames[a])} {relation} {_with_article(classnames[b])}"})
    for _ in range(draws_per_task):
        a, b = (rng.choice(n - 1, size=2, replace=False) + 1 + person) % n
        ca, cb = rng.choice(len(COCO_COLORS), size=2, replace=False)
        rows.append({"tag": "color_attr",
                     "include": [{"class": classnames[a], "count": 1, "color": COCO_COLORS[ca]},
                                 {"class": classnames[b], "count": 1, "color": COCO_COLORS[cb]}],
                     "prompt": f"a photo of {_with_article(COCO_COLORS[ca])} {classnames[a]} and "
                               f"{_with_article(COCO_COLORS[cb])} {classnames[b]}"})

    unique, seen = [], set()
    for row in rows:
        key = json.dumps(row, sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


# ----------------------------------------------------------------------------------------------
# Prompt metadata: the shapes world
# ----------------------------------------------------------------------------------------------


def shapes_prompt_to_metadata(prompt) -> dict:
    """A shapes-world ``EvalPrompt`` as a GenEval metadata row (plus ``"world": "shapes"``)."""
    spec = [{"class": o.shape, "count": o.count, **({"color": o.color} if o.color else {})} for o in prompt.objects]
    row: dict[str, Any] = {"tag": prompt.category}
    if prompt.category == "position":
        # EvalPrompt: objects[0] <relation> objects[1]; GenEval: include[1] <relation> include[0].
        row["include"] = [spec[1], {**spec[0], "position": [prompt.relation, 0]}]
    else:
        row["include"] = spec
    if prompt.category == "counting":
        row["exclude"] = [{"class": spec[0]["class"], "count": spec[0]["count"] + 1}]
    row["prompt"] = prompt.text
    row["world"] = "shapes"
    return row


def metadata_to_shapes_prompt(row: dict):
    """The inverse of :func:`shapes_prompt_to_metadata`."""
    from mmspec.world.prompts import EvalPrompt, ObjectSpec

    def spec(clause):
        return ObjectSpec(clause["class"], clause.get("color"), int(clause.get("count", 1)))

    include = row["include"]
    if row["tag"] == "position":
        return EvalPrompt(row["prompt"], "position", (spec(include[1]), spec(include[0])), include[1]["position"][0])
    return EvalPrompt(row["prompt"], row["tag"], tuple(spec(c) for c in include))


def generate_shapes_metadata(n_per_category: int = 100, seed: int = 0) -> list[dict]:
    """The shapes world's evaluation prompt set as GenEval metadata rows (see the module docstring)."""
    from mmspec.world.prompts import make_prompt_set

    return [shapes_prompt_to_metadata(p) for p in make_prompt_set(n_per_category, seed)]


# ----------------------------------------------------------------------------------------------
# Validation, reading and writing
# ----------------------------------------------------------------------------------------------


def _world_vocabulary(world: str) -> tuple[set[str] | None, set[str]]:
    if world == "shapes":
        from mmspec.world.scene import COLORS, SHAPES

        return set(SHAPES), set(COLORS)
    return None, set(COCO_COLORS)  # COCO classes are checked against the detector's labels


def validate_metadata(rows: Sequence[dict], source: str = "metadata") -> list[dict]:
    """Check rows against the GenEval format; raise ValueError naming the row and the problem."""
    if not rows:
        raise ValueError(f"{source}: no prompts")
    for number, row in enumerate(rows, start=1):
        where = f"{source}: row {number}"
        if not isinstance(row, dict):
            raise ValueError(f"{where} is not an object")
        tag = row.get("tag")
        if tag not in CATEGORIES:
            raise ValueError(f"{where} has unknown category (tag) {tag!r}; expected one of {list(CATEGORIES)}")
        if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f"{where} has no prompt text")
        world = row.get("world", "coco")
        if world not in ("coco", "shapes"):
            raise ValueError(f"{where} has unknown world {world!r} (expected 'coco' or 'shapes')")
        classes, colors = _world_vocabulary(world)
        include = row.get("include")
        if not isinstance(include, list) or not include:
            raise ValueError(f"{where} needs a non-empty 'include' list")
        for kind in ("include", "exclude"):
            clauses = row.get(kind, [])
            if not isinstance(clauses, list):
                raise ValueError(f"{where}: '{kind}' must be a list")
            for i, clause in enumerate(clauses):
                if not isinstance(clause, dict) or not isinstance(clause.get("class"), str):
                    raise ValueError(f"{where}: {kind}[{i}] needs a 'class'")
                if classes is not None and clause["class"] not in classes:
                    raise ValueError(f"{where}: {kind}[{i}] has unknown class {clause['class']!r} for the {world} world")
                count = clause.get("count", 1)
                if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                    raise ValueError(f"{where}: {kind}[{i}] has a bad count {count!r}")
                if "color" in clause and clause["color"] not in colors:
                    raise ValueError(f"{where}: {kind}[{i}] has unknown colour {clause['color']!r} for the {world} world")
                if "position" in clause:
                    pos = clause["position"]
                    if (kind != "include" or not isinstance(pos, (list, tuple)) or len(pos) != 2
                            or pos[0] not in RELATIONS or not isinstance(pos[1], int) or not 0 <= pos[1] < i):
                        raise ValueError(
                            f"{where}: {kind}[{i}] has a bad position {pos!r} "
                            f"(expected [relation, index of an earlier include clause], relation in {list(RELATIONS)})"
                        )
        if world == "shapes":
            try:
                metadata_to_shapes_prompt(row)
            except (ValueError, KeyError, IndexError) as err:
                raise ValueError(f"{where} is not a valid shapes-world prompt: {err}") from None
    return list(rows)


def load_metadata(path: str | os.PathLike) -> list[dict]:
    """Read and validate a GenEval metadata file (official ``evaluation_metadata.jsonl`` or ours)."""
    return validate_metadata(read_jsonl(path, argument="metadata"), source=str(path))


def write_metadata(path: str | os.PathLike, rows: Sequence[dict]) -> Path:
    """Write metadata rows as JSON lines (atomically)."""
    return write_jsonl_atomic(path, validate_metadata(rows))


# ----------------------------------------------------------------------------------------------
# Detections and colour classification
# ----------------------------------------------------------------------------------------------


@dataclass
class Detections:
    """Objects found in one image.

    Attributes:
        boxes: [N, 4] (x0, y0, x1, y1) in pixels.
        labels: N class names (GenEval names; see ``LABEL_ALIASES``).
        scores: [N] confidences in [0, 1].
        masks: optional N boolean masks [H, W] (segmenting detectors); colour crops then use them.
        colors: optional N colour names, for detectors that know colours (skips the colour classifier).
    """

    boxes: np.ndarray
    labels: list[str]
    scores: np.ndarray
    masks: list[np.ndarray] | None = None
    colors: list[str] | None = None

    def __post_init__(self) -> None:
        self.boxes = np.asarray(self.boxes, dtype=np.float64).reshape(-1, 4)
        self.scores = np.asarray(self.scores, dtype=np.float64).reshape(-1)
        self.labels = [str(label) for label in self.labels]
        n = len(self.labels)
        if self.boxes.shape[0] != n or self.scores.shape[0] != n:
            raise ValueError(f"detections: {self.boxes.shape[0]} boxes, {n} labels and {self.scores.shape[0]} scores differ")
        for name in ("masks", "colors"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"detections: {len(value)} {name} for {n} objects")


def as_detections(value: Any) -> Detections:
    """Accept :class:`Detections` or a mapping with boxes/labels/scores (tensors, arrays or lists)."""
    if isinstance(value, Detections):
        return value
    if isinstance(value, dict) and {"boxes", "labels", "scores"} <= set(value):
        def arr(x):
            return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)

        return Detections(arr(value["boxes"]), list(value["labels"]), arr(value["scores"]),
                          value.get("masks"), value.get("colors"))
    raise TypeError(f"a detector must return Detections or a dict with boxes/labels/scores, got {type(value).__name__}")


def normalize_label(label: str) -> str:
    label = label.strip().lower().replace("_", " ")
    return LABEL_ALIASES.get(label, label)


class TransformersDetector:
    """A transformers object detector (DETR, Conditional/Deformable DETR, YOLOS, RT-DETR, ...) from a
    local folder, returning :class:`Detections` with GenEval class names."""

    def __init__(self, path: str | os.PathLike, device: str = "cpu"):
        from transformers import AutoImageProcessor, AutoModelForObjectDetection

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"detector: no such model folder: {path}")
        self.processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModelForObjectDetection.from_pretrained(str(path), local_files_only=True).to(device).eval()
        self.device = device
        self.id2label = {int(k): normalize_label(v) for k, v in self.model.config.id2label.items()}
        self.classes = set(self.id2label.values())

    def __call__(self, image: Image.Image) -> Detections:
        import torch

        image = image.convert("RGB")
        inputs = self.processor(images=image, return_tensors="pt").to(self.device)
        with torch.no_grad():
            outputs = self.model(**inputs)
        result = self.processor.post_process_object_detection(
            outputs, threshold=0.0, target_sizes=[(image.height, image.width)]
        )[0]
        labels = [self.id2label.get(int(i), str(int(i))) for i in result["labels"]]
        return Detections(result["boxes"].cpu().numpy(), labels, result["scores"].cpu().numpy())


class ShapesDetector:
    """The shapes world's exact parser (:func:`mmspec.world.evaluator.parse_image`) as a detector:
    labels are shape names, colours come with the detections, scores are template-match qualities."""

    classes = None  # set lazily to the world's shapes

    def __call__(self, image: Image.Image) -> Detections:
        from mmspec.world.evaluator import parse_image

        objects = parse_image(image)
        w, h = image.size
        boxes = [(o.bbox[0] * w, o.bbox[1] * h, o.bbox[2] * w, o.bbox[3] * h) for o in objects]
        return Detections(np.asarray(boxes).reshape(-1, 4), [o.shape for o in objects],
                          np.asarray([o.match for o in objects]), colors=[o.color for o in objects])


def _crop(image: Image.Image, box: np.ndarray, mask: np.ndarray | None, bgcolor: str) -> Image.Image:
    if mask is not None:
        if tuple(mask.shape) != (image.height, image.width):
            raise ValueError(f"detections: mask of shape {mask.shape} for an image of {image.width}x{image.height}")
        blank = Image.new("RGB", image.size, color=bgcolor)
        image = Image.composite(image, blank, Image.fromarray(mask.astype(np.uint8) * 255))
    x0, y0, x1, y1 = (float(v) for v in box)
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)
    return image.crop((x0, y0, x1, y1))


class CLIPColorClassifier:
    """GenEval's colour check: CLIP zero-shot classification of each detected object's crop.

    The classifier for a class averages the normalised text embeddings of three templates per colour
    ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object").
    """

    def __init__(self, scorer, colors: Sequence[str] = COCO_COLORS, bgcolor: str = "#999"):
        self.scorer = scorer  # a mmspec.evaluation.clip_score.CLIPScorer
        self.colors = list(colors)
        self.bgcolor = bgcolor
        self._weights: dict[str, Any] = {}

    def _classifier(self, classname: str):
        import torch

        if classname not in self._weights:
            rows = []
            for color in self.colors:
                texts = [f"a photo of a {color} {classname}", f"a photo of a {color}-colored {classname}",
                         f"a photo of a {color} object"]
                emb = self.scorer.embed_texts(texts).mean(0)
                rows.append(emb / emb.norm())
            self._weights[classname] = torch.stack(rows)  # [C, D]
        return self._weights[classname]

    def __call__(self, image: Image.Image, boxes: np.ndarray, classname: str,
                 masks: Sequence[np.ndarray | None] | None = None) -> list[str]:
        crops = [_crop(image, box, None if masks is None else masks[i], self.bgcolor) for i, box in enumerate(boxes)]
        logits = self.scorer.embed_images(crops) @ self._classifier(classname).T  # [N, C]
        return [self.colors[int(i)] for i in logits.argmax(-1)]


class NearestColorClassifier:
    """A transparent colour check for flat synthetic images: the median colour of the object's pixels
    (the mask, or the brighter half of the box), named by the nearest palette entry. Not GenEval's method (that is CLIP); useful
    for tests and for worlds of flat colours."""

    PALETTE = {"red": (220, 30, 30), "orange": (245, 135, 10), "yellow": (240, 230, 40), "green": (40, 180, 60),
               "blue": (40, 80, 240), "purple": (150, 60, 220), "pink": (245, 130, 190), "brown": (130, 80, 40),
               "black": (10, 10, 10), "white": (240, 240, 240)}

    def __init__(self, palette: dict[str, tuple[int, int, int]] | None = None):
        self.palette = dict(palette or self.PALETTE)
        self._names = list(self.palette)
        self._rgb = np.asarray([self.palette[n] for n in self._names], dtype=np.float64)

    def __call__(self, image: Image.Image, boxes: np.ndarray, classname: str, masks=None) -> list[str]:
        rgb = np.asarray(image.convert("RGB"), dtype=np.float64)  # [H, W, 3]
        out = []
        for i, box in enumerate(boxes):
            x0, y0 = max(int(np.floor(box[0])), 0), max(int(np.floor(box[1])), 0)
            x1, y1 = max(int(np.ceil(box[2])), x0 + 1), max(int(np.ceil(box[3])), y0 + 1)
            pixels = rgb[y0:y1, x0:x1].reshape(-1, 3)
            if masks is not None and masks[i] is not None:
                pixels = pixels[np.asarray(masks[i], bool)[y0:y1, x0:x1].reshape(-1)]
            else:  # no mask: the brighter half of the box (objects on a darker background)
                pixels = pixels[pixels.max(1) >= np.median(pixels.max(1))]
            if pixels.size == 0:
                out.append("unknown")
                continue
            color = np.median(pixels, axis=0)
            out.append(self._names[int(np.argmin(((self._rgb - color) ** 2).sum(1)))])
        return out


# ----------------------------------------------------------------------------------------------
# Scoring (the GenEval protocol)
# ----------------------------------------------------------------------------------------------


@dataclass
class GenEvalOptions:
    """GenEval's evaluation settings (its defaults)."""

    threshold: float = 0.3  # detection confidence for every category but counting
    counting_threshold: float = 0.9  # detection confidence for counting prompts
    max_objects: int = 16  # most confident detections kept per class
    nms_threshold: float = 1.0  # class-wise IoU suppression; 1.0 = off (GenEval's default)
    position_threshold: float = 0.1  # relation margin, fraction of the two boxes' summed sides


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def select_objects(det: Detections, tag: str, options: GenEvalOptions) -> dict[str, list[int]]:
    """Per class, indices of the kept detections, most confident first (threshold, top-k, optional NMS)."""
    threshold = options.counting_threshold if tag == "counting" else options.threshold
    out: dict[str, list[int]] = {}
    for label in sorted(set(det.labels)):
        idx = [i for i in np.argsort(-det.scores, kind="stable") if det.labels[i] == label and det.scores[i] > threshold]
        idx = idx[: options.max_objects]
        kept: list[int] = []
        for i in idx:
            if options.nms_threshold >= 1.0 or all(_iou(det.boxes[i], det.boxes[j]) < options.nms_threshold for j in kept):
                kept.append(int(i))
        if kept:
            out[label] = kept
    return out


def evaluate_detections(
    image: Image.Image,
    det: Detections,
    metadata: dict,
    color_classifier: Callable | None = None,
    options: GenEvalOptions | None = None,
) -> tuple[bool, str]:
    """Whether ``image`` with detections ``det`` satisfies a metadata row; returns (correct, reason).

    Include clauses: the ``count`` most confident detections of the class must exist; their colours
    (when required) must all be the requested one; each of them must stand in the requested relation to
    every object of the referenced clause. Exclude clauses fail when ``count`` or more are present.
    """
    from mmspec.world.scene import relations_between

    options = options or GenEvalOptions()
    objects = select_objects(det, metadata["tag"], options)
    correct, reasons = True, []
    groups: list[list[int] | None] = []
    for clause in metadata["include"]:
        name, count = clause["class"], int(clause.get("count", 1))
        found = objects.get(name, [])[:count]
        ok = True
        if len(found) < count:
            ok = False
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in clause:
                if det.colors is not None:
                    colors = [det.colors[i] for i in found]
                elif color_classifier is not None:
                    masks = None if det.masks is None else [det.masks[i] for i in found]
                    colors = color_classifier(image, det.boxes[found], name, masks)
                else:
                    raise ValueError("color_classifier: colour prompts need a colour classifier (or detections with colours)")
                if colors.count(clause["color"]) < count:
                    ok = False
                    reasons.append(f"expected {clause['color']} {name}>={count}, found colours {colors}")
            if "position" in clause and ok:
                relation, target = clause["position"]
                if groups[target] is None:
                    ok = False
                    reasons.append(f"no target for {name} to be {relation}")
                else:
                    for i in found:
                        for j in groups[target]:
                            rel = relations_between(det.boxes[i], det.boxes[j], options.position_threshold)
                            if relation not in rel:
                                ok = False
                                reasons.append(f"expected {name} {relation} target, found {' and '.join(sorted(rel)) or 'no relation'}")
                                break
                        if not ok:
                            break
        groups.append(found if ok else None)
        correct = correct and ok
    for clause in metadata.get("exclude", []):
        name, count = clause["class"], int(clause.get("count", 1))
        if len(objects.get(name, [])) >= count:
            correct = False
            reasons.append(f"expected {name}<{count}, found {len(objects[name])}")
    return correct, "; ".join(reasons)


def score_shapes_image(image: Image.Image, metadata: dict) -> tuple[bool, str, list[dict]]:
    """Shapes world: parse the image exactly and apply the world's GenEval rules.

    Returns (correct, reason, parsed objects as dicts).
    """
    from mmspec.world.evaluator import is_valid_scene, parse_image
    from mmspec.world.prompts import prompt_satisfied

    prompt = metadata_to_shapes_prompt(metadata)
    objects = parse_image(image)
    correct = is_valid_scene(objects) and prompt_satisfied(prompt, objects)  # noise satisfies no prompt
    found = ", ".join(f"{o.color} {o.shape}" for o in objects) or "nothing"
    details = [{"shape": o.shape, "color": o.color, "size": o.size, "bbox": [round(v, 4) for v in o.bbox]} for o in objects]
    return correct, "" if correct else f"expected {prompt.text!r}, found {found}", details


# ----------------------------------------------------------------------------------------------
# Image folders: generation and evaluation
# ----------------------------------------------------------------------------------------------


def generate_images(
    generate: Callable[[str, int, int], Sequence[Image.Image]],
    metadata: Sequence[dict],
    outdir: str | os.PathLike,
    images_per_prompt: int = 4,
    seed: int = 0,
    progress: bool = True,
    overwrite: bool = False,
) -> list[int]:
    """Generate images for every prompt into the GenEval layout, this process's shard only.

    Args:
        generate: ``generate(prompt, num_images, seed) -> list of PIL images``; the seed of prompt i is
            ``seed + i`` whatever the sharding, so results do not depend on the number of processes.
        metadata: validated metadata rows (:func:`load_metadata`).
        outdir: output folder; ``<i:05d>/samples/<k:04d>.png`` and ``<i:05d>/metadata.jsonl``.
        images_per_prompt: images per prompt (GenEval uses 4).
        overwrite: regenerate prompt folders that are already complete.

    Each image is written atomically and a prompt folder's ``metadata.jsonl`` is written last, so a
    folder without it is incomplete (an interrupted run) and is regenerated on the next call. Runs
    under ``accelerate launch`` / torchrun shard the prompts (see :mod:`.distributed`).
    Returns the prompt indices this process handled.
    """
    metadata = validate_metadata(list(metadata))
    if images_per_prompt < 1:
        raise ValueError(f"images_per_prompt must be >= 1, got {images_per_prompt}")
    outdir = Path(outdir)
    mine = shard_indices(len(metadata))
    index, count = process_index_and_count()
    iterator = mine
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(mine, desc=f"generate [{index + 1}/{count}]", unit="prompt", position=index)
    for i in iterator:
        folder = outdir / f"{i:05d}"
        if (folder / "metadata.jsonl").is_file() and not overwrite:
            continue
        images = list(generate(metadata[i]["prompt"], images_per_prompt, seed + i))
        if len(images) != images_per_prompt or not all(isinstance(im, Image.Image) for im in images):
            raise ValueError(f"generate returned {len(images)} items for prompt {i}; expected {images_per_prompt} PIL images")
        for k, image in enumerate(images):
            save_image_atomic(image, folder / "samples" / f"{k:04d}.png")
        write_text_atomic(folder / "metadata.jsonl", json.dumps(metadata[i]) + "\n")
    return mine


def shapes_ground_truth_generator(image_size: int = 32, difficulty: float = 1.0) -> Callable[[str, int, int], list[Image.Image]]:
    """A ``generate`` callable for :func:`generate_images` that renders scenes satisfying shapes prompts
    (the world's ground truth: the reference a perfect generator would reach)."""
    from mmspec.world.prompts import enumerate_prompts, scene_for_prompt
    from mmspec.world.render import render_scene

    by_text = {p.text: p for c in CATEGORIES for p in enumerate_prompts(c)}

    def generate(prompt: str, num_images: int, seed: int) -> list[Image.Image]:
        if prompt not in by_text:
            raise ValueError(f"not a shapes-world prompt: {prompt!r}")
        rng = np.random.default_rng([seed, 97])
        return [Image.fromarray(render_scene(scene_for_prompt(by_text[prompt], rng), image_size, difficulty))
                for _ in range(num_images)]

    return generate


def _prompt_folders(image_dir: Path) -> list[Path]:
    if not image_dir.is_dir():
        raise FileNotFoundError(f"image_dir: no such folder: {image_dir}")
    folders = sorted(p for p in image_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if not folders:
        raise ValueError(f"image_dir: {image_dir} has no prompt folders (<index>/metadata.jsonl + samples/)")
    return folders


def evaluate_folder(
    image_dir: str | os.PathLike,
    detector: Callable[[Image.Image], Any] | None = None,
    color_classifier: Callable | None = None,
    options: GenEvalOptions | None = None,
    progress: bool = True,
) -> list[dict]:
    """Score every image of a GenEval-layout folder; one result row per image.

    Rows of the shapes world (``"world": "shapes"``) are scored by the exact evaluator; COCO rows by
    ``detector`` (+ ``color_classifier`` for colour prompts) with the GenEval rules.
    """
    image_dir = Path(image_dir)
    folders = _prompt_folders(image_dir)
    jobs = []
    for folder in folders:
        meta_path = folder / "metadata.jsonl"
        if not meta_path.is_file():
            raise ValueError(f"image_dir: {folder} has no metadata.jsonl (an incomplete generation? re-run it)")
        rows = validate_metadata(read_jsonl(meta_path, argument="image_dir"), source=str(meta_path))
        samples = folder / "samples"
        images = sorted(p for p in samples.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS) if samples.is_dir() else []
        if not images:
            raise ValueError(f"image_dir: {folder} has no images in samples/")
        jobs += [(path, rows[0]) for path in images]
    needs_detector = [m for _, m in jobs if m.get("world", "coco") == "coco"]
    if needs_detector:
        if detector is None:
            raise ValueError("detector: COCO prompts need an object detector (e.g. TransformersDetector(path))")
        classes = getattr(detector, "classes", None)
        if classes is not None:
            wanted = {c["class"] for m in needs_detector for k in ("include", "exclude") for c in m.get(k, [])}
            unknown = sorted(wanted - set(classes))
            if unknown:
                raise ValueError(f"detector: the prompts need classes the detector does not know: {unknown[:10]}")
        if color_classifier is None and any("color" in c for m in needs_detector for c in m["include"]):
            raise ValueError("color_classifier: colour prompts need a colour classifier (e.g. CLIPColorClassifier)")
    if progress:
        from tqdm.auto import tqdm

        jobs = tqdm(jobs, desc="GenEval", unit="img")
    results = []
    for path, meta in jobs:
        image = open_rgb(path)
        if meta.get("world") == "shapes":
            correct, reason, details = score_shapes_image(image, meta)
        else:
            det = as_detections(detector(image))
            det.labels = [normalize_label(label) for label in det.labels]
            correct, reason = evaluate_detections(image, det, meta, color_classifier, options)
            details = {label: [det.boxes[i].round(1).tolist() + [round(float(det.scores[i]), 4)] for i in idx]
                       for label, idx in select_objects(det, meta["tag"], options or GenEvalOptions()).items()}
        results.append({"filename": str(path), "tag": meta["tag"], "prompt": meta["prompt"], "correct": bool(correct),
                        "reason": reason, "metadata": json.dumps(meta), "details": json.dumps(details)})
    return results


# ----------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------


@dataclass
class GenEvalReport:
    """Per-category accuracy (fraction of correct images), the overall score and counts."""

    per_category: dict[str, dict[str, float]]  # tag -> {"accuracy", "correct", "total"}
    overall: float  # mean of the category accuracies
    num_images: int
    num_prompts: int
    prompt_accuracy: float  # fraction of prompts with at least one correct image
    complete: bool  # all six categories present
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, path: str | os.PathLike) -> Path:
        return write_json_atomic(path, self.to_dict())

    def to_markdown(self) -> str:
        lines = ["| category | accuracy | correct / images |", "|---|---|---|"]
        for tag in CATEGORIES:
            if tag in self.per_category:
                c = self.per_category[tag]
                lines.append(f"| {tag} | {c['accuracy']:.4f} | {int(c['correct'])} / {int(c['total'])} |")
            else:
                lines.append(f"| {tag} | - | 0 / 0 |")
        note = "" if self.complete else " (not all six categories present)"
        lines.append(f"| **overall** (mean of categories){note} | **{self.overall:.4f}** | "
                     f"{self.num_images} images, {self.num_prompts} distinct prompts |")
        return "\n".join(lines) + "\n"


def summarize(results: Sequence[dict], meta: dict | None = None) -> GenEvalReport:
    """GenEval's summary of per-image results (rows of :func:`evaluate_folder` or of GenEval's
    ``results.jsonl``)."""
    if not results:
        raise ValueError("results: no rows to summarise")
    per: dict[str, list[bool]] = {}
    by_prompt: dict[str, bool] = {}
    for number, row in enumerate(results, start=1):
        tag = row.get("tag")
        if tag not in CATEGORIES:
            raise ValueError(f"results: row {number} has unknown category (tag) {tag!r}")
        per.setdefault(tag, []).append(bool(row["correct"]))
        key = row.get("metadata") or row.get("prompt")
        by_prompt[key] = by_prompt.get(key, False) or bool(row["correct"])
    per_category = {tag: {"accuracy": sum(v) / len(v), "correct": sum(v), "total": len(v)}
                    for tag in CATEGORIES if (v := per.get(tag))}
    overall = float(np.mean([c["accuracy"] for c in per_category.values()]))
    return GenEvalReport(per_category, overall, len(results), len(by_prompt),
                         sum(by_prompt.values()) / len(by_prompt), set(per_category) == set(CATEGORIES), dict(meta or {}))


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _pipeline_generator(pipeline: str, method: str, device: str, kwargs: dict):
    try:
        from mmspec.pipelines import ARImagePipeline
    except ImportError as err:
        raise NotImplementedError(
            "generate --pipeline needs mmspec.pipelines.ARImagePipeline, which this installation does not "
            f"provide ({err}); use the Python API generate_images(your_callable, ...) instead"
        ) from err
    import torch

    pipe = ARImagePipeline.from_pretrained(pipeline)
    if hasattr(pipe, "to"):
        pipe = pipe.to(device)

    def generate(prompt: str, num_images: int, seed: int) -> list[Image.Image]:
        images = []
        for k in range(num_images):
            out = pipe(prompt, method=method, generator=torch.Generator().manual_seed(seed * 1000 + k), **kwargs)
            images.append(out.images[0])
        return images

    return generate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mmspec.evaluation.geneval",
                                     description="GenEval protocol: prompt files, generation, evaluation, summary.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prompts", help="write a GenEval metadata file (jsonl)")
    p.add_argument("--world", choices=("coco", "shapes"), default="coco")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=None, help="coco: 43 (GenEval's); shapes: 0")
    p.add_argument("--n-per-category", type=positive_int_argument, default=100,
                   help="coco: draws per task (GenEval: 100); shapes: prompts per category")

    g = sub.add_parser("generate", help="generate images into the GenEval layout (shards under accelerate launch)")
    g.add_argument("--metadata", default=None, help="metadata file (default: the world's prompt set)")
    g.add_argument("--world", choices=("coco", "shapes"), default="shapes")
    g.add_argument("--outdir", required=True)
    g.add_argument("--images-per-prompt", type=positive_int_argument, default=None, help="default: 1 for shapes, 4 for coco")
    g.add_argument("--seed", type=int, default=0)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--ground-truth", action="store_true", help="shapes: render scenes that satisfy the prompts")
    src.add_argument("--pipeline", help="pipeline id or path (mmspec.pipelines.ARImagePipeline)")
    g.add_argument("--method", default="none", help="decoding method of the pipeline")
    g.add_argument("--image-size", type=int, default=32, help="--ground-truth: image side")
    g.add_argument("--difficulty", type=float, default=1.0, help="--ground-truth: render difficulty")
    g.add_argument("--device", default="cpu")
    g.add_argument("--no-progress", action="store_true")

    e = sub.add_parser("evaluate", help="score a GenEval-layout image folder")
    e.add_argument("image_dir")
    e.add_argument("--out", required=True, help="per-image results (jsonl)")
    e.add_argument("--summary", default=None, help="also write the summary as JSON here")
    e.add_argument("--detector", default=None, help="COCO: folder of a transformers object detector")
    e.add_argument("--clip-model", default="ViT-L-14", help="COCO colour classifier (open_clip architecture)")
    e.add_argument("--clip-pretrained", default=None, help="COCO colour classifier weights (local file)")
    e.add_argument("--threshold", type=float, default=GenEvalOptions.threshold)
    e.add_argument("--counting-threshold", type=float, default=GenEvalOptions.counting_threshold)
    e.add_argument("--device", default="cpu")
    e.add_argument("--no-progress", action="store_true")

    s = sub.add_parser("summary", help="print the per-category table of a results file")
    s.add_argument("results")
    s.add_argument("--json", default=None, help="also write the summary as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "prompts":
        if args.world == "coco":
            rows = generate_coco_metadata(OFFICIAL_SEED if args.seed is None else args.seed, args.n_per_category)
        else:
            rows = generate_shapes_metadata(args.n_per_category, 0 if args.seed is None else args.seed)
        write_metadata(args.out, rows)
        counts = {t: sum(r["tag"] == t for r in rows) for t in CATEGORIES}
        print(f"wrote {len(rows)} prompts to {args.out}: " + ", ".join(f"{t} {n}" for t, n in counts.items()))
        return 0
    if args.command == "generate":
        if args.metadata:
            rows = load_metadata(args.metadata)
        elif args.world == "shapes":
            rows = generate_shapes_metadata()
        else:
            rows = generate_coco_metadata()
        per_prompt = args.images_per_prompt or (1 if args.world == "shapes" else 4)
        if args.ground_truth:
            if any(r.get("world") != "shapes" for r in rows):
                parser.error("--ground-truth renders shapes-world prompts only")
            generate = shapes_ground_truth_generator(args.image_size, args.difficulty)
        else:
            generate = _pipeline_generator(args.pipeline, args.method, args.device, {})
        done = generate_images(generate, rows, args.outdir, per_prompt, args.seed, progress=not args.no_progress)
        print(f"generated {len(done)} prompts x {per_prompt} images into {args.outdir}")
        return 0
    if args.command == "evaluate":
        detector = color = None
        if args.detector:
            detector = TransformersDetector(args.detector, args.device)
        if args.clip_pretrained:
            from .clip_score import CLIPScorer

            color = CLIPColorClassifier(CLIPScorer(args.clip_model, args.clip_pretrained, args.device))
        options = GenEvalOptions(threshold=args.threshold, counting_threshold=args.counting_threshold)
        results = evaluate_folder(args.image_dir, detector, color, options, progress=not args.no_progress)
        write_jsonl_atomic(args.out, results)
        report = summarize(results, {"image_dir": str(args.image_dir), "detector": args.detector,
                                     "clip": [args.clip_model, args.clip_pretrained]})
        print(report.to_markdown())
        if args.summary:
            report.to_json(args.summary)
        return 0
    rows = read_jsonl(args.results, argument="results")
    report = summarize(rows, {"results": str(args.results)})
    print(report.to_markdown())
    if args.json:
        report.to_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
