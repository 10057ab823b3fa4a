"""File helpers shared by the evaluation tools: image folders, prompt files and atomic writes.

Every tool reads its inputs through these functions so bad input fails the same way everywhere: a
missing path raises FileNotFoundError, an empty folder or images of mixed sizes raise ValueError naming
the argument and the offending files. Outputs are written with the package's atomic writers
(:mod:`mmspec.files`, re-exported here), so an interrupted or failed run never leaves a half-written result
behind, and the temporary files of a killed run are never listed as images.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmspec.files import (  # noqa: F401  (re-exported: the evaluation tools' writers)
    atomic_path,
    is_temporary,
    save_image_atomic,
    write_json_atomic,
    write_jsonl_atomic,
    write_text_atomic,
)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def read_jsonl(path: str | os.PathLike, *, argument: str = "path") -> list[dict]:
    """Read a JSON-lines file; blank lines are skipped, a malformed line raises ValueError with its number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{argument}: no such file: {path}")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{argument}: {path} line {number} is not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{argument}: {path} line {number} is not a JSON object")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------


def list_images(folder: str | os.PathLike, *, argument: str = "folder", recursive: bool = False) -> list[Path]:
    """Sorted image files (png/jpg/jpeg/webp/bmp) in ``folder``, leaving out temporary files of interrupted
    writers; raises if the folder is missing or has no images."""
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"{argument}: no such folder: {folder}")
    if not folder.is_dir():
        raise ValueError(f"{argument}: expected a folder of images, got a file: {folder}")
    pattern = "**/*" if recursive else "*"
    files = sorted(p for p in folder.glob(pattern)
                   if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not is_temporary(p))
    if not files:
        raise ValueError(f"{argument}: no images ({', '.join(IMAGE_EXTENSIONS)}) in {folder}")
    return files


def open_rgb(path: str | os.PathLike) -> Image.Image:
    """Open an image file as RGB (loads it fully, so the file handle is closed).

    Raises:
        ValueError: a file PIL cannot decode (truncated, e.g. by a killed writer, or not an image), naming
            the file: the metrics read whole folders, and PIL's own error names none.
    """
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise
    except (OSError, SyntaxError, ValueError) as error:  # UnidentifiedImageError is an OSError
        raise ValueError(f"cannot read the image {os.fspath(path)}: {error} (truncated or not an image file; "
                         "regenerate or remove it)") from error


def check_same_size(images: Sequence[Image.Image], names: Sequence[str] | None = None, *, argument: str = "images"):
    """Raise ValueError if the images do not all have the same size, naming the first mismatch."""
    if not images:
        raise ValueError(f"{argument}: no images given")
    first = images[0].size
    for index, image in enumerate(images):
        if image.size != first:
            name0 = names[0] if names else "image 0"
            name = names[index] if names else f"image {index}"
            raise ValueError(
                f"{argument}: images of mixed sizes: {name0} is {first[0]}x{first[1]} but {name} is "
                f"{image.size[0]}x{image.size[1]}; resize them to one size first"
            )
    return first


def pil_to_uint8(images: Sequence[Image.Image]) -> torch.Tensor:
    """Stack RGB PIL images of one size into a uint8 tensor [N, 3, H, W]."""
    arrays = [np.asarray(image.convert("RGB"), dtype=np.uint8) for image in images]  # each [H, W, 3]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def as_uint8_batch(images: Any, *, argument: str = "images") -> torch.Tensor:
    """Accept PIL images, a uint8 tensor [N,3,H,W] or a float tensor in [0,1]; return uint8 [N,3,H,W]."""
    if isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"{argument}: expected a tensor [N, 3, H, W], got shape {tuple(images.shape)}")
        if images.dtype == torch.uint8:
            return images
        if images.is_floating_point():
            if images.numel() and (images.min() < 0 or images.max() > 1):
                raise ValueError(f"{argument}: float images must lie in [0, 1]")
            return (images * 255).round().to(torch.uint8)
        raise ValueError(f"{argument}: unsupported dtype {images.dtype} (use uint8 or float in [0, 1])")
    images = list(images)
    if not images:
        raise ValueError(f"{argument}: no images given")
    if not all(isinstance(image, Image.Image) for image in images):
        raise ValueError(f"{argument}: expected PIL images or a tensor [N, 3, H, W]")
    check_same_size(images, argument=argument)
    return pil_to_uint8(images)


# ----------------------------------------------------------------------------------------------
# Image/prompt pairs
# ----------------------------------------------------------------------------------------------


def load_prompt_pairs(
    folder: str | os.PathLike, prompts: str | os.PathLike | None = None, *, argument: str = "folder"
) -> list[tuple[Path, str]]:
    """(image path, prompt) pairs for CLIP score and ImageReward.

    Layouts understood:
      * the GenEval layout: ``folder/<index>/metadata.jsonl`` + ``folder/<index>/samples/*.png``;
      * ``prompts`` (or ``folder/prompts.jsonl``) as JSON lines ``{"file": "0001.png", "prompt": "..."}``,
        file names relative to ``folder``;
      * ``prompts`` as a plain text file with one prompt per line, matched to the sorted images of
        ``folder`` (one line per image, or a single line for all images).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{argument}: no such folder: {folder}")
    if prompts is None:
        if (folder / "prompts.jsonl").is_file():
            prompts = folder / "prompts.jsonl"
        else:
            pairs = _geneval_layout_pairs(folder)
            if pairs:
                return pairs
            raise ValueError(
                f"{argument}: {folder} has neither prompts.jsonl nor the GenEval layout "
                "(<index>/metadata.jsonl + samples/); pass a prompts file"
            )
    prompts = Path(prompts)
    if not prompts.is_file():
        raise FileNotFoundError(f"prompts: no such file: {prompts}")
    if prompts.suffix == ".jsonl":
        pairs = []
        for number, row in enumerate(read_jsonl(prompts, argument="prompts"), start=1):
            if "file" not in row or "prompt" not in row:
                raise ValueError(f"prompts: {prompts} line {number} needs the keys 'file' and 'prompt'")
            path = folder / row["file"]
            if not path.is_file():
                raise FileNotFoundError(f"prompts: {prompts} line {number} names a missing image: {path}")
            pairs.append((path, str(row["prompt"])))
        if not pairs:
            raise ValueError(f"prompts: {prompts} is empty")
        return pairs
    lines = [line.strip() for line in prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    images = list_images(folder, argument=argument)
    if len(lines) == 1:
        lines = lines * len(images)
    if len(lines) != len(images):
        raise ValueError(
            f"prompts: {prompts} has {len(lines)} prompts but {folder} has {len(images)} images "
            "(give one prompt per image, or one prompt for all)"
        )
    return list(zip(images, lines))


def _geneval_layout_pairs(folder: Path) -> list[tuple[Path, str]]:
    pairs = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()):
        meta_path = sub / "metadata.jsonl"
        if not meta_path.is_file():
            continue
        rows = read_jsonl(meta_path, argument="folder")
        if not rows or "prompt" not in rows[0]:
            raise ValueError(f"folder: {meta_path} has no 'prompt'")
        prompt = rows[0]["prompt"]
        samples = sub / "samples"
        if samples.is_dir():
            for image in sorted(p for p in samples.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS):
                pairs.append((image, prompt))
    return pairs
