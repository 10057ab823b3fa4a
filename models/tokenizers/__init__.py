"""Image tokenizers of the shapes world: discrete (VQ, k-means codebook) and continuous (patch AE).

Both share one interface (images are float [B, 3, H, W] in [0, 1]; one token per 4x4 patch):
``encode(images)`` -> token grid ([B, h, w] ids for VQ, [B, h, w, d] latents for the continuous one),
``decode(grid)`` -> images, ``save_pretrained`` / ``from_pretrained`` (diffusers ModelMixin,
safetensors). Trained weights ship in ``mmspec/models/zoo/tokenizers/{vq,continuous}`` (recipe:
``python -m mmspec.models.recipes.train_tokenizers --out models/zoo/tokenizers``; the autoencoder's training
loop is :mod:`mmspec.models.recipes.autoencoder_training`).

This package is the component library a pipeline's ``model_index.json`` names for both tokenizers
(``["mmspec.models.tokenizers", "VQTokenizer"]``): diffusers' loader looks a component's class *and* the
loadable base class it derives from (``ModelMixin``) up on the library it names, so the package exports both.
"""

from __future__ import annotations

from pathlib import Path

from diffusers import ModelMixin

from .base import PatchTokenizerMixin
from .continuous import ContinuousTokenizer
from .vq import VQTokenizer, kmeans

ZOO_DIR = Path(__file__).resolve().parent.parent / "zoo" / "tokenizers"
_KINDS = {"vq": VQTokenizer, "continuous": ContinuousTokenizer}


def zoo_tokenizer_path(kind: str) -> Path:
    """Folder of the bundled tokenizer ``kind`` ("vq" or "continuous")."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {list(_KINDS)}, got {kind!r}")
    return ZOO_DIR / kind


def load_zoo_tokenizer(kind: str) -> VQTokenizer | ContinuousTokenizer:
    """The bundled, trained tokenizer ``kind`` ("vq" or "continuous"), in eval mode on CPU."""
    path = zoo_tokenizer_path(kind)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled {kind} tokenizer is missing at {path}; train it with "
            "`python -m mmspec.models.recipes.train_tokenizers --out models/zoo/tokenizers`"
        )
    return _KINDS[kind].from_pretrained(str(path))


__all__ = [
    "ContinuousTokenizer",
    "ModelMixin",
    "PatchTokenizerMixin",
    "VQTokenizer",
    "ZOO_DIR",
    "kmeans",
    "load_zoo_tokenizer",
    "zoo_tokenizer_path",
]
