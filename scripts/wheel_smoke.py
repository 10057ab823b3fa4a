"""One call per pipeline on the zoo, with the README's prompts, printed as a JSON digest.

Run from the checkout and from an installed wheel (``scripts/wheel_smoke.sh``): the two digests must be
equal, which shows that the wheel carries every file the zoo needs and decodes exactly as the checkout does.
Greedy where the pipeline has greedy decoding, a fixed seed otherwise.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch


def digest(tensor: torch.Tensor) -> str:
    """A short fingerprint of a tensor's exact values."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def vlm() -> dict[str, str]:
    from mmspec.pipelines import VLMPipeline
    from mmspec.world import render_scene, sample_scene

    pipe = VLMPipeline.from_pretrained("mmspec/shapes-vlm")
    pipe.set_progress_bar_config(disable=True)
    image = render_scene(sample_scene(0), image_size=64)
    out = pipe(image, "describe the image in detail.", method="flash", max_new_tokens=128)
    return {"text": out.text[0]}


def ar_image() -> dict[str, str]:
    from mmspec.pipelines import ARImagePipeline

    pipe = ARImagePipeline.from_pretrained("mmspec/shapes-t2i")
    pipe.set_progress_bar_config(disable=True)
    out = pipe("a red circle", method="eagle", do_sample=False, output_type="tokens")
    return {"tokens": digest(out.tokens)}


def continuous() -> dict[str, str]:
    from mmspec.pipelines import ContinuousARImagePipeline

    pipe = ContinuousARImagePipeline.from_pretrained("mmspec/shapes-t2i-continuous")
    pipe.set_progress_bar_config(disable=True)
    out = pipe("two blue squares", method="cspd", num_iter=16, output_type="latent",
               generator=torch.Generator().manual_seed(0))
    return {"tokens": digest(out.tokens)}


def video() -> dict[str, str]:
    from mmspec.pipelines import ARVideoPipeline

    pipe = ARVideoPipeline.from_pretrained("mmspec/shapes-video")
    pipe.set_progress_bar_config(disable=True)
    out = pipe("a red circle moving right", method="sdvg", output_type="latent",
               generator=torch.Generator().manual_seed(0))
    return {"latents": digest(out.latents)}


def main() -> int:
    import mmspec

    torch.manual_seed(0)
    report = {"mmspec_file": mmspec.__file__, "vlm": vlm(), "ar_image": ar_image(), "continuous": continuous(),
              "video": video()}
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
