"""Rendering scenes to RGB images with numpy, and the difficulty knob.

``render_scene(scene, image_size=32, difficulty=1.0)`` draws a :class:`~mmspec.world.scene.Scene` into a
uint8 array [H, W, 3]. Objects are composited through coverage masks: each glyph is rasterised at
``SUPERSAMPLE`` times the resolution (pixel-centre tests), box-downsampled to a fractional coverage map
and cached per (shape, side length, sub-pixel phase), so rendering costs a few small array operations
per object (thousands of 32x32 images per second on one core).

The difficulty knob (a float in [0, 2]) controls how much the world looks like what real visual AR
models face, many near-equivalent tokens per position, without touching the scene itself:

=========  =====================================================================================
0 (flat)   flat base colours, hard edges (objects snapped to whole pixels, pixels at least half
           covered are filled), black background, no noise
1          default: anti-aliased edges (4x4 supersampling), per-object shade jitter of up to
           +-10 per channel, a dark background tint (up to 15 per channel), pixel noise sigma 3
2 (hard)   jitter +-20, background tint up to 30, a smooth background texture (up to +-20), a
           light shading gradient across each object (+-10), pixel noise sigma 6
=========  =====================================================================================

Values in between interpolate linearly (texture and gradients start above 1). Background noise and
texture are seeded by the scene's ``seed`` (plus the frame index for videos), so a render is a pure
function of (scene, image_size, difficulty, frame).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from .scene import COLORS, Scene, WorldObject

MIN_IMAGE_SIZE = 32
MAX_IMAGE_SIZE = 256
MAX_DIFFICULTY = 2.0
SUPERSAMPLE = 4

# Amplitudes per unit of difficulty (0-255 scale).
SHADE_JITTER = 10.0  # per-object colour offset, per channel
BACKGROUND_TINT = 15.0  # background colour, per channel
NOISE_SIGMA = 3.0  # per-pixel Gaussian noise
TEXTURE = 20.0  # smooth background texture, per unit of difficulty above 1
GRADIENT = 10.0  # shading gradient across an object, per unit of difficulty above 1

_COLOR_ARRAY = {name: np.asarray(rgb, dtype=np.float32) for name, rgb in COLORS.items()}


def check_image_size(image_size: int, name: str = "image_size") -> int:
    if not isinstance(image_size, (int, np.integer)) or isinstance(image_size, bool):
        raise ValueError(f"{name} must be an integer, got {image_size!r}")
    if not MIN_IMAGE_SIZE <= image_size <= MAX_IMAGE_SIZE:
        raise ValueError(f"{name} must be in [{MIN_IMAGE_SIZE}, {MAX_IMAGE_SIZE}], got {image_size}")
    return int(image_size)


def check_difficulty(difficulty: float, name: str = "difficulty") -> float:
    if not isinstance(difficulty, (int, float, np.floating)) or isinstance(difficulty, bool):
        raise ValueError(f"{name} must be a number in [0, {MAX_DIFFICULTY}], got {difficulty!r}")
    if not 0.0 <= float(difficulty) <= MAX_DIFFICULTY:
        raise ValueError(f"{name} must be in [0, {MAX_DIFFICULTY}], got {difficulty}")
    return float(difficulty)


# ----------------------------------------------------------------------------------------------------
# glyphs
# ----------------------------------------------------------------------------------------------------


@lru_cache(maxsize=512)
def glyph_mask(shape: str, side: int) -> np.ndarray:
    """Binary mask [side, side] of a shape filling a side x side box (pixel-centre test)."""
    c = (np.arange(side, dtype=np.float64) + 0.5) / side  # pixel centres in [0, 1]
    x, y = c[None, :], c[:, None]
    if shape == "square":
        mask = np.ones((side, side), dtype=bool)
    elif shape == "circle":
        mask = (x - 0.5) ** 2 + (y - 0.5) ** 2 <= 0.25
    elif shape == "triangle":  # apex at the top centre, base along the bottom edge
        mask = np.abs(x - 0.5) <= 0.5 * y
    elif shape == "diamond":
        mask = np.abs(x - 0.5) + np.abs(y - 0.5) <= 0.5
    else:
        raise ValueError(f"unknown shape {shape!r}")
    mask.setflags(write=False)
    return mask


@lru_cache(maxsize=8192)
def coverage_patch(shape: str, side_hi: int, phase_x: int, phase_y: int, ss: int) -> np.ndarray:
    """Fractional coverage [h, w] of a glyph of ``side_hi`` high-res pixels placed at a sub-pixel phase.

    The glyph's top-left corner sits ``phase`` high-res pixels to the right/below of the top-left of
    low-res pixel (0, 0) of the patch; the patch is the box-average of ``ss`` x ``ss`` blocks.
    """
    h = -(-(phase_y + side_hi) // ss)
    w = -(-(phase_x + side_hi) // ss)
    hi = np.zeros((h * ss, w * ss), dtype=np.float32)
    hi[phase_y : phase_y + side_hi, phase_x : phase_x + side_hi] = glyph_mask(shape, side_hi)
    patch = hi.reshape(h, ss, w, ss).mean(axis=(1, 3))
    patch.setflags(write=False)
    return patch


@lru_cache(maxsize=1024)
def hard_patch(shape: str, side_hi: int, ss: int) -> np.ndarray:
    """Binary (0/1) version of a pixel-aligned coverage patch: pixels at least half covered."""
    patch = (coverage_patch(shape, side_hi, 0, 0, ss) >= 0.5).astype(np.float32)
    patch.setflags(write=False)
    return patch


def object_placement(
    obj_shape: str, x0: float, y0: float, side: float, image_size: int, hard: bool = False
) -> tuple[np.ndarray, int, int]:
    """Coverage patch and its top-left pixel for a box with top-left (x0, y0) and side (fractions).

    Anti-aliased: the box is placed to 1/SUPERSAMPLE of a pixel. ``hard``: the box's corner is snapped to
    whole pixels and pixels at least half covered are filled (flat rendering, difficulty 0).
    """
    ss = SUPERSAMPLE
    side_hi = max(1, int(round(side * image_size * ss)))
    if hard:
        return hard_patch(obj_shape, side_hi, ss), int(round(x0 * image_size)), int(round(y0 * image_size))
    left_hi = int(round(x0 * image_size * ss))
    top_hi = int(round(y0 * image_size * ss))
    patch = coverage_patch(obj_shape, side_hi, left_hi % ss, top_hi % ss, ss)
    return patch, left_hi // ss, top_hi // ss


# ----------------------------------------------------------------------------------------------------
# background
# ----------------------------------------------------------------------------------------------------

_TEXTURE_GRID = 5


@lru_cache(maxsize=16)
def _interp_matrix(image_size: int) -> np.ndarray:
    """[image_size, grid] linear interpolation weights from a coarse grid to pixel centres."""
    pos = (np.arange(image_size) + 0.5) / image_size * (_TEXTURE_GRID - 1)
    lo = np.clip(np.floor(pos).astype(int), 0, _TEXTURE_GRID - 2)
    frac = pos - lo
    m = np.zeros((image_size, _TEXTURE_GRID), dtype=np.float32)
    m[np.arange(image_size), lo] = 1 - frac
    m[np.arange(image_size), lo + 1] = frac
    return m


def _background(scene: Scene, image_size: int, difficulty: float, rng: np.random.Generator) -> np.ndarray:
    tint = np.asarray(scene.background, dtype=np.float32) * (BACKGROUND_TINT * difficulty)
    img = np.empty((image_size, image_size, 3), dtype=np.float32)
    img[:] = tint
    if difficulty > 1.0:
        # Smooth texture from a coarse random grid, seeded by the scene only (static across frames).
        tex_rng = np.random.default_rng([scene.seed, 7])
        grid = tex_rng.uniform(-1.0, 1.0, size=(_TEXTURE_GRID, _TEXTURE_GRID)).astype(np.float32)
        m = _interp_matrix(image_size)
        field = m @ grid @ m.T  # [H, W]
        scale = (TEXTURE * (difficulty - 1.0)) * (0.5 + np.asarray(scene.background, dtype=np.float32))
        img += field[:, :, None] * scale
    return img


# ----------------------------------------------------------------------------------------------------
# rendering
# ----------------------------------------------------------------------------------------------------


def object_color(obj: WorldObject, difficulty: float) -> np.ndarray:
    """The rendered RGB (float, 0-255) of an object: base colour plus scaled shade jitter."""
    return np.clip(_COLOR_ARRAY[obj.color] + np.asarray(obj.shade, np.float32) * (SHADE_JITTER * difficulty), 0, 255)


def _composite(img: np.ndarray, obj: WorldObject, difficulty: float) -> None:
    n = img.shape[0]
    x0, y0, _, _ = obj.bbox
    patch, px, py = object_placement(obj.shape, x0, y0, obj.extent, n, hard=difficulty == 0)
    h, w = patch.shape
    # Clip the patch to the canvas (scenes built by hand may leave it).
    cy0, cx0 = max(py, 0), max(px, 0)
    cy1, cx1 = min(py + h, n), min(px + w, n)
    if cy0 >= cy1 or cx0 >= cx1:
        return
    alpha = patch[cy0 - py : cy1 - py, cx0 - px : cx1 - px, None]
    color = object_color(obj, difficulty)
    if difficulty > 1.0:
        # A light shading gradient across the object, direction from its shade jitter.
        yy = (np.arange(cy0, cy1, dtype=np.float32) - (py + h / 2)) / max(h, 1)
        xx = (np.arange(cx0, cx1, dtype=np.float32) - (px + w / 2)) / max(w, 1)
        ramp = obj.shade[0] * xx[None, :] + obj.shade[1] * yy[:, None]
        color = np.clip(color + (GRADIENT * (difficulty - 1.0) * 2.0) * ramp[:, :, None], 0, 255)
    region = img[cy0:cy1, cx0:cx1]
    region += alpha * (color - region)


def render_scene(
    scene: Scene, image_size: int = 32, difficulty: float = 1.0, frame: int = 0
) -> np.ndarray:
    """Render a scene to a uint8 RGB array [image_size, image_size, 3].

    Args:
        scene: the scene to draw.
        image_size: canvas side in pixels, 32-256.
        difficulty: 0 (flat) .. 1 (default) .. 2 (hard); see the module docstring.
        frame: frame index, only changes the pixel noise (videos re-render one scene per frame).
    """
    if not isinstance(scene, Scene):
        raise ValueError(f"scene must be a Scene, got {type(scene).__name__}")
    n = check_image_size(image_size)
    d = check_difficulty(difficulty)
    rng = np.random.default_rng([scene.seed, int(frame), 1])
    img = _background(scene, n, d, rng)
    for obj in scene.objects:
        _composite(img, obj, d)
    if d > 0:
        img += rng.normal(0.0, NOISE_SIGMA * d, size=img.shape).astype(np.float32)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def render_batch(
    scenes: Sequence[Scene], image_size: int = 32, difficulty: float = 1.0
) -> np.ndarray:
    """Render several scenes: uint8 [B, H, W, 3]."""
    return np.stack([render_scene(s, image_size, difficulty) for s in scenes])


# ----------------------------------------------------------------------------------------------------
# conversions
# ----------------------------------------------------------------------------------------------------


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] or [B, H, W, 3] -> float32 tensor [3, H, W] / [B, 3, H, W] in [0, 1]."""
    arr = np.asarray(images)
    if arr.dtype != np.uint8 or arr.ndim not in (3, 4) or arr.shape[-1] != 3:
        raise ValueError(f"images must be uint8 [H, W, 3] or [B, H, W, 3], got {arr.dtype} {arr.shape}")
    t = torch.from_numpy(np.ascontiguousarray(arr)).float().div_(255.0)
    return t.permute(2, 0, 1).contiguous() if t.ndim == 3 else t.permute(0, 3, 1, 2).contiguous()


def to_uint8(image) -> np.ndarray:
    """Any supported image to uint8 [H, W, 3]: PIL image, uint8/float numpy [H, W, 3], or a torch tensor
    [3, H, W] (float in [0, 1] or uint8). Floats are clipped to [0, 1] first."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    if isinstance(image, torch.Tensor):
        t = image.detach().cpu()
        if t.ndim != 3 or t.shape[0] != 3:
            raise ValueError(f"image tensor must have shape [3, H, W], got {tuple(t.shape)}")
        if t.dtype == torch.uint8:
            return t.permute(1, 2, 0).numpy()
        if not t.is_floating_point():
            raise ValueError(f"image tensor must be float in [0, 1] or uint8, got {t.dtype}")
        return (t.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"image array must have shape [H, W, 3], got {image.shape}")
        if image.dtype == np.uint8:
            return image
        if np.issubdtype(image.dtype, np.floating):
            return (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
        raise ValueError(f"image array must be uint8 or float in [0, 1], got {image.dtype}")
    raise ValueError(f"image must be a PIL image, numpy array or torch tensor, got {type(image).__name__}")


def to_pil(image) -> Image.Image:
    return Image.fromarray(to_uint8(image))
