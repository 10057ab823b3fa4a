"""Tiny random pipelines of every family, saved as pipeline folders: what the demo's tests (and
``mmspec demo --tiny``) run on when a zoo entry is not built yet.

Every model here has random weights: the images, videos and texts are noise and acceptance rates mean
nothing. They exist to exercise the whole app (loading by path, both runs, statistics, overlays, the
block strip, streaming) in seconds on a CPU. Each family uses the real shapes world's vocabulary and the
zoo's bundled tokenizers, so the shapes examples and prompts of the demo work on them unchanged.

    >>> from mmspec.demos.tiny import build_tiny_pipelines
    >>> paths = build_tiny_pipelines("/tmp/tiny")    # {"vlm": ..., "ar_image": ..., "continuous": ..., "video": ...}
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

FAMILIES = ("vlm", "ar_image", "continuous", "video")


def build_tiny_ar_image(folder: str | os.PathLike, seed: int = 0) -> Path:
    """A random :class:`~mmspec.pipelines.ARImagePipeline` (1-layer d=32 target over the zoo's VQ tokenizer,
    8x8 tokens, EAGLE head, MuLo-SD parts) saved to ``folder``."""
    from mmspec.models.eagle import EagleHead
    from mmspec.models.llamagen import LlamaGenTransformer
    from mmspec.models.mulo import TokenUpsampler
    from mmspec.models.text import WordTokenizer
    from mmspec.models.tokenizers import load_zoo_tokenizer
    from mmspec.pipelines import ARImagePipeline
    from mmspec.world import vocabulary

    torch.manual_seed(seed)
    vq = load_zoo_tokenizer("vq")
    words = WordTokenizer(vocabulary())
    common = dict(n_head=2, multiple_of=16, model_type="t2i", vocab_size=vq.vocab_size, cls_token_num=16,
                  text_vocab_size=len(words), condition_rope="identity", class_dropout_prob=0.1)
    target = LlamaGenTransformer(dim=32, n_layer=1, block_size=64, caption_dim=32, **common).eval()
    low = LlamaGenTransformer(dim=16, n_layer=1, block_size=16, caption_dim=16, **common).eval()
    head = EagleHead(hidden_size=32, vocab_size=vq.vocab_size, num_attention_heads=2).eval()
    upsampler = TokenUpsampler(vocab_size=vq.vocab_size, ratio=2, dim=16).eval()
    pipe = ARImagePipeline(target, vq, head, words, mulo_drafter=low, mulo_upsampler=upsampler)
    pipe.save_pretrained(folder)
    return Path(folder)


def build_tiny_vlm(folder: str | os.PathLike, seed: int = 0) -> Path:
    """A random shapes captioner (the zoo's tiny LLaVA size), its draft VLM and the four draft heads,
    assembled like ``mmspec/shapes-vlm`` by the zoo recipe (so plain prompts get the captioner's layout)."""
    from mmspec.models import shapes_vlm as sv
    from mmspec.models.recipes import build_zoo_vlm
    from mmspec.models.vlm_drafters import EagleVLMHead, FlashHead, SpecVLMHead, ViSpecHead

    folder = Path(folder)
    target = sv.build_model("tiny", seed=seed)
    target.save_pretrained(folder / "target")
    sv.build_processor().save_pretrained(folder / "target")
    sv.build_model("tiny", seed=seed + 1, text_layers=1).save_pretrained(folder / "draft")
    width, vocab = target.config.text_config.hidden_size, target.get_output_embeddings().weight.shape[0]
    torch.manual_seed(seed)
    heads = {"eagle_head": EagleVLMHead(width, vocab), "flash_head": FlashHead(width, vocab, num_latents=8),
             "vispec_head": ViSpecHead(width, vocab), "specvlm_head": SpecVLMHead(width, vocab)}
    for name, head in heads.items():
        head.save_pretrained(folder / name)
    build_zoo_vlm.main(["--folder", str(folder)])
    return folder


def build_tiny_continuous(folder: str | os.PathLike, seed: int = 0) -> Path:
    """A random text-conditioned :class:`~mmspec.pipelines.continuous_ar_image.ContinuousARImagePipeline`
    (2-layer d=32 target MAR, 1-layer d=16 draft MAR, 8x8 tokens of the zoo's continuous tokenizer)."""
    from mmspec.models.mar import MARModel
    from mmspec.models.text import WordTokenizer
    from mmspec.models.tokenizers import load_zoo_tokenizer
    from mmspec.pipelines.continuous_ar_image import ContinuousARImagePipeline
    from mmspec.world import vocabulary

    vae = load_zoo_tokenizer("continuous")
    words = WordTokenizer(vocabulary())

    def mar(depth: int, width: int, model_seed: int) -> MARModel:
        torch.manual_seed(model_seed)
        grid = vae.config.image_size // vae.config.patch_size
        return MARModel(grid_size=grid, token_dim=vae.latent_dim, encoder_embed_dim=width, encoder_depth=depth,
                        encoder_num_heads=2, decoder_embed_dim=width, decoder_depth=depth, decoder_num_heads=2,
                        buffer_size=8, condition_type="text", text_vocab_size=len(words), diffloss_d=1,
                        diffloss_w=32, num_sampling_steps=8, clip_denoised=3.0).eval()

    pipe = ContinuousARImagePipeline(mar(2, 32, seed), vae, draft_transformer=mar(1, 16, seed + 1),
                                     text_tokenizer=words)
    pipe.save_pretrained(folder)
    return Path(folder)


def build_tiny_video(folder: str | os.PathLike, seed: int = 0) -> Path:
    """A random :class:`~mmspec.pipelines.ar_video.ARVideoPipeline` (2-layer d=32 block-causal target,
    1-layer d=16 drafter, 8 frames in blocks of the model's default size, the zoo's continuous tokenizer)."""
    from mmspec.models.text import WordTokenizer
    from mmspec.models.tokenizers import load_zoo_tokenizer
    from mmspec.models.video import BlockCausalVideoTransformer
    from mmspec.pipelines.ar_video import ARVideoPipeline
    from mmspec.world import vocabulary

    def model(layers: int, dim: int, model_seed: int) -> BlockCausalVideoTransformer:
        torch.manual_seed(model_seed)
        net = BlockCausalVideoTransformer(num_layers=layers, dim=dim, num_heads=4, num_frames=8, text_length=20)
        with torch.no_grad():
            for p in net.parameters():
                p.normal_(0.0, 0.05)
        return net.eval()

    pipe = ARVideoPipeline(model(2, 32, seed), load_zoo_tokenizer("continuous"), model(1, 16, seed + 1),
                           WordTokenizer(vocabulary()))
    pipe.save_pretrained(folder)
    return Path(folder)


BUILDERS = {"vlm": build_tiny_vlm, "ar_image": build_tiny_ar_image, "continuous": build_tiny_continuous,
            "video": build_tiny_video}


def build_tiny_pipelines(root: str | os.PathLike, families: tuple[str, ...] = FAMILIES) -> dict[str, str]:
    """Build (or reuse, when already saved) one tiny random pipeline folder per family under ``root``.

    Returns ``{family: folder}`` for :func:`mmspec.demos.app.build_app` / ``mmspec demo --vlm ...``.
    """
    unknown = sorted(set(families) - set(BUILDERS))
    if unknown:
        raise ValueError(f"families must be among {list(BUILDERS)}, got {unknown}")
    root = Path(root)
    paths = {}
    for family in families:
        folder = root / f"tiny-{family.replace('_', '-')}"
        if not (folder / "model_index.json").is_file():
            BUILDERS[family](folder)
        paths[family] = str(folder)
    return paths
