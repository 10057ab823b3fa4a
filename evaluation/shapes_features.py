"""A shapes-world feature network for FID inside the world, and its training recipe.

FID's InceptionV3 was trained on ImageNet photos; on 32x32 flat shapes its features mostly measure
resize artefacts. This small CNN is trained instead to read the attributes that generation gets wrong
in the shapes world: which shapes and colours are present, which shape has which colour, the sizes, how
many objects there are and where (3x3 grid). Its 128-d embedding (the layer before the attribute heads)
is the feature vector for :func:`mmspec.evaluation.fid.compute_fid` with ``features="shapes"``.

Training recipe (one command, deterministic, a few CPU minutes; writes the committed weights)::

    python -m mmspec.evaluation.shapes_features train --out evaluation/weights/shapes_features.safetensors

Data: scenes from :func:`mmspec.world.scene.sample_scene` (1-4 objects) drawn from the world's "train"
stream with base seed ``TRAIN_SEED``, rendered at 32x32 with the difficulty knob drawn from {0, 0.5, 1,
1.5, 2} per image, so the features cover flat and noisy renders alike; validation uses the "val" stream.
Determinism: fixed seeds, one torch thread during training (the thread count changes float summation
order), deterministic algorithms. The weights file records the recipe and the validation accuracies
in its metadata.

Input convention: uint8 images [N, 3, H, W] of any size; they are resized to 32x32 (bilinear,
antialiased) inside the network.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / "shapes_features.safetensors"
TRAIN_SEED = 20251  # base seed of the training scenes in the world's "train" stream
VAL_SEED = 20252
DIFFICULTIES = (0.0, 0.5, 1.0, 1.5, 2.0)


@dataclass
class ShapesFeatureConfig:
    image_size: int = 32  # input side after resizing
    widths: tuple[int, int, int] = (16, 32, 64)  # channels of the three conv stages
    num_features: int = 128  # embedding size (the FID feature vector)
    num_shapes: int = 4
    num_colors: int = 9
    num_sizes: int = 3
    max_objects: int = 4
    grid: int = 3  # object-centre occupancy grid (grid x grid)

    @property
    def num_binary(self) -> int:
        """Multi-label targets: shapes, colours, shape-colour pairs, sizes, grid cells."""
        return self.num_shapes + self.num_colors + self.num_shapes * self.num_colors + self.num_sizes + self.grid**2


class ShapesFeatureNet(nn.Module):
    """Small CNN: three conv stages (32 -> 16 -> 8 -> 4 pixels), a 128-d embedding, attribute heads."""

    def __init__(self, config: ShapesFeatureConfig | None = None):
        super().__init__()
        self.config = config = config or ShapesFeatureConfig()
        w1, w2, w3 = config.widths

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

        self.stages = nn.Sequential(
            block(3, w1), nn.MaxPool2d(2),  # [N, w1, S/2, S/2]
            block(w1, w2), block(w2, w2), nn.MaxPool2d(2),  # [N, w2, S/4, S/4]
            block(w2, w3), nn.MaxPool2d(2),  # [N, w3, S/8, S/8]
        )
        side = config.image_size // 8
        self.embed = nn.Linear(w3 * side * side, config.num_features)
        self.binary_head = nn.Linear(config.num_features, config.num_binary)
        self.count_head = nn.Linear(config.num_features, config.max_objects)

    @property
    def num_features(self) -> int:
        return self.config.num_features

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [N, 3, H, W] (or float in [0, 1]) -> float [N, 3, S, S] in [-1, 1]."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must have shape [N, 3, H, W], got {tuple(images.shape)}")
        x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        s = self.config.image_size
        if x.shape[-2:] != (s, s):
            x = F.interpolate(x, size=(s, s), mode="bilinear", antialias=True, align_corners=False)
        return x * 2.0 - 1.0

    def embedding(self, images: torch.Tensor) -> torch.Tensor:
        """Features [N, num_features] (pre-activation embedding)."""
        h = self.stages(self.preprocess(images))  # [N, w3, S/8, S/8]
        return self.embed(h.flatten(1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.embedding(images)

    def heads(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(binary attribute logits [N, num_binary], count logits [N, max_objects])."""
        h = F.relu(self.embedding(images))
        return self.binary_head(h), self.count_head(h)


# ----------------------------------------------------------------------------------------------
# Loading and saving
# ----------------------------------------------------------------------------------------------


def save_shapes_features(model: ShapesFeatureNet, path: str | os.PathLike, **meta) -> Path:
    """Write weights (fp32) with the config and ``meta`` (recipe, metrics) in the safetensors metadata."""
    from safetensors.torch import save_file

    from .files import atomic_path

    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    metadata = {"config": json.dumps(asdict(model.config)), **{k: json.dumps(v) for k, v in meta.items()}}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return path


def load_shapes_features(path: str | os.PathLike | None = None) -> ShapesFeatureNet:
    """The trained feature network (eval mode). ``path`` defaults to the committed weights file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path) if path is not None else DEFAULT_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"weights: shapes feature network weights not found: {path}; train them with "
            "`python -m mmspec.evaluation.shapes_features train --out <path>`"
        )
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "config" not in metadata:
        raise ValueError(f"weights: {path} is not a shapes feature network file (no config in its metadata)")
    raw = json.loads(metadata["config"])
    raw["widths"] = tuple(raw["widths"])
    model = ShapesFeatureNet(ShapesFeatureConfig(**raw))
    model.load_state_dict(load_file(str(path)))
    return model.eval()


def weights_metadata(path: str | os.PathLike | None = None) -> dict:
    """The recipe and metrics stored with a weights file."""
    from safetensors import safe_open

    path = Path(path) if path is not None else DEFAULT_WEIGHTS
    with safe_open(str(path), framework="pt") as f:
        return {k: json.loads(v) for k, v in (f.metadata() or {}).items()}


# ----------------------------------------------------------------------------------------------
# Training data
# ----------------------------------------------------------------------------------------------


def scene_targets(scene, config: ShapesFeatureConfig) -> tuple[np.ndarray, int]:
    """(multi-label targets [num_binary] in {0, 1}, count class = number of objects - 1)."""
    from mmspec.world.scene import COLORS, SHAPES, SIZES

    colors, sizes = list(COLORS), list(SIZES)
    shape_t = np.zeros(len(SHAPES), np.float32)
    color_t = np.zeros(len(colors), np.float32)
    pair_t = np.zeros(len(SHAPES) * len(colors), np.float32)
    size_t = np.zeros(len(sizes), np.float32)
    grid_t = np.zeros(config.grid**2, np.float32)
    for obj in scene.objects:
        s, c = SHAPES.index(obj.shape), colors.index(obj.color)
        shape_t[s] = color_t[c] = pair_t[s * len(colors) + c] = 1.0
        size_t[sizes.index(obj.size)] = 1.0
        col = min(int(obj.x * config.grid), config.grid - 1)
        row = min(int(obj.y * config.grid), config.grid - 1)
        grid_t[row * config.grid + col] = 1.0
    return np.concatenate([shape_t, color_t, pair_t, size_t, grid_t]), len(scene.objects) - 1


def make_dataset(
    n: int, namespace: str, seed: int, config: ShapesFeatureConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 images [n, 3, S, S], binary targets [n, num_binary], count classes [n]) from the world."""
    from mmspec.world.render import render_scene
    from mmspec.world.scene import rng_for, sample_scene

    images = np.empty((n, config.image_size, config.image_size, 3), np.uint8)
    binary = np.empty((n, config.num_binary), np.float32)
    counts = np.empty(n, np.int64)
    for i in range(n):
        rng = rng_for(namespace, seed, i)
        scene = sample_scene(rng)
        difficulty = DIFFICULTIES[int(rng.integers(len(DIFFICULTIES)))]
        images[i] = render_scene(scene, config.image_size, difficulty)
        binary[i], counts[i] = scene_targets(scene, config)
    return (
        torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
        torch.from_numpy(binary),
        torch.from_numpy(counts),
    )


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    num_train: int = 20000
    num_val: int = 2000
    epochs: int = 8
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 1e-4
    seed: int = 0  # torch seed (initialisation, shuffling)


@torch.no_grad()
def evaluate_heads(model: ShapesFeatureNet, images, binary, counts, batch_size: int = 500) -> dict[str, float]:
    """Exact-match accuracy of each attribute group and of the count on a labelled set."""
    model.eval()
    cfg = model.config
    preds_b, preds_c = [], []
    for i in range(0, images.shape[0], batch_size):
        logits_b, logits_c = model.heads(images[i : i + batch_size])
        preds_b.append(logits_b > 0)
        preds_c.append(logits_c.argmax(-1))
    pb, pc = torch.cat(preds_b), torch.cat(preds_c)
    tb = binary > 0.5
    bounds = np.cumsum([0, cfg.num_shapes, cfg.num_colors, cfg.num_shapes * cfg.num_colors, cfg.num_sizes, cfg.grid**2])
    names = ["shapes", "colors", "shape_color_pairs", "sizes", "grid"]
    out = {f"{name}_exact": float((pb[:, a:b] == tb[:, a:b]).all(1).float().mean()) for name, a, b in zip(names, bounds[:-1], bounds[1:])}
    out["count_accuracy"] = float((pc == counts).float().mean())
    out["all_exact"] = float(((pb == tb).all(1) & (pc == counts)).float().mean())
    return out


def train(config: TrainConfig | None = None, model_config: ShapesFeatureConfig | None = None,
          progress: bool = True) -> tuple[ShapesFeatureNet, dict]:
    """Train the feature network from scratch; returns (model in eval mode, recipe + metrics dict)."""
    config = config or TrainConfig()
    model_config = model_config or ShapesFeatureConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        start = time.time()
        train_x, train_b, train_c = make_dataset(config.num_train, "train", TRAIN_SEED, model_config)
        val_x, val_b, val_c = make_dataset(config.num_val, "val", VAL_SEED, model_config)
        data_seconds = time.time() - start

        torch.manual_seed(config.seed)
        model = ShapesFeatureNet(model_config)
        opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        steps_per_epoch = -(-config.num_train // config.batch_size)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, config.lr, total_steps=config.epochs * steps_per_epoch)
        gen = torch.Generator().manual_seed(config.seed)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=config.epochs * steps_per_epoch, desc="train shapes features", unit="step")
        for epoch in range(config.epochs):
            model.train()
            order = torch.randperm(config.num_train, generator=gen)
            for step in range(steps_per_epoch):
                idx = order[step * config.batch_size : (step + 1) * config.batch_size]
                logits_b, logits_c = model.heads(train_x[idx])
                # BCE summed over the attribute outputs (mean over the batch): averaged over all 61
                # outputs, its gradient is so small next to the count's cross-entropy that colours and
                # shapes barely train within a few thousand steps.
                bce = F.binary_cross_entropy_with_logits(logits_b, train_b[idx], reduction="none").sum(1).mean()
                loss = bce + F.cross_entropy(logits_c, train_c[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(epoch=epoch, loss=f"{loss.item():.4f}")
        if bar is not None:
            bar.close()
        metrics = evaluate_heads(model, val_x, val_b, val_c)
        info = {
            "recipe": {**asdict(config), "train_seed": TRAIN_SEED, "val_seed": VAL_SEED,
                       "difficulties": list(DIFFICULTIES), "torch_threads": 1,
                       "command": "python -m mmspec.evaluation.shapes_features train"},
            "val_metrics": metrics,
            "seconds": {"data": round(data_seconds, 1), "total": round(time.time() - start, 1)},
        }
        return model.eval(), info
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmspec.evaluation.shapes_features",
                                     description="Train or inspect the shapes-world FID feature network.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train from scratch (deterministic, a few CPU minutes)")
    p_train.add_argument("--out", default=str(DEFAULT_WEIGHTS), help="weights file to write (.safetensors)")
    p_train.add_argument("--num-train", type=int, default=TrainConfig.num_train)
    p_train.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    p_train.add_argument("--no-progress", action="store_true")
    p_info = sub.add_parser("info", help="print the recipe and validation metrics stored with a weights file")
    p_info.add_argument("weights", nargs="?", default=str(DEFAULT_WEIGHTS))
    args = parser.parse_args(argv)
    if args.command == "info":
        if not Path(args.weights).is_file():
            raise FileNotFoundError(f"weights: no such file: {args.weights}")
        print(json.dumps(weights_metadata(args.weights), indent=2))
        return 0
    if not args.out.endswith(".safetensors"):
        parser.error("--out must end in .safetensors")
    model, info = train(TrainConfig(num_train=args.num_train, epochs=args.epochs), progress=not args.no_progress)
    save_shapes_features(model, args.out, **info)
    print(json.dumps(info, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
