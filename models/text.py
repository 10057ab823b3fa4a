"""Word-level text tokenizer of the project's T5-free zoo models (the shapes world's vocabulary).

:class:`WordTokenizer` is a transformers ``PreTrainedTokenizerFast`` (a ``tokenizers`` WordLevel model), so a
pipeline saves and loads it as an ordinary component (``text_tokenizer/tokenizer.json``) through diffusers'
and transformers' loaders. Its normalizer lowercases and blanks every character outside the world's
alphabet, and its pre-tokenizer splits words and the punctuation marks ",", "." and "?", so it reads a text
exactly as :func:`mmspec.world.split_words` does and casing never matters. Word ids are positions in the word
list (the order the models were trained with).

The training recipes keep the older single-file form, ``{"words": [...]}`` (:meth:`WordTokenizer.save` /
:meth:`WordTokenizer.load`); pipeline folders saved before the component existed hold it as
``transformer/text_vocab.json``, which the pipelines convert on load.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from mmspec.files import write_text_atomic
from mmspec.world.captions import WORD_PATTERN

#: Characters that are never part of a word; the normalizer turns each run of them into a space.
_NOT_WORD = r"[^a-z,.?]+"
#: WordLevel's name for unknown words; it is not in the vocabulary (unknown words are refused by ``encode``).
_UNKNOWN = "[UNK]"


def word_backend(words: Sequence[str]) -> Tokenizer:
    """The ``tokenizers`` pipeline of a word list: lowercase, blank non-word characters, split words and
    punctuation, look each word up (id = its position in ``words``)."""
    backend = Tokenizer(WordLevel({word: index for index, word in enumerate(words)}, unk_token=_UNKNOWN))
    backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.Replace(Regex(_NOT_WORD), " ")])
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(WORD_PATTERN), "isolated"),
                                                     pre_tokenizers.WhitespaceSplit()])
    return backend


class WordTokenizer(PreTrainedTokenizerFast):
    """Word-level ids over a fixed word list (the shapes world's vocabulary), casing ignored.

    Args:
        words: the vocabulary in id order (unique, non-empty strings). ``from_pretrained`` passes ``vocab``
            (word -> id, read from ``tokenizer.json``) instead.

    ``encode(text)`` returns the word ids and raises ValueError naming the words outside the vocabulary;
    ``batch(texts, length)`` is the left-padded id matrix the models take; ``tokenizer(text)`` works as for
    any transformers tokenizer (an unknown word raises there too).
    """

    def __init__(self, words: Sequence[str] | None = None, *, vocab: dict[str, int] | None = None,
                 **kwargs: Any) -> None:
        if words is None:
            if not isinstance(vocab, dict):
                raise ValueError("WordTokenizer needs words (a list of strings) or vocab (word -> id)")
            words = sorted(vocab, key=vocab.__getitem__)
        words = _checked_words(words)
        kwargs.pop("tokenizer_object", None)
        super().__init__(tokenizer_object=word_backend(words), **kwargs)
        self.words = words
        self.index = {word: index for index, word in enumerate(words)}

    def split(self, text: str) -> list[str]:
        """The words of ``text`` as this tokenizer reads them (lower case; punctuation marks separate)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        backend = self.backend_tokenizer
        normalized = backend.normalizer.normalize_str(text)
        return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)]

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:  # type: ignore[override]
        """Word ids of ``text``. Raises ValueError naming the words outside the vocabulary (transformers'
        own ``encode`` would fail on them without saying which)."""
        words = self.split(text)
        unknown = [word for word in words if word not in self.index]
        if unknown:
            raise ValueError(f"words outside the model's vocabulary: {unknown}")
        if args or kwargs:  # transformers' options (return_tensors, ...): its own encode, now known to succeed
            return super().encode(text, *args, **kwargs)
        return [self.index[word] for word in words]

    def batch(self, texts: Sequence[str], length: int) -> torch.Tensor:
        """Word ids ``[B, length]``, left-padded with -1 (LlamaGen's condition layout); longer texts keep their
        first ``length`` words."""
        out = torch.full((len(texts), length), -1, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = self.encode(text)[:length]
            if ids:
                out[row, length - len(ids):] = torch.tensor(ids)
        return out

    # -- the recipes' single-file form ------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write ``{"words": [...]}`` to ``path`` (the training recipes' file, e.g. ``text_vocab.json``)."""
        write_text_atomic(path, json.dumps({"words": self.words}, indent=0))

    @classmethod
    def load(cls, path: str | Path) -> WordTokenizer:
        """Read a ``{"words": [...]}`` file written by :meth:`save`."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no word vocabulary at {path}")
        try:
            words = json.loads(path.read_text())["words"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a word vocabulary file ({{\"words\": [...]}}): {error}") from error
        return cls(words)


def _checked_words(words: Sequence[str]) -> list[str]:
    """``words`` as a list, refused (ValueError) unless they are unique words the tokenizer can produce."""
    if isinstance(words, str) or not isinstance(words, Sequence):
        raise ValueError(f"words must be a list of strings, got {type(words).__name__}")
    words = list(words)
    if not words:
        raise ValueError("words is empty: a word vocabulary needs at least one word")
    bad = [word for word in words if not isinstance(word, str) or not re.fullmatch(WORD_PATTERN, word)]
    if bad:
        raise ValueError(f"words must be lower-case words or one of ',', '.', '?'; got {bad[:5]}")
    if len(set(words)) != len(words):
        raise ValueError("words has duplicates: every word needs one id")
    return words
