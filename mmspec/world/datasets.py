"""Torch datasets of the shapes world: images + texts and videos + texts, indexable or streaming.

Every sample is a pure function of (split, seed, index): ``ShapesImageDataset(n, seed)[i]`` is the same
on every machine and in every worker, and ``ShapesImageStream(seed)`` yields the same samples as the
indexable dataset of the same seed and split, in index order (worker w of W takes indices w, w + W,
...). Items are dicts of tensors and strings, so the default ``DataLoader`` collation works.

Image items: ``image`` float [3, H, W] in [0, 1]; ``caption`` (a GenEval-template prompt for the six
categories, or the complete short caption for category "scene"); ``category``; ``description``
(detailed, long); ``question`` / ``answer`` (one balanced QA pair); ``index``.
Video items: ``frames`` float [T, 3, H, W] in [0, 1]; ``caption`` ("a red circle moving right ...");
``narration`` (long); ``index``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from .captions import caption_scene, describe_scene, sample_qa
from .prompts import CATEGORIES, sample_prompt, scene_for_prompt
from .render import check_difficulty, check_image_size, render_scene, to_tensor
from .scene import Scene, rng_for, sample_scene
from .video import (
    MAX_VIDEO_OBJECTS,
    VideoClip,
    caption_video,
    check_num_frames,
    narrate_video,
    render_video,
    sample_video,
)

SPLITS = ("train", "val", "test")
SCENE_CATEGORIES: tuple[str, ...] = CATEGORIES + ("scene",)


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    return split


def _check_len(num_samples: int) -> int:
    if not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    return int(num_samples)


def _check_seed(seed: int) -> int:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def _check_index(index: int, length: int) -> int:
    if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
        raise ValueError(f"index must be an integer, got {index!r}")
    if index < 0:
        index += length
    if not 0 <= index < length:
        raise IndexError(f"index {index} out of range for a dataset of {length}")
    return int(index)


@dataclass(frozen=True)
class ImageSample:
    """The structured form of an image item (what ``dataset.sample(i)`` returns)."""

    scene: Scene
    caption: str
    category: str


class _ImageSource:
    """Shared sampling logic of the image dataset and stream."""

    def __init__(self, seed: int, split: str, image_size: int, difficulty: float,
                 categories: Mapping[str, float] | None, texts: bool) -> None:
        self.seed = _check_seed(seed)
        self.split = _check_split(split)
        self.image_size = check_image_size(image_size)
        self.difficulty = check_difficulty(difficulty)
        weights = dict(categories) if categories is not None else {c: 1.0 for c in SCENE_CATEGORIES}
        for name, w in weights.items():
            if name not in SCENE_CATEGORIES:
                raise ValueError(f"categories keys must be among {list(SCENE_CATEGORIES)}, got {name!r}")
            if not isinstance(w, (int, float)) or w < 0:
                raise ValueError(f"category weight of {name!r} must be a non-negative number, got {w!r}")
        total = float(sum(weights.values()))
        if total <= 0:
            raise ValueError("categories must give at least one category a positive weight")
        self.category_names = list(weights)
        self.category_cdf = np.cumsum([weights[c] / total for c in self.category_names])
        self.texts = bool(texts)

    def sample(self, index: int) -> ImageSample:
        rng = rng_for(self.split, self.seed, index)
        u = rng.uniform()
        category = self.category_names[min(int(np.searchsorted(self.category_cdf, u, side="right")), len(self.category_names) - 1)]
        if category == "scene":
            scene = sample_scene(rng)
            return ImageSample(scene, caption_scene(scene), category)
        prompt = sample_prompt(category, rng)
        return ImageSample(scene_for_prompt(prompt, rng), prompt.text, category)

    def item(self, index: int) -> dict:
        s = self.sample(index)
        out = {
            "image": to_tensor(render_scene(s.scene, self.image_size, self.difficulty)),
            "caption": s.caption,
            "category": s.category,
            "index": index,
        }
        if self.texts:
            q, a = sample_qa(s.scene, rng_for(self.split, self.seed, index).spawn(1)[0])
            out.update(description=describe_scene(s.scene), question=q, answer=a)
        return out


class ShapesImageDataset(Dataset):
    """``num_samples`` images with texts, deterministic per index.

    Args:
        num_samples: dataset length.
        seed: base seed; ``split`` ("train", "val", "test") selects an independent stream.
        image_size: 32-256 pixels. difficulty: 0-2 (see :mod:`mmspec.world.render`).
        categories: sampling weights over the six GenEval categories and "scene" (random 1-4 objects
            with a complete caption); default uniform over all seven.
        texts: also compute ``description``, ``question`` and ``answer`` (set False to save time when
            only captions are needed).
    """

    def __init__(self, num_samples: int, seed: int = 0, split: str = "train", image_size: int = 32,
                 difficulty: float = 1.0, categories: Mapping[str, float] | None = None, texts: bool = True) -> None:
        self.num_samples = _check_len(num_samples)
        self.source = _ImageSource(seed, split, image_size, difficulty, categories, texts)

    def __len__(self) -> int:
        return self.num_samples

    def _check_index(self, index: int) -> int:
        return _check_index(index, self.num_samples)

    def sample(self, index: int) -> ImageSample:
        """The scene, caption and category of item ``index`` (no rendering)."""
        return self.source.sample(self._check_index(index))

    def __getitem__(self, index: int) -> dict:
        return self.source.item(self._check_index(index))


class _Stream(IterableDataset):
    def __init__(self, start: int) -> None:
        if not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"start must be a non-negative integer, got {start!r}")
        self.start = int(start)

    def _indices(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        i = self.start + worker
        while True:
            yield i
            i += workers


class ShapesImageStream(_Stream):
    """Unlimited image samples (same items as :class:`ShapesImageDataset` with the same arguments,
    from index ``start`` on); the worker-sharded order is index order within each worker."""

    def __init__(self, seed: int = 0, split: str = "train", image_size: int = 32, difficulty: float = 1.0,
                 categories: Mapping[str, float] | None = None, texts: bool = True, start: int = 0) -> None:
        super().__init__(start)
        self.source = _ImageSource(seed, split, image_size, difficulty, categories, texts)

    def __iter__(self) -> Iterator[dict]:
        for i in self._indices():
            yield self.source.item(i)


class _VideoSource:
    def __init__(self, seed: int, split: str, image_size: int, difficulty: float, num_frames: int,
                 max_objects: int) -> None:
        self.seed = _check_seed(seed)
        self.split = _check_split(split)
        self.image_size = check_image_size(image_size)
        self.difficulty = check_difficulty(difficulty)
        self.num_frames = check_num_frames(num_frames)
        if not isinstance(max_objects, int) or not 1 <= max_objects <= MAX_VIDEO_OBJECTS:
            raise ValueError(f"max_objects must be an integer in [1, {MAX_VIDEO_OBJECTS}], got {max_objects!r}")
        self.max_objects = max_objects

    def sample(self, index: int) -> VideoClip:
        rng = rng_for(self.split, self.seed, index)
        return sample_video(rng, int(rng.integers(1, self.max_objects + 1)), self.num_frames)

    def item(self, index: int) -> dict:
        clip = self.sample(index)
        frames = torch.from_numpy(render_video(clip, self.image_size, self.difficulty)).float().div_(255.0)
        return {
            "frames": frames.permute(0, 3, 1, 2).contiguous(),  # [T, 3, H, W]
            "caption": caption_video(clip),
            "narration": narrate_video(clip),
            "index": index,
        }


class ShapesVideoDataset(Dataset):
    """``num_samples`` clips of 1..``max_objects`` moving shapes with captions and narrations."""

    def __init__(self, num_samples: int, seed: int = 0, split: str = "train", image_size: int = 32,
                 difficulty: float = 1.0, num_frames: int = 8, max_objects: int = 2) -> None:
        self.num_samples = _check_len(num_samples)
        self.source = _VideoSource(seed, split, image_size, difficulty, num_frames, max_objects)

    def __len__(self) -> int:
        return self.num_samples

    def _check_index(self, index: int) -> int:
        return _check_index(index, self.num_samples)

    def sample(self, index: int) -> VideoClip:
        return self.source.sample(self._check_index(index))

    def __getitem__(self, index: int) -> dict:
        return self.source.item(self._check_index(index))


class ShapesVideoStream(_Stream):
    """Unlimited clips (same items as :class:`ShapesVideoDataset` with the same arguments)."""

    def __init__(self, seed: int = 0, split: str = "train", image_size: int = 32, difficulty: float = 1.0,
                 num_frames: int = 8, max_objects: int = 2, start: int = 0) -> None:
        super().__init__(start)
        self.source = _VideoSource(seed, split, image_size, difficulty, num_frames, max_objects)

    def __iter__(self) -> Iterator[dict]:
        for i in self._indices():
            yield self.source.item(i)
