"""What the image benchmarks (:mod:`.bench_ar_image`, :mod:`.bench_continuous`) share: FID's real set,
rendered from the benchmark's own prompts, and the quality pair every table reports (the exact-evaluator
GenEval-shapes score and FID with the shapes feature network)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from mmspec.validation import positive_int_argument
from mmspec.world import evaluate, render_scene, scene_for_prompt

from .fid import compute_fid


def reference_images(prompts: Sequence[Any], difficulty: float, size: int, seed: int) -> torch.Tensor:
    """Ground-truth renders of the prompts ``[N, 3, size, size]`` in [0, 1] (FID's real set): one scene per
    prompt drawn with ``seed``, rendered at ``difficulty``."""
    rng = np.random.default_rng(seed)
    arrays = [render_scene(scene_for_prompt(p, rng), size, difficulty) for p in prompts]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0


def mean_quality(per_seed: Sequence[dict[str, float]]) -> dict[str, Any]:
    """One method's quality over several generation seeds: the mean of each score, its standard deviation
    across seeds (``*_sd``, 0 for one seed) and the per-seed scores. At the benchmarks' sample sizes one
    seed's GenEval-shapes moves by about as much as the goals' tolerances (0.03), so a comparison of methods
    is only as good as the seeds averaged."""
    if not per_seed:
        raise ValueError("mean_quality needs the scores of at least one seed")
    out: dict[str, Any] = {}
    for key in per_seed[0]:
        values = np.asarray([scores[key] for scores in per_seed], dtype=np.float64)
        out[key] = float(values.mean())
        out[f"{key}_sd"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    out["seeds"] = len(per_seed)
    out["per_seed"] = [dict(scores) for scores in per_seed]
    return out


def seeded_quality(image_sets: Iterable[list[np.ndarray]], prompts: Sequence[Any], real: torch.Tensor
                   ) -> dict[str, Any]:
    """:func:`mean_quality` over image sets of the same ``prompts``, one per generation seed (an iterable, so
    each set can be generated and scored in turn), and with two or more seeds their ``seed_distance``
    (:func:`seed_distance`, the guard against sampling that has collapsed towards one image per prompt)."""
    scores, kept = [], []
    for images in image_sets:
        scores.append(quality(images, prompts, real))
        kept.append(np.stack(images).astype(np.float32))
    out = mean_quality(scores)
    if len(kept) > 1:
        out["seed_distance"] = seed_distance(kept)
    return out


def seed_distance(image_sets: Sequence[np.ndarray]) -> float:
    """Mean absolute pixel difference between two seeds' images of the same prompt, averaged over prompts
    and every pair of seeds (``image_sets``: one ``[N, H, W, 3]`` array in [0, 1] per seed, the same prompts
    in the same order).

    A diversity check for lossy samplers: GenEval-shapes and FID say whether images are right, not
    whether a prompt still gets different images from different seeds. A relaxed rule that accepts the
    drafter's most likely tokens ever more often pushes sampling towards one image per prompt, which this
    number shows as a drop below target-only sampling's value (0 for a deterministic sampler)."""
    if len(image_sets) < 2:
        raise ValueError("seed_distance needs the images of at least two seeds")
    shapes = {np.shape(images) for images in image_sets}
    if len(shapes) != 1:
        raise ValueError(f"seed_distance needs the same prompts and image size for every seed, got shapes {sorted(shapes)}")
    pairs = [(a, b) for a in range(len(image_sets)) for b in range(a + 1, len(image_sets))]
    return float(np.mean([np.abs(image_sets[a] - image_sets[b]).mean() for a, b in pairs]))


def quality(images: list[np.ndarray], prompts: Sequence[Any], real: torch.Tensor) -> dict[str, float]:
    """``{"geneval", "fid"}`` of generated images (float ``[H, W, 3]`` in [0, 1], one per prompt): the exact
    evaluator's overall GenEval-shapes score and FID (shapes features) against ``real``."""
    fake = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    return {"geneval": evaluate(images, list(prompts)).overall, "fid": compute_fid(real, fake, "shapes").fid}


def add_quality_seeds_argument(parser: argparse.ArgumentParser) -> None:
    """``--quality-seeds N``: generation seeds per configuration's quality (mean and spread reported)."""
    parser.add_argument("--quality-seeds", type=positive_int_argument, default=1,
                        help="generation seeds per method's quality (mean and spread across them reported)")


def score_cell(quality_row: dict, key: str, digits: int) -> str:
    """A table cell for one quality score, with its spread across seeds when several were measured ("-" for a
    run that measured no quality)."""
    if key not in quality_row:
        return "-"
    value = f"{quality_row[key]:.{digits}f}"
    if quality_row.get("seeds", 1) > 1:
        value += f" ± {quality_row[key + '_sd']:.{digits}f}"
    return value


SEED_DISTANCE_NOTE = ("Seed distance: mean absolute pixel difference between the seeds' images of the same prompt "
                      "(sampling that collapses towards one image per prompt lowers it; 0: deterministic).")


def seed_distance_columns(quality_rows: Iterable[dict]) -> tuple[str, str]:
    """The table's extra header cell and separator when any quality row has a ``seed_distance`` (a run with
    several quality seeds), else empty strings."""
    return (" seed distance |", "---|") if any("seed_distance" in q for q in quality_rows) else ("", "")


def seed_distance_cell(quality_row: dict, shown: bool) -> str:
    """A row's seed-distance cell (``shown``: the table has the column; a row without one gets a dash)."""
    if not shown:
        return ""
    return f" {quality_row['seed_distance']:.4f} |" if "seed_distance" in quality_row else " - |"


def spread_note(results: dict) -> str:
    """The table header's words for how quality was aggregated."""
    seeds = results.get("quality_seeds", 1)
    return f", mean ± standard deviation over {seeds} generation seeds" if seeds > 1 else ""
