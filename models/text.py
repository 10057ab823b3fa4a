"""Word-level text tokenizer of the project's T5-free zoo models (the shapes world's vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmspec.files import write_text_atomic
from mmspec.world import split_words


class WordTokenizer:
    """Word-level ids over the shapes world's vocabulary (id = index in the sorted word list)."""

    def __init__(self, words: list[str]) -> None:
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> list[int]:
        words = split_words(text)
        unknown = [w for w in words if w not in self.index]
        if unknown:
            raise ValueError(f"words outside the model's vocabulary: {unknown}")
        return [self.index[w] for w in words]

    def batch(self, texts: list[str], length: int) -> torch.Tensor:
        """Word ids ``[B, length]``, left-padded with -1 (LlamaGen's condition layout)."""
        out = torch.full((len(texts), length), -1, dtype=torch.long)
        for b, text in enumerate(texts):
            ids = self.encode(text)[:length]
            if ids:
                out[b, length - len(ids):] = torch.tensor(ids)
        return out

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json.dumps({"words": self.words}, indent=0))

    @classmethod
    def load(cls, path: str | Path) -> WordTokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no word vocabulary at {path}")
        return cls(json.loads(path.read_text())["words"])
