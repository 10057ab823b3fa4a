"""The architectures the systems benchmark builds: one table, public config values cited per entry.

Each :class:`SystemSpec` names a pipeline family, the builder that assembles it (:mod:`.builders`), the
architecture's values (only those that set the cost of a forward: widths, depths, heads, vocabularies, token
counts) and the methods it runs. Weights are random: the benchmark measures how close a loop comes to its
bound, which needs the real shapes, not trained values (acceptance is controlled, :mod:`.controlled`).

Vision towers run only in the prefill, which the decode measurements exclude; on a CPU they are built with
one layer (same patching, so the same image-token span) to keep the prefill affordable (``vision_depth``
is the full depth, used on a GPU).

The ``tiny-*`` entries are the same families at test size (seconds on a CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mmspec.models.llamagen import LLAMAGEN_PRESETS, ffn_hidden_dim
from mmspec.models.mar import mar_config

#: the families of a :class:`SystemSpec` and how their rows are run (token chains or blocks)
TOKEN_FAMILIES = ("ar_image", "vlm")
BLOCK_FAMILIES = ("continuous", "video")


@dataclass(frozen=True)
class SystemSpec:
    """One benchmarked architecture.

    Attributes:
        name: the ``--systems`` name.
        family: the pipeline family ("ar_image", "vlm", "continuous", "video").
        builder: the :mod:`.builders` function that assembles its pipeline.
        config: the architecture's values (see each builder for the keys it reads).
        source: where the values come from.
        methods: the methods its rows run (with the pipeline's settings for a plain ``method=name`` call).
        new_tokens: tokens (AR images, VLMs) or blocks (video) generated per row by default.
        guidance_scale: classifier-free guidance of the call (1.0: none).
        cpu: whether the default CPU run includes it (sizes a 2-core CPU decodes in minutes).
        gpu: whether the default GPU run includes it (the full sizes).
        notes: sentences the report prints under the system's heading.
    """

    name: str
    family: str
    builder: str
    config: Mapping[str, Any]
    source: str
    methods: tuple[str, ...]
    new_tokens: int
    guidance_scale: float = 1.0
    cpu: bool = False
    gpu: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)


def _llamagen(preset: str) -> dict[str, Any]:
    size = LLAMAGEN_PRESETS[preset]
    return {**size, "vocab_size": 16384, "block_size": 256, "cls_token_num": 120, "caption_dim": 2048,
            "prompt_words": 24, "head_intermediate": ffn_hidden_dim(size["dim"], 256, None)}


# LlamaGen (Sun et al. 2024; github.com/FoundationVision/LlamaGen, autoregressive/models/gpt.py): GPT-L 1024 x 24,
# 16 heads; GPT-XL 1280 x 36, 20 heads; VQ-16 codebook 16384, 16x16 tokens at 256 px; t2i: 120 caption tokens of
# flan-t5-xl (2048 wide), sample_t2i.py's cfg-scale 7.5. EAGLE head: one Llama layer at the target's width.
_LLAMAGEN_SOURCE = "LlamaGen gpt.py GPT_models (L: 1024x24, 16 heads; XL: 1280x36, 20 heads), VQ-16 16384 codes, 120 T5 tokens"
# Janus-Pro-1B (deepseek-ai/Janus-Pro-1B config.json, language_config): hidden 2048, 24 layers, 16 heads,
# intermediate 5632, vocabulary 102400; generation: VQ-16 codebook 16384, 24x24 = 576 tokens at 384 px,
# gen_aligner 8 -> 2048, gen_head 2048 -> 16384; cfg_weight 5.
_JANUS = {"hidden": 2048, "layers": 24, "heads": 16, "intermediate": 5632, "text_vocab": 102400, "vocab_size": 16384,
          "grid": 24, "max_positions": 16384, "prompt_words": 24, "max_prompt_length": 256}
# LLaVA-1.5-7B (llava-hf/llava-1.5-7b-hf config.json): Vicuna/Llama-2-7B 4096 x 32, 32 heads, intermediate 11008,
# vocabulary 32064, image token 32000; CLIP ViT-L/14 at 336 px (24 layers, 1024 wide): 576 image tokens.
_LLAVA_7B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 32, "intermediate": 11008, "vocab": 32064,
             "image_token": 32000, "vision_hidden": 1024, "vision_depth": 24, "vision_heads": 16,
             "vision_intermediate": 4096, "image_size": 336, "patch": 14, "text_before": 8, "text_after": 40}
# The CPU member: LLaVA-1.5's architecture and recipe on TinyLlama-1.1B (TinyLLaVA, Zhou et al. 2024: the smallest
# Llama-family LM trained with the LLaVA-1.5 recipe): 2048 x 22, 32 heads, 4 kv heads, intermediate 5632, the
# Llama-2 vocabulary (padded to LLaVA-1.5's 32064 here so one tokenizer serves both).
_LLAVA_TINYLLAMA = {**_LLAVA_7B, "hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "intermediate": 5632}
# Qwen2-VL-2B (Qwen/Qwen2-VL-2B-Instruct config.json): 1536 x 28, 12 heads, 2 kv heads, intermediate 8960,
# vocabulary 151936, rope_theta 1e6, mrope_section [16, 24, 24], image token 151655 (first special id 151643);
# vision: 32 layers, 1280 wide, 16 heads, patch 14, 2x2 merge: a 672x672 image is 48x48 patches = 576 tokens.
_QWEN2_VL = {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960, "vocab": 151936,
             "rope_theta": 1e6, "mrope_section": [16, 24, 24], "first_special": 151643, "vision_depth": 32,
             "vision_hidden": 1280, "vision_heads": 16, "patch": 14, "grid": 48, "text_before": 8, "text_after": 40}
# MAR (Li et al. 2024; github.com/LTH14/mar): MAR-L 1024 x 16 + 16, diffusion head 8 x 1280; MAR-B 768 x 12 + 12,
# head 6 x 1024 (mmspec.models.mar.mar_config); 16x16 tokens of 16 channels at 256 px, 64 iterations, 100
# diffusion steps, cfg 3.0. CSpD drafts with the next size down (MAR-B for MAR-L, as in the CSpD paper).
# Video: a Wan2.1-T2V-1.3B-sized causal DiT (1536 x 30, 12 heads, FFN 8960) in Self-Forcing's block layout (21
# latent frames, 3 per block, 4 steps); 480x832 latents (60x104, patch 2: 1560 tokens a frame) become a square
# 80x80 grid (1600 tokens a frame). SDVG drafter: the same width at a quarter of the depth (the zoo pair's ratio).
_VIDEO = {"dim": 1536, "layers": 30, "heads": 12, "mlp_ratio": 8960 / 1536, "latent_size": 80, "patch": 2,
          "num_frames": 21, "frames_per_block": 3, "text_length": 512, "draft_layers": 8, "prompt_words": 24}

_MAR_L = {"target": mar_config("mar_large"), "draft": mar_config("mar_base"), "diffusion_steps": 100}

# "eagle+tree": EAGLE with EAGLE-2's dynamic tree (evaluation/systems/token_rows.py, method_config)
_AR_METHODS = ("eagle", "eagle+tree", "sjd", "scd", "lantern", "gsd")
_VLM_METHODS = ("eagle", "eagle+tree", "flash", "vispec", "specvlm")

SYSTEMS: dict[str, SystemSpec] = {spec.name: spec for spec in (
    SystemSpec("llamagen-t2i-l", "ar_image", "llamagen", _llamagen("GPT-L"), _LLAMAGEN_SOURCE, _AR_METHODS, 256, 7.5,
               cpu=True),
    SystemSpec("llamagen-t2i-xl", "ar_image", "llamagen", _llamagen("GPT-XL"), _LLAMAGEN_SOURCE, _AR_METHODS, 256,
               7.5, cpu=True),
    SystemSpec("janus-pro-1b", "ar_image", "janus", _JANUS, "deepseek-ai/Janus-Pro-1B config.json", _AR_METHODS, 576,
               5.0, cpu=True),
    SystemSpec("llava-1.5-7b", "vlm", "llava", {**_LLAVA_7B, "draft": _LLAVA_TINYLLAMA},
               "llava-hf/llava-1.5-7b-hf config.json", (*_VLM_METHODS, "draft_vlm"), 256,
               notes=("draft_vlm drafts with the TinyLlama-1.1B member",)),
    SystemSpec("llava-1.5-tinyllama", "vlm", "llava", _LLAVA_TINYLLAMA,
               "LLaVA-1.5 architecture on TinyLlama-1.1B (TinyLLaVA)", _VLM_METHODS, 256, cpu=True),
    SystemSpec("qwen2-vl-2b", "vlm", "qwen2_vl", _QWEN2_VL, "Qwen/Qwen2-VL-2B-Instruct config.json", _VLM_METHODS, 256,
               cpu=True),
    SystemSpec("mar-l", "continuous", "mar", {**_MAR_L, "num_iter": 64},
               "MAR-L target, MAR-B draft (LTH14/mar; mmspec.models.mar.mar_config)", ("cspd",), 1, 3.0),
    SystemSpec("mar-l-cpu", "continuous", "mar", {**_MAR_L, "num_iter": 16},
               "MAR-L target, MAR-B draft (LTH14/mar; mmspec.models.mar.mar_config), 16 iterations", ("cspd",), 1,
               3.0, cpu=True, gpu=False,
               notes=("MAR-L and MAR-B at full size with 16 generation iterations instead of 64 (16 tokens each): "
                      "a 16-iteration image takes minutes on one CPU core and a row needs three (warm-up, "
                      "target-only, CSpD)",)),
    SystemSpec("video-dit-1.3b", "video", "video_dit", _VIDEO, "Wan2.1-T2V-1.3B sizes in Self-Forcing's blocks",
               ("sdvg",), 7),
    SystemSpec("video-dit-1.3b-cpu", "video", "video_dit", {**_VIDEO, "latent_size": 8},
               "Wan2.1-T2V-1.3B sizes in Self-Forcing's blocks, 8x8 latents", ("sdvg",), 7, cpu=True, gpu=False,
               notes=("the 1.3B DiT at full width and depth on 8x8 latents (16 tokens a frame): a CPU cannot run "
                      "80x80 latents in minutes",)),
    # test sizes: the same families, seconds on a CPU
    SystemSpec("tiny-llamagen", "ar_image", "llamagen",
               {"n_layer": 2, "n_head": 4, "dim": 64, "vocab_size": 512, "block_size": 64, "cls_token_num": 8,
                "caption_dim": 32, "prompt_words": 4, "head_intermediate": 128}, "test size", _AR_METHODS, 24, 3.0,
               gpu=False),
    SystemSpec("tiny-janus", "ar_image", "janus",
               {"hidden": 64, "layers": 2, "heads": 4, "intermediate": 128, "text_vocab": 300, "vocab_size": 512,
                "grid": 6, "max_positions": 512, "prompt_words": 4, "max_prompt_length": 16}, "test size",
               ("eagle",), 20, 3.0, gpu=False),
    SystemSpec("tiny-llava", "vlm", "llava",
               {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 600,
                "image_token": 580, "vision_hidden": 32, "vision_depth": 1, "vision_heads": 2,
                "vision_intermediate": 64, "image_size": 16, "patch": 4, "text_before": 3, "text_after": 5,
                "draft": {"hidden": 32, "layers": 1, "heads": 4, "kv_heads": 2, "intermediate": 64}},
               "test size", (*_VLM_METHODS, "draft_vlm"), 20, gpu=False),
    SystemSpec("tiny-qwen2-vl", "vlm", "qwen2_vl",
               {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 600,
                "rope_theta": 1e4, "mrope_section": [4, 2, 2], "first_special": 580, "vision_depth": 1,
                "vision_hidden": 32, "vision_heads": 2, "patch": 4, "grid": 4, "text_before": 3, "text_after": 5},
               "test size", ("eagle",), 20, gpu=False),
    SystemSpec("tiny-mar", "continuous", "mar",
               {"target": {**mar_config("mar_base"), "encoder_embed_dim": 32, "encoder_depth": 1, "encoder_num_heads": 2,
                           "decoder_embed_dim": 32, "decoder_depth": 1, "decoder_num_heads": 2, "diffloss_d": 1,
                           "diffloss_w": 32, "grid_size": 4, "buffer_size": 4, "num_classes": 10},
                "draft": {**mar_config("mar_base"), "encoder_embed_dim": 16, "encoder_depth": 1, "encoder_num_heads": 2,
                          "decoder_embed_dim": 16, "decoder_depth": 1, "decoder_num_heads": 2, "diffloss_d": 1,
                          "diffloss_w": 16, "grid_size": 4, "buffer_size": 4, "num_classes": 10},
                "num_iter": 8, "diffusion_steps": 4}, "test size", ("cspd",), 1, 3.0, gpu=False),
    SystemSpec("tiny-video", "video", "video_dit",
               {"dim": 32, "layers": 2, "heads": 2, "mlp_ratio": 2.0, "latent_size": 4, "patch": 2, "num_frames": 6,
                "frames_per_block": 2, "text_length": 4, "draft_layers": 1, "prompt_words": 3}, "test size",
               ("sdvg",), 3, gpu=False),
)}


def check_systems(names: list[str]) -> list[SystemSpec]:
    """The specs of ``names`` (``ValueError`` naming the unknown one and the choices)."""
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown:
        raise ValueError(f"--systems: unknown system {unknown[0]!r}; choose from {', '.join(SYSTEMS)}")
    return [SYSTEMS[name] for name in names]
