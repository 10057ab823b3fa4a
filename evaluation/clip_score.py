"""CLIP score of image/prompt pairs with open_clip.

CLIP score = 100 * max(cos(E_image, E_text), 0), averaged over the pairs (the convention of
torchmetrics' ``CLIPScore``; Hessel et al. 2021 scale by 2.5 instead of 100). Always report the model
and the weights next to the number: scores of different CLIP models are not comparable.

Weights: ``pretrained`` is a local checkpoint file (the usual case here: nothing can be downloaded), an
open_clip pretrained tag such as ``"openai"`` or ``"laion2b_s34b_b79k"`` (downloaded when the hub is
reachable), or the model may be ``"hf-hub:<org>/<repo>"``. ``pretrained=None`` builds random weights:
only useful for tests, and the scorer warns about it.

Command line::

    python -m mmspec.evaluation.clip_score FOLDER [--prompts prompts.jsonl|prompts.txt]
        --model ViT-B-32 --pretrained /path/to/open_clip_pytorch_model.bin
        [--batch-size 32] [--device cpu] [--output clip.json] [--per-image clip_per_image.jsonl]

FOLDER holds the images; prompts come from ``--prompts`` (JSON lines ``{"file", "prompt"}`` or one
prompt per line for the sorted images), from ``FOLDER/prompts.jsonl``, or from the GenEval layout
(``FOLDER/<index>/metadata.jsonl`` + ``samples/``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from .files import load_prompt_pairs, open_rgb
from .pair_scores import PerImageResult, add_output_arguments, check_pairs, with_progress, write_outputs


def _import_open_clip():
    try:
        import open_clip
    except ImportError as err:
        raise ImportError(
            "CLIP score needs open_clip: pip install open_clip_torch -c requirements/constraints.txt "
            "(or bash scripts/setup_extras.sh)"
        ) from err
    return open_clip


def register_clip_config(name: str, config: dict) -> None:
    """Register an open_clip model config (same schema as open_clip's ``model_configs/*.json``).

    Used for small test models, e.g.
    ``{"embed_dim": 32, "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}``.
    """
    open_clip = _import_open_clip()
    if not isinstance(config, dict) or "vision_cfg" not in config or "text_cfg" not in config:
        raise ValueError("config must be a dict with 'embed_dim', 'vision_cfg' and 'text_cfg'")
    # open_clip reads the file into its registry at once and keeps the entry when the file is gone, so the
    # temporary folder is removed right away (it used to be left behind in /tmp on every call)
    with tempfile.TemporaryDirectory(prefix="mmspec_open_clip_cfg_") as folder:
        path = Path(folder) / f"{name}.json"
        path.write_text(json.dumps(config))
        open_clip.add_model_config(path)
    if name not in open_clip.list_models():
        raise RuntimeError(f"open_clip did not register the config {name!r}")


def _looks_like_path(value: str) -> bool:
    return os.sep in value or value.endswith((".bin", ".pt", ".pth", ".safetensors", ".ckpt"))


class CLIPScorer:
    """Scores (image, prompt) pairs with an open_clip model.

    Args:
        model: open_clip architecture name (``open_clip.list_models()``) or ``"hf-hub:<org>/<repo>"``.
        pretrained: local checkpoint file, open_clip pretrained tag, or None (random weights).
        device: torch device.
    """

    def __init__(self, model: str = "ViT-B-32", pretrained: str | os.PathLike | None = None, device: str = "cpu"):
        open_clip = _import_open_clip()
        is_hub = model.startswith("hf-hub:")
        if not is_hub and model not in open_clip.list_models():
            raise ValueError(f"model: unknown open_clip architecture {model!r} (see open_clip.list_models())")
        if pretrained is not None:
            pretrained = str(pretrained)
            if _looks_like_path(pretrained) and not Path(pretrained).is_file():
                raise FileNotFoundError(f"pretrained: CLIP weights file not found: {pretrained}")
        elif not is_hub:
            warnings.warn("CLIPScorer: pretrained=None builds random weights; the scores mean nothing", stacklevel=2)
        try:
            net, _, preprocess = open_clip.create_model_and_transforms(model, pretrained=pretrained, device=device)
        except RuntimeError as err:
            if pretrained is not None and not _looks_like_path(pretrained):
                raise RuntimeError(
                    f"pretrained: could not load open_clip weights {pretrained!r} for {model!r} "
                    f"(no network here?); pass a local checkpoint file instead. Cause: {err}"
                ) from err
            raise
        self.model = net.eval()
        self.preprocess = preprocess
        self.tokenizer = open_clip.get_tokenizer(model)
        self.device = device
        self.model_name = model
        self.pretrained = pretrained

    @torch.no_grad()
    def embed_images(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """L2-normalised image embeddings [N, D]."""
        pixels = torch.stack([self.preprocess(image.convert("RGB")) for image in images]).to(self.device)
        features = self.model.encode_image(pixels).float()
        return features / features.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    @torch.no_grad()
    def embed_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """L2-normalised text embeddings [N, D]."""
        tokens = self.tokenizer(list(texts)).to(self.device)
        features = self.model.encode_text(tokens).float()
        return features / features.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    def score(self, images: Sequence[Image.Image], prompts: Sequence[str], batch_size: int = 32,
              progress: bool = False) -> torch.Tensor:
        """Per-pair CLIP scores [N] = 100 * max(cos, 0)."""
        images, prompts = check_pairs(images, prompts)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        scores = []
        for i in with_progress(range(0, len(images), batch_size), progress, "CLIP score", "batch"):
            img = self.embed_images(images[i : i + batch_size])
            txt = self.embed_texts(prompts[i : i + batch_size])
            scores.append(100.0 * (img * txt).sum(-1).clamp_min(0.0))
        return torch.cat(scores).cpu()


@dataclass
class ClipScoreResult(PerImageResult):
    clip_score: float  # mean over pairs
    std: float
    num_pairs: int
    model: str
    pretrained: str | None
    per_image: list[dict[str, Any]] = field(default_factory=list, repr=False)


def compute_clip_score(
    folder: str | os.PathLike,
    prompts: str | os.PathLike | None = None,
    *,
    model: str = "ViT-B-32",
    pretrained: str | os.PathLike | None = None,
    scorer: CLIPScorer | None = None,
    batch_size: int = 32,
    device: str = "cpu",
    progress: bool = False,
) -> ClipScoreResult:
    """CLIP score of the images in ``folder`` against their prompts (see the module docstring)."""
    pairs = load_prompt_pairs(folder, prompts)
    scorer = scorer or CLIPScorer(model, pretrained, device)
    images = [open_rgb(path) for path, _ in pairs]
    texts = [prompt for _, prompt in pairs]
    scores = scorer.score(images, texts, batch_size=batch_size, progress=progress).tolist()
    per_image = [{"file": str(path), "prompt": text, "clip_score": s} for (path, text), s in zip(pairs, scores)]
    return ClipScoreResult(
        clip_score=float(statistics.fmean(scores)),
        std=float(statistics.pstdev(scores)),
        num_pairs=len(scores),
        model=scorer.model_name,
        pretrained=None if scorer.pretrained is None else str(scorer.pretrained),
        per_image=per_image,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mmspec.evaluation.clip_score",
                                     description="CLIP score (100 * max(cos, 0)) of images against their prompts.")
    parser.add_argument("folder", help="folder of images (see --prompts for how prompts are matched)")
    parser.add_argument("--prompts", default=None,
                        help="prompts file: JSON lines {file, prompt} or text, one prompt per sorted image")
    parser.add_argument("--model", default="ViT-B-32", help="open_clip architecture or hf-hub:<org>/<repo>")
    parser.add_argument("--pretrained", default=None,
                        help="local weights file or open_clip pretrained tag (required unless --random-weights)")
    parser.add_argument("--random-weights", action="store_true", help="allow random weights (smoke tests only)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    add_output_arguments(parser, "write per-image scores as JSON lines here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.pretrained is None and not args.random_weights and not args.model.startswith("hf-hub:"):
        parser.error("--pretrained is required (a local weights file); --random-weights for smoke tests")
    result = compute_clip_score(args.folder, args.prompts, model=args.model, pretrained=args.pretrained,
                                batch_size=args.batch_size, device=args.device, progress=not args.no_progress)
    print(f"CLIP score ({result.model}, {result.pretrained or 'random weights'}): "
          f"{result.clip_score:.4f} +- {result.std:.4f} over {result.num_pairs} pairs")
    write_outputs(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
