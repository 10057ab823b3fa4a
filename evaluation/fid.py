"""Frechet distance between two image sets, with a pluggable feature extractor.

FID = ||mu_r - mu_f||^2 + Tr(S_r + S_f - 2 (S_r S_f)^(1/2)), the Frechet (2-Wasserstein) distance
between Gaussians fitted to the features of real and generated images. The number depends entirely
on the feature network, so every result names its extractor:

* ``"inception"``: the standard FID network (TF-ported InceptionV3, pool3, 2048 features, via
  torch-fidelity), built from a local weights file (``pt_inception-2015-12-05-6726825d.pth``); these
  machines cannot download it. Numbers are comparable with published FIDs.
* ``"shapes"``: a small CNN trained on the shapes world to classify scene attributes (shape and colour
  presence, object count, sizes; :mod:`mmspec.evaluation.shapes_features`), 128 features. ImageNet
  features say little about flat shapes on a dark background; this network's features encode exactly the
  attributes generation gets wrong, so FID inside the world is meaningful. Numbers are comparable only
  with other shapes-FIDs.
* any ``torch.nn.Module`` mapping uint8 images [N, 3, H, W] to features [N, D] with an integer
  ``num_features`` attribute (the torchmetrics convention: the same module also plugs into
  ``torchmetrics.image.fid.FrechetInceptionDistance(feature=module)``).

Command line::

    python -m mmspec.evaluation.fid REAL FAKE [--features shapes|inception] [--weights PATH]
                                              [--batch-size 64] [--device cpu] [--output fid.json]
    python -m mmspec.evaluation.fid REAL --save-stats real_stats.npz     # precompute reference stats

REAL and FAKE are image folders (all images of one size within a folder) or ``.npz`` files with the
``mu``/``sigma`` saved by ``--save-stats``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .files import as_uint8_batch, atomic_path, list_images, open_rgb, pil_to_uint8, write_json_atomic

FEATURE_EXTRACTORS = ("shapes", "inception")


# ----------------------------------------------------------------------------------------------
# The distance
# ----------------------------------------------------------------------------------------------


def _sqrt_psd(matrix: np.ndarray) -> np.ndarray:
    """Symmetric square root of a symmetric positive semi-definite matrix (negative eigenvalues -> 0)."""
    values, vectors = np.linalg.eigh(matrix)
    return (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T


def frechet_distance(mu1: Any, sigma1: Any, mu2: Any, sigma2: Any) -> float:
    """Frechet distance between N(mu1, sigma1) and N(mu2, sigma2).

    d^2 = ||mu1 - mu2||^2 + Tr(sigma1) + Tr(sigma2) - 2 Tr((sigma1 sigma2)^(1/2)).

    Tr((S1 S2)^(1/2)) is computed as the sum of the square roots of the eigenvalues of the symmetric PSD
    matrix S1^(1/2) S2 S1^(1/2) (same eigenvalues as S1 S2), in float64. That avoids the complex
    ``sqrtm`` of a non-symmetric product and its spurious imaginary parts.
    """
    mu1 = np.asarray(mu1, dtype=np.float64)
    mu2 = np.asarray(mu2, dtype=np.float64)
    sigma1 = np.atleast_2d(np.asarray(sigma1, dtype=np.float64))
    sigma2 = np.atleast_2d(np.asarray(sigma2, dtype=np.float64))
    if mu1.ndim != 1 or mu1.shape != mu2.shape:
        raise ValueError(f"mu1 and mu2 must be vectors of one length, got {mu1.shape} and {mu2.shape}")
    d = mu1.shape[0]
    for name, sigma in (("sigma1", sigma1), ("sigma2", sigma2)):
        if sigma.shape != (d, d):
            raise ValueError(f"{name} must have shape ({d}, {d}), got {sigma.shape}")
        if not np.all(np.isfinite(sigma)):
            raise ValueError(f"{name} has non-finite entries")
    sigma1 = (sigma1 + sigma1.T) / 2
    sigma2 = (sigma2 + sigma2.T) / 2
    root1 = _sqrt_psd(sigma1)
    middle = root1 @ sigma2 @ root1
    trace_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0.0, None)).sum()
    diff = mu1 - mu2
    value = diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * trace_sqrt
    return float(max(value, 0.0))


def feature_statistics(features: Any) -> tuple[np.ndarray, np.ndarray]:
    """Mean [D] and unbiased covariance [D, D] (float64) of features [N, D]; needs N >= 2."""
    x = features.detach().cpu().numpy() if isinstance(features, torch.Tensor) else np.asarray(features)
    x = x.astype(np.float64)
    if x.ndim != 2:
        raise ValueError(f"features must have shape [N, D], got {x.shape}")
    if x.shape[0] < 2:
        raise ValueError(f"need at least 2 images to estimate a covariance, got {x.shape[0]}")
    if not np.all(np.isfinite(x)):
        raise ValueError("features contain non-finite values")
    return x.mean(axis=0), np.cov(x, rowvar=False).reshape(x.shape[1], x.shape[1])


# ----------------------------------------------------------------------------------------------
# Feature extractors
# ----------------------------------------------------------------------------------------------


class InceptionV3Features(nn.Module):
    """The standard FID InceptionV3 (pool3, 2048-d) from a local weights file, through torch-fidelity.

    Input: uint8 images [N, 3, H, W], any size (resized to 299 inside, TF1-compatible bilinear).
    """

    num_features = 2048

    def __init__(self, weights_path: str | os.PathLike):
        super().__init__()
        weights_path = Path(weights_path)
        if not weights_path.is_file():
            raise FileNotFoundError(
                f"weights: InceptionV3 weights file not found: {weights_path} (the FID network, "
                "pt_inception-2015-12-05-6726825d.pth from torch-fidelity's releases)"
            )
        try:
            from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
        except ImportError as err:
            raise ImportError(
                "the InceptionV3 FID features need torch-fidelity (and torchvision): "
                "pip install torch-fidelity -c requirements/constraints.txt, or bash scripts/setup_extras.sh"
            ) from err
        self.net = FeatureExtractorInceptionV3(
            "inception-v3-compat", ["2048"], feature_extractor_weights_path=str(weights_path)
        )
        self.net.eval()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        (features,) = self.net(images)  # [N, 2048]
        return features


def load_feature_extractor(
    features: str | nn.Module = "shapes", weights: str | os.PathLike | None = None, device: str = "cpu"
) -> nn.Module:
    """Build a feature extractor by name (``"shapes"``, ``"inception"``) or pass a module through.

    Args:
        features: extractor name or an ``nn.Module`` with ``num_features``.
        weights: weights file. Required for ``"inception"``; for ``"shapes"`` defaults to the committed
            ``evaluation/weights/shapes_features.safetensors``.
        device: torch device for the extractor.
    """
    if isinstance(features, nn.Module):
        if not isinstance(getattr(features, "num_features", None), int):
            raise ValueError("features: a custom extractor module needs an integer `num_features` attribute")
        return features.to(device).eval()
    if features == "inception":
        if weights is None:
            raise ValueError(
                "weights: the inception extractor needs a local weights file "
                "(pt_inception-2015-12-05-6726825d.pth); none can be downloaded here"
            )
        return InceptionV3Features(weights).to(device).eval()
    if features == "shapes":
        from .shapes_features import load_shapes_features

        return load_shapes_features(weights).to(device).eval()
    raise ValueError(f"features must be one of {list(FEATURE_EXTRACTORS)} or an nn.Module, got {features!r}")


def _folder_batches(folder: Path, batch_size: int, argument: str) -> tuple[int, Iterator[torch.Tensor]]:
    files = list_images(folder, argument=argument)
    first_size = open_rgb(files[0]).size

    def batches():
        for start in range(0, len(files), batch_size):
            images = [open_rgb(f) for f in files[start : start + batch_size]]
            for f, image in zip(files[start : start + batch_size], images):
                if image.size != first_size:
                    raise ValueError(
                        f"{argument}: images of mixed sizes in {folder}: {files[0].name} is "
                        f"{first_size[0]}x{first_size[1]} but {f.name} is {image.size[0]}x{image.size[1]}"
                    )
            yield pil_to_uint8(images)

    return len(files), batches()


def _as_batches(images: Any, batch_size: int, argument: str) -> tuple[int, Iterable[torch.Tensor]]:
    """Normalise the accepted image inputs to (count, iterator of uint8 batches [B, 3, H, W])."""
    if isinstance(images, (str, os.PathLike)):
        return _folder_batches(Path(images), batch_size, argument)
    batch = as_uint8_batch(images, argument=argument)
    return batch.shape[0], (batch[i : i + batch_size] for i in range(0, batch.shape[0], batch_size))


@torch.no_grad()
def extract_features(
    images: Any,
    extractor: nn.Module,
    *,
    batch_size: int = 64,
    device: str = "cpu",
    progress: bool = False,
    argument: str = "images",
) -> np.ndarray:
    """Features [N, D] (float64) of a folder, a list of PIL images or a uint8/float tensor [N, 3, H, W]."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    count, batches = _as_batches(images, batch_size, argument)
    out = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=count, desc=f"features ({argument})", unit="img")
    for batch in batches:
        features = extractor(batch.to(device))
        if features.ndim != 2 or features.shape[0] != batch.shape[0]:
            raise ValueError(
                f"the feature extractor returned shape {tuple(features.shape)} for {batch.shape[0]} images; "
                "expected [N, num_features]"
            )
        out.append(features.double().cpu().numpy())
        if bar is not None:
            bar.update(batch.shape[0])
    if bar is not None:
        bar.close()
    return np.concatenate(out)


def save_statistics(path: str | os.PathLike, mu: np.ndarray, sigma: np.ndarray, **meta: Any) -> Path:
    """Write mu/sigma (and metadata such as the extractor name) to an ``.npz`` file atomically."""
    path = Path(path)
    if path.suffix != ".npz":
        raise ValueError(f"path: statistics files end in .npz, got {path}")
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, mu=mu, sigma=sigma, meta=json.dumps(meta))
    return path


def load_statistics(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, dict]:
    """Read mu, sigma and metadata written by :func:`save_statistics`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such statistics file: {path}")
    with np.load(path, allow_pickle=False) as data:
        if "mu" not in data or "sigma" not in data:
            raise ValueError(f"{path} has no 'mu'/'sigma' arrays (write it with --save-stats)")
        meta = json.loads(str(data["meta"])) if "meta" in data else {}
        return data["mu"], data["sigma"], meta


# ----------------------------------------------------------------------------------------------
# FID
# ----------------------------------------------------------------------------------------------


@dataclass
class FIDResult:
    fid: float
    num_real: int | None  # None when the real statistics came from an .npz file
    num_fake: int
    features: str  # which extractor produced the features
    num_features: int

    def to_dict(self) -> dict:
        return asdict(self)


def _statistics_of(images: Any, extractor: nn.Module, name: str, **kw) -> tuple[np.ndarray, np.ndarray, int | None, dict]:
    if isinstance(images, (str, os.PathLike)) and str(images).endswith(".npz"):
        mu, sigma, meta = load_statistics(images)
        return mu, sigma, None, meta
    features = extract_features(images, extractor, argument=name, **kw)
    mu, sigma = feature_statistics(features)
    return mu, sigma, features.shape[0], {}


def compute_fid(
    real: Any,
    fake: Any,
    features: str | nn.Module = "shapes",
    *,
    weights: str | os.PathLike | None = None,
    batch_size: int = 64,
    device: str = "cpu",
    progress: bool = False,
) -> FIDResult:
    """FID between two image sets.

    Args:
        real, fake: image folders, lists of PIL images, uint8 tensors [N, 3, H, W], float tensors in
            [0, 1], or (``real`` only, or both) ``.npz`` statistics files from :func:`save_statistics`.
        features: ``"shapes"``, ``"inception"`` or a custom extractor module (see the module docstring).
        weights: weights file of the extractor (required for ``"inception"``).

    Example::

        >>> from mmspec.evaluation.fid import compute_fid
        >>> compute_fid("data/real", "outputs/eagle", features="shapes").fid
    """
    extractor = load_feature_extractor(features, weights, device)
    name = features if isinstance(features, str) else type(features).__name__
    kw = dict(batch_size=batch_size, device=device, progress=progress)
    mu_r, sigma_r, n_real, meta_r = _statistics_of(real, extractor, "real", **kw)
    mu_f, sigma_f, n_fake, meta_f = _statistics_of(fake, extractor, "fake", **kw)
    for which, meta in (("real", meta_r), ("fake", meta_f)):
        if meta.get("features") not in (None, name):
            raise ValueError(
                f"{which}: the statistics file was computed with the {meta['features']!r} extractor, "
                f"not {name!r}"
            )
    if mu_r.shape != mu_f.shape:
        raise ValueError(f"real and fake features differ in size: {mu_r.shape[0]} vs {mu_f.shape[0]}")
    fid = frechet_distance(mu_r, sigma_r, mu_f, sigma_f)
    return FIDResult(fid=fid, num_real=n_real, num_fake=n_fake or 0, features=name, num_features=int(mu_r.shape[0]))


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mmspec.evaluation.fid",
        description="Frechet distance between two image sets (folders or .npz statistics).",
    )
    parser.add_argument("real", help="folder of reference images, or an .npz written by --save-stats")
    parser.add_argument("fake", nargs="?", help="folder of generated images (or .npz statistics)")
    parser.add_argument("--features", default="shapes", choices=FEATURE_EXTRACTORS,
                        help="feature network: shapes (world-trained CNN, default) or inception (standard FID)")
    parser.add_argument("--weights", default=None,
                        help="weights file of the feature network (required for inception)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", default=None, help="write the result as JSON to this file")
    parser.add_argument("--save-stats", default=None,
                        help="only compute the statistics of REAL and write them to this .npz")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress = not args.no_progress
    if args.save_stats:
        extractor = load_feature_extractor(args.features, args.weights, args.device)
        feats = extract_features(args.real, extractor, batch_size=args.batch_size, device=args.device,
                                 progress=progress, argument="real")
        mu, sigma = feature_statistics(feats)
        save_statistics(args.save_stats, mu, sigma, features=args.features, num_images=int(feats.shape[0]))
        print(f"wrote statistics of {feats.shape[0]} images ({args.features} features) to {args.save_stats}")
        return 0
    if args.fake is None:
        build_parser().error("FAKE is required unless --save-stats is given")
    result = compute_fid(args.real, args.fake, args.features, weights=args.weights,
                         batch_size=args.batch_size, device=args.device, progress=progress)
    print(f"FID ({result.features} features, {result.num_features}-d): {result.fid:.4f}  "
          f"[real: {result.num_real if result.num_real is not None else 'stats'}, fake: {result.num_fake}]")
    if args.output:
        write_json_atomic(args.output, result.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
