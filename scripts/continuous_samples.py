"""Draw the continuous zoo target's sample strip of docs/pipeline_continuous.md (target-only, seed 0).

    python scripts/continuous_samples.py [--out docs/images/continuous_zoo_samples.png]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from PIL import Image

from mmspec.pipelines import ContinuousARImagePipeline

PROMPTS = ["a circle", "a square", "a diamond and a triangle", "a circle and a diamond", "four triangles",
           "four squares", "a white diamond", "a orange circle", "a circle above a square",
           "a triangle to the left of a square", "a cyan triangle and a blue circle", "a pink square and a purple diamond"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/images/continuous_zoo_samples.png")
    parser.add_argument("--scale", type=int, default=4, help="nearest-neighbour upscaling")
    args = parser.parse_args()
    pipe = ContinuousARImagePipeline.from_pretrained("mmspec/shapes-t2i-continuous")
    pipe.set_progress_bar_config(disable=True)
    images = pipe(PROMPTS, method="none", generator=torch.Generator().manual_seed(0), output_type="np").images
    framed = [np.pad(img, ((1, 1), (1, 1), (0, 0)), constant_values=0.5) for img in images]  # grey frame per image
    strip = (np.concatenate(framed, axis=1) * 255).round().astype(np.uint8)
    Image.fromarray(strip).resize((strip.shape[1] * args.scale, strip.shape[0] * args.scale), Image.NEAREST).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
