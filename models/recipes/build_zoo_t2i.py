"""Assemble the ``mmspec/shapes-t2i`` pipeline folder from the trained parts.

After ``train_t2i`` (transformer/), ``train_eagle`` (eagle_head/, and with ``--num-future`` the optional
eagle_block_head/) and ``train_mulo`` (mulo_drafter/, mulo_upsampler/) have written their parts into the
folder, this adds the VQ tokenizer and the
pipeline's ``model_index.json`` (diffusers layout), so ``ARImagePipeline.from_pretrained("mmspec/shapes-t2i")``
works offline.

    python -m mmspec.models.recipes.build_zoo_t2i --folder models/zoo/shapes-t2i
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mmspec.models.eagle import EagleHead
from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.mulo import TokenUpsampler
from mmspec.models.recipes.common import DEFAULT_VQ, save_zoo_folder
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import VQTokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=Path("models/zoo/shapes-t2i"))
    parser.add_argument("--vq", type=Path, default=DEFAULT_VQ)
    args = parser.parse_args(argv)
    from mmspec.pipelines import ARImagePipeline

    folder = args.folder
    missing = [p for p in ("transformer", "eagle_head", "mulo_drafter", "mulo_upsampler") if not (folder / p).is_dir()]
    if missing:
        raise SystemExit(f"{folder} lacks {missing}: run the training recipes first (see the module docstring)")
    half = torch.float16  # these parts are kept in fp16 (loading computes in fp32; the block head is rounded here)
    pipe = ARImagePipeline(
        transformer=LlamaGenTransformer.from_pretrained(folder / "transformer", torch_dtype=half),
        vqvae=VQTokenizer.from_pretrained(args.vq),
        eagle_head=EagleHead.from_pretrained(folder / "eagle_head"),
        text_tokenizer=WordTokenizer.load(folder / "transformer" / "text_vocab.json"),
        mulo_drafter=LlamaGenTransformer.from_pretrained(folder / "mulo_drafter", torch_dtype=half),
        mulo_upsampler=TokenUpsampler.from_pretrained(folder / "mulo_upsampler", torch_dtype=half),
        eagle_block_head=EagleHead.from_pretrained(folder / "eagle_block_head", torch_dtype=half)
        if (folder / "eagle_block_head").is_dir() else None,
    )
    save_zoo_folder(pipe, folder)
    print(f"wrote {folder}/model_index.json")


if __name__ == "__main__":
    main()
