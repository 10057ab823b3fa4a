"""What the generation pipelines share about their conditions: word prompts, class labels and the word
vocabulary.

The image and video pipelines (:mod:`.ar_image`, :mod:`.continuous_ar_image`, :mod:`.ar_video`) condition
their targets on word prompts (a :class:`~mmspec.models.text.WordTokenizer`, the pipeline's ``text_tokenizer``
component, saved in ``text_tokenizer/``) or on class ids. The checks and the vocabulary handling live here
once, so the three pipelines accept the same inputs and raise the same errors:

* :func:`check_condition`: exactly one of ``prompt`` and ``class_labels``, the one the transformer reads;
* :func:`as_prompt_list`: a prompt or a non-empty list of prompts -> a list;
* :func:`condition_rows`: a call's outputs as single-output conditions (for per-output generators);
* :func:`check_word_prompts`: every prompt encodes with the pipeline's word vocabulary and has words;
* :func:`check_class_labels`: an int or a non-empty list of ints in ``[0, num_classes)``;
* :func:`check_text_tokenizer_size`: the vocabulary fits the target's word table;
* :func:`load_legacy_text_tokenizer`: the one place that reads a folder saved before the vocabulary was a
  component (``transformer/text_vocab.json``);
* :class:`WordVocabularyMixin`: a pipeline's ``text_tokenizer`` component (kept after the size check, prompts
  checked against it), and where a folder without one gets it from;
* :func:`images_for_output_type`: decoded pixels -> the ``output_type`` a caller asked for.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline

from mmspec.models.text import WordTokenizer
from mmspec.pipelines.pretrained import is_saveable_component

LEGACY_TEXT_VOCAB_FILE = "transformer/text_vocab.json"  # where folders saved before the component kept the vocabulary


# -- the word vocabulary --------------------------------------------------------------------------------------


def load_legacy_text_tokenizer(folder: str | os.PathLike) -> WordTokenizer | None:
    """The word vocabulary of a pipeline folder saved before it was a component (``transformer/text_vocab.json``,
    converted to a :class:`~mmspec.models.text.WordTokenizer`); None when the folder has no such file."""
    vocab_file = Path(folder) / LEGACY_TEXT_VOCAB_FILE
    return WordTokenizer.load(vocab_file) if vocab_file.is_file() else None


class WordVocabularyMixin:
    """For a :class:`~diffusers.DiffusionPipeline` whose optional ``text_tokenizer`` component is its word
    vocabulary (a :class:`~mmspec.models.text.WordTokenizer`, saved in ``text_tokenizer/`` like any component)
    or another prompt tokenizer with ``encode``, ``batch`` and ``len`` (e.g. Janus's, which diffusers cannot
    save: it is saved beside the transformer by its own ``save`` and comes back through the transformer's
    ``load_text_tokenizer`` hook). List the mixin before ``DiffusionPipeline`` in the bases."""

    text_tokenizer: Any

    def _set_text_tokenizer(self, text_tokenizer: Any, text_vocab_size: int | None) -> None:
        """Register ``text_tokenizer`` after checking that it fits the target's word table (``text_vocab_size``
        rows; None: the target has none to check against)."""
        check_text_tokenizer_size(text_tokenizer, text_vocab_size)
        self.register_modules(text_tokenizer=text_tokenizer)  # type: ignore[attr-defined]

    def _check_word_prompts(self, texts: Sequence[str]) -> None:
        """:func:`check_word_prompts` against this pipeline's word vocabulary."""
        check_word_prompts(texts, self.text_tokenizer)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """diffusers' folder layout (``model_index.json`` + one folder per component, the word vocabulary in
        ``text_tokenizer/``); a prompt tokenizer diffusers cannot save is written by its own ``save`` into the
        transformer's folder instead."""
        tokenizer = self.text_tokenizer
        if tokenizer is None or is_saveable_component(tokenizer):
            super().save_pretrained(save_directory, **kwargs)  # type: ignore[misc]
            return
        entry = self.config["text_tokenizer"]  # type: ignore[attr-defined]
        self.register_to_config(text_tokenizer=(None, None))  # type: ignore[attr-defined]
        try:
            super().save_pretrained(save_directory, **kwargs)  # type: ignore[misc]
        finally:
            self.register_to_config(text_tokenizer=tuple(entry))  # type: ignore[attr-defined]
        tokenizer.save(Path(save_directory) / LEGACY_TEXT_VOCAB_FILE)

    @classmethod
    def _fallback_component(cls, name: str, folder: Path, components: dict[str, Any]) -> Any:
        """A folder without a ``text_tokenizer`` component: its ``transformer/text_vocab.json`` (an older folder,
        converted), else the transformer's ``load_text_tokenizer`` hook (Janus: an HF tokenizer saved beside the
        model), else None."""
        if name != "text_tokenizer":
            return super()._fallback_component(name, folder, components)  # type: ignore[misc]
        legacy = load_legacy_text_tokenizer(folder)
        if legacy is not None:
            return legacy
        hook = getattr(components.get("transformer"), "load_text_tokenizer", None)
        return hook(folder / "transformer") if callable(hook) else None


def check_text_tokenizer_size(text_tokenizer: Any, text_vocab_size: int | None) -> None:
    """A word vocabulary must fit the target's word table (``text_vocab_size`` rows; None: nothing to check)."""
    if text_tokenizer is not None and text_vocab_size is not None and len(text_tokenizer) > text_vocab_size:
        raise ValueError(f"text_tokenizer has {len(text_tokenizer)} words but the transformer embeds {text_vocab_size}")


# -- prompts and class labels ---------------------------------------------------------------------------------


def check_condition(prompt: Any, class_labels: Any, text_conditioned: bool,
                    kinds: tuple[str, str] = ("text-conditioned", "class-conditioned")) -> None:
    """Exactly one of ``prompt`` and ``class_labels`` must be given: the prompt for a text-conditioned
    transformer, class labels for a class-conditioned one. ``kinds`` names the two kinds in the errors."""
    if (prompt is None) == (class_labels is None):
        raise ValueError("pass exactly one of prompt (text-conditioned models) and class_labels (class-conditioned "
                         "models)")
    if prompt is not None and not text_conditioned:
        raise ValueError(f"this transformer is {kinds[1]}: pass class_labels, not prompt")
    if class_labels is not None and text_conditioned:
        raise ValueError(f"this transformer is {kinds[0]}: pass prompt, not class_labels")


def as_prompt_list(prompt: Any, kinds: tuple[type, ...] = (str,),
                   description: str = "a string or a list of strings") -> list[Any]:
    """``prompt`` as a non-empty list: one item of ``kinds`` becomes ``[prompt]``; a list must hold only
    ``kinds``. ``description`` names the accepted forms in the error message."""
    prompts = [prompt] if isinstance(prompt, kinds) else prompt
    if not isinstance(prompts, list) or not all(isinstance(p, kinds) for p in prompts):
        raise ValueError(f"prompt must be {description}, got {type(prompt).__name__}")
    if not prompts:
        raise ValueError("prompt is an empty list")
    return prompts


def condition_rows(prompt: Any, class_labels: Any, num_per_prompt: int) -> list[dict[str, Any]]:
    """A call's outputs as single-output conditions, in output order (``prompt0 x n, prompt1 x n, ...``):
    ``{"prompt": text}`` or ``{"class_labels": [label]}`` each (for calls decoded output by output)."""
    if prompt is not None:
        items = [prompt] if isinstance(prompt, str) else list(prompt)
        return [{"prompt": text} for text in items for _ in range(num_per_prompt)]
    labels = torch.as_tensor(class_labels).reshape(-1).tolist()
    return [{"class_labels": [label]} for label in labels for _ in range(num_per_prompt)]


def check_word_prompts(texts: Sequence[str], text_tokenizer: Any) -> None:
    """Every prompt must encode with the pipeline's word vocabulary and have at least one word; the
    errors name the prompt's index (unknown words, empty prompts, or no vocabulary at all)."""
    if text_tokenizer is None:
        raise ValueError("this pipeline has no word vocabulary (its text_tokenizer component, saved in "
                         "text_tokenizer/), so prompts cannot be encoded")
    for i, text in enumerate(texts):
        try:
            words = text_tokenizer.encode(text)
        except ValueError as error:
            raise ValueError(f"prompt {i} ({text!r}): {error}") from None
        if not words:
            raise ValueError(f"prompt {i} is empty (no words)")


def check_class_labels(class_labels: Any, num_classes: int) -> None:
    """``class_labels`` must be an int, a non-empty list of ints (or a 0-/1-D integer tensor) in
    ``[0, num_classes)``."""
    labels = torch.as_tensor(class_labels)
    if labels.is_floating_point() or labels.dtype == torch.bool or labels.ndim > 1 or labels.numel() == 0:
        raise ValueError(f"class_labels must be an int or a non-empty list of ints, got {class_labels!r}")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"class_labels must be in [0, {num_classes}), got {labels.tolist()}")


# -- outputs --------------------------------------------------------------------------------------------------


def images_for_output_type(pixels: torch.Tensor, output_type: str
                           ) -> list[PIL.Image.Image] | np.ndarray | torch.Tensor:
    """Decoded images ``[B, 3, H, W]`` in [0, 1] as the caller asked: the tensor itself ("pt"), a float32
    array ``[B, H, W, 3]`` ("np") or a list of PIL images ("pil")."""
    if output_type == "pt":
        return pixels
    images = pixels.permute(0, 2, 3, 1).cpu().numpy()
    return DiffusionPipeline.numpy_to_pil(images) if output_type == "pil" else images
