"""What the generation pipelines share about their conditions: word prompts, class labels and the word
vocabulary file.

The image and video pipelines (:mod:`.ar_image`, :mod:`.continuous_ar_image`, :mod:`.ar_video`) condition
their targets on word prompts (a :class:`~mmspec.models.text.WordTokenizer`, saved next to the target as
``transformer/text_vocab.json``) or on class ids. The checks and the file handling live here once, so the
three pipelines accept the same inputs and raise the same errors:

* :func:`check_condition`: exactly one of ``prompt`` and ``class_labels``, the one the transformer reads;
* :func:`as_prompt_list`: a prompt or a non-empty list of prompts -> a list;
* :func:`check_word_prompts`: every prompt encodes with the pipeline's word vocabulary and has words;
* :func:`check_class_labels`: an int or a non-empty list of ints in ``[0, num_classes)``;
* :func:`check_text_tokenizer_size`: the vocabulary fits the target's word table;
* :func:`load_text_vocabulary` / :func:`save_text_vocabulary`: the ``transformer/text_vocab.json`` file;
* :class:`WordVocabularyMixin`: a pipeline's ``text_tokenizer`` (kept after the size check, prompts
  checked against it), its ``save_pretrained`` and the loader of a saved folder;
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
from mmspec.pipelines.hub import load_components

TEXT_VOCAB_FILE = "text_vocab.json"  # the word vocabulary, saved in the transformer's folder


# -- the word vocabulary file ---------------------------------------------------------------------------------


def text_vocabulary_path(folder: str | os.PathLike) -> Path:
    """Where a pipeline folder keeps its word vocabulary: ``<folder>/transformer/text_vocab.json``."""
    return Path(folder) / "transformer" / TEXT_VOCAB_FILE


def load_text_vocabulary(folder: str | os.PathLike, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``from_pretrained``'s keyword arguments with ``text_tokenizer`` read from the folder's
    ``transformer/text_vocab.json``, unless the caller passed one or the folder has none (then unchanged).
    Updates ``kwargs`` in place and returns it."""
    vocab_file = text_vocabulary_path(folder)
    if "text_tokenizer" not in kwargs and vocab_file.is_file():
        kwargs["text_tokenizer"] = WordTokenizer.load(vocab_file)
    return kwargs


def save_text_vocabulary(text_tokenizer: WordTokenizer | None, save_directory: str | os.PathLike) -> None:
    """Write the word vocabulary (if any) into ``<save_directory>/transformer/text_vocab.json``, next to the
    target's weights (``save_pretrained`` has written that folder already)."""
    if text_tokenizer is not None:
        text_tokenizer.save(text_vocabulary_path(save_directory))


class WordVocabularyMixin:
    """For a :class:`~diffusers.DiffusionPipeline` with a ``text_tokenizer`` attribute (a
    :class:`~mmspec.models.text.WordTokenizer` or None) that is not a diffusers component: it is saved as
    ``transformer/text_vocab.json`` next to the target's weights and read back from there. List the mixin
    before ``DiffusionPipeline`` in the bases."""

    text_tokenizer: WordTokenizer | None

    def _set_text_tokenizer(self, text_tokenizer: WordTokenizer | None, text_vocab_size: int | None) -> None:
        """Keep ``text_tokenizer`` after checking that it fits the target's word table (``text_vocab_size``
        rows; None: the target has none to check against)."""
        check_text_tokenizer_size(text_tokenizer, text_vocab_size)
        self.text_tokenizer = text_tokenizer

    def _check_word_prompts(self, texts: Sequence[str]) -> None:
        """:func:`check_word_prompts` against this pipeline's word vocabulary."""
        check_word_prompts(texts, self.text_tokenizer)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """diffusers' folder layout (``model_index.json`` + one folder per component) plus the word
        vocabulary in ``transformer/text_vocab.json``."""
        super().save_pretrained(save_directory, **kwargs)  # type: ignore[misc]
        save_text_vocabulary(self.text_tokenizer, save_directory)

    @classmethod
    def _from_saved_folder(cls, path: Path, names: Sequence[str], torch_dtype: torch.dtype | None = None,
                           **kwargs: Any) -> Any:
        """The pipeline of a ``save_pretrained`` folder: the word vocabulary (unless ``text_tokenizer`` is
        given), the components ``names`` (:func:`~mmspec.pipelines.hub.load_components`; keyword arguments
        replace components, ``check_weights=False`` skips the refusal of NaN/inf weights),
        :meth:`_complete_components`, then ``_name_or_path`` recorded in the config. A pipeline with stored
        method settings (:class:`~mmspec.pipelines.method_settings.MethodSettingsMixin`) reads the folder's
        ``speculation_config.json``, unless ``speculation_settings=`` (a ``SpeculationSettings`` or its JSON
        mapping) is given: those replace the file's."""
        stores_settings = hasattr(cls, "read_speculation_settings")
        settings = kwargs.pop("speculation_settings", None) if stores_settings else None
        load_text_vocabulary(path, kwargs)
        components = load_components(cls, path, names, torch_dtype=torch_dtype, extra=("text_tokenizer",), **kwargs)
        pipe = cls(**cls._complete_components(components, path))
        pipe.register_to_config(_name_or_path=str(path))
        if stores_settings:
            pipe.use_speculation_settings(settings, path)
        return pipe

    @classmethod
    def _complete_components(cls, components: dict[str, Any], path: Path) -> dict[str, Any]:
        """Hook between loading and construction (e.g. a text tokenizer that is not a word vocabulary)."""
        return components


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


def check_word_prompts(texts: Sequence[str], text_tokenizer: WordTokenizer | None) -> None:
    """Every prompt must encode with the pipeline's word vocabulary and have at least one word; the
    errors name the prompt's index (unknown words, empty prompts, or no vocabulary at all)."""
    if text_tokenizer is None:
        raise ValueError(f"this pipeline has no word vocabulary (text_tokenizer; saved as "
                         f"transformer/{TEXT_VOCAB_FILE}), so prompts cannot be encoded")
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
