"""The benchmarked architectures built from the repo's model classes and assembled into the repo's pipelines.

Each builder takes a :class:`~.specs.SystemSpec` and returns a :class:`System`: the pipeline (random
weights, the drafter components its methods use: EAGLE / FLASH / ViSpec / SpecVLM heads on the target's
width, a draft VLM or MAR of the next size down, a shallower video drafter) and what a row needs to drive
the pipeline's own loop the way its ``__call__`` does (:mod:`.token_rows`, :mod:`.block_rows`).

Random targets give near-uniform logits; every token target's output head is scaled up (as the repo's tests
do) so greedy decoding rarely meets a near-tie that float rounding could flip between a one-token and a
(K+1)-token forward. That changes no cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmspec.methods import BuildRequest
from mmspec.sampling import SamplingConfig

from .specs import SystemSpec

#: factor applied to a random token target's output head (sharper logits, fewer near-ties)
HEAD_SHARPENING = 8.0
#: synthetic word vocabulary of the word-prompt pipelines (AR images, video): "aa" .. "jv"
WORDS = tuple(a + b for a in "abcdefghij" for b in "abcdefghijklmnopqrstuvwxyz")[:256]


@dataclass
class System:
    """A built architecture: its spec, pipeline, device and dtype, and how its loop is driven.

    ``loop_inputs(batch, seed)`` returns the loop's ``(input_ids or None, attention_mask, model inputs)``;
    ``request(batch, generator)`` the method's :class:`~mmspec.methods.BuildRequest` (greedy);
    ``target_runner(drafter, config)`` the loop's target as the pipeline builds it; ``token_limit`` the
    first token id a corrupted draft may not take (:mod:`.controlled`); ``loop_kwargs`` what else the
    pipeline passes its loop.
    """

    spec: SystemSpec
    pipe: Any
    device: torch.device
    dtype: torch.dtype
    token_limit: int = 0
    loop_kwargs: dict[str, Any] | None = None

    def request(self, batch: int, generator: torch.Generator | None) -> BuildRequest:
        return BuildRequest(SamplingConfig(do_sample=False), generator, self.spec.guidance_scale, batch)

    def prompts(self, batch: int, seed: int) -> list[str]:
        """``batch`` prompts of ``prompt_words`` random words of :data:`WORDS` (one per row)."""
        g = torch.Generator().manual_seed(seed)
        count = int(self.spec.config.get("prompt_words", 8))
        return [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (count,), generator=g).tolist())
                for _ in range(batch)]


class ARImageSystem(System):
    """An :class:`~mmspec.pipelines.ARImagePipeline`: prompts encoded by the pipeline, its target runner."""

    def loop_inputs(self, batch: int, seed: int) -> tuple[None, torch.Tensor, dict[str, Any]]:
        inputs, mask, _ = self.pipe.encode_condition(self.prompts(batch, seed), None, 1, self.spec.guidance_scale)
        return None, mask, inputs

    def target_runner(self, drafter: Any, config: Any) -> Any:
        return self.pipe.target_runner(drafter, self.spec.guidance_scale)


class VLMSystem(System):
    """A :class:`~mmspec.pipelines.VLMPipeline` target driven by :class:`~mmspec.models.vlm_targets.VLMRunner`
    on prompts of random words around one image span (``text_before`` + image + ``text_after`` tokens)."""

    def request(self, batch: int, generator: torch.Generator | None) -> BuildRequest:
        return BuildRequest(SamplingConfig(do_sample=False), generator, batch_size=batch)

    def target_runner(self, drafter: Any, config: Any) -> Any:
        return self.pipe.target_runner(drafter, config)

    def _words(self, batch: int, count: int, g: torch.Generator) -> torch.Tensor:
        return torch.randint(1, self.token_limit, (batch, count), generator=g)

    def loop_inputs(self, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        c, g = self.spec.config, torch.Generator().manual_seed(seed)
        before, after = self._words(batch, c["text_before"], g), self._words(batch, c["text_after"], g)
        if self.spec.builder == "llava":
            tokens = (c["image_size"] // c["patch"]) ** 2
            image = torch.full((batch, tokens), c["image_token"])
            pixels = torch.randn(batch, 3, c["image_size"], c["image_size"], generator=g)
            ids = torch.cat([before, image, after], 1)
            inputs = {"pixel_values": pixels.to(self.device, self.dtype)}
        else:
            special = qwen_special_ids(c["first_special"])
            grid, tokens = c["grid"], (c["grid"] // 2) ** 2
            span = torch.tensor([special["vision_start_token_id"], *[special["image_token_id"]] * tokens,
                                 special["vision_end_token_id"]]).expand(batch, -1)
            ids = torch.cat([before, span, after], 1)
            pixels = torch.randn(batch * grid * grid, 3 * 2 * c["patch"] ** 2, generator=g)
            inputs = {"pixel_values": pixels.to(self.device, self.dtype),
                      "image_grid_thw": torch.tensor([[1, grid, grid]] * batch, device=self.device),
                      "mm_token_type_ids": (ids == special["image_token_id"]).int().to(self.device)}
        return ids.to(self.device), torch.ones_like(ids, device=self.device), inputs


# -- AR images ----------------------------------------------------------------------------------------------------
def build_llamagen(spec: SystemSpec, device: torch.device, dtype: torch.dtype) -> ARImageSystem:
    """LlamaGen t2i (word-table condition of ``cls_token_num`` slots; the decode is LlamaGen's) + EAGLE head."""
    from mmspec.models.eagle import EagleHead
    from mmspec.models.llamagen import LlamaGenTransformer
    from mmspec.models.text import WordTokenizer
    from mmspec.models.tokenizers import VQTokenizer
    from mmspec.pipelines import ARImagePipeline

    c = spec.config
    transformer = LlamaGenTransformer(dim=c["dim"], n_layer=c["n_layer"], n_head=c["n_head"], model_type="t2i",
                                      cls_token_num=c["cls_token_num"], caption_dim=c["caption_dim"],
                                      vocab_size=c["vocab_size"], block_size=c["block_size"], text_vocab_size=len(WORDS))
    _sharpen(transformer.output)
    head = EagleHead(hidden_size=c["dim"], vocab_size=c["vocab_size"], num_attention_heads=c["n_head"],
                     intermediate_size=c["head_intermediate"])
    grid = int(round(c["block_size"] ** 0.5))
    vqvae = VQTokenizer(codebook_size=c["vocab_size"], patch_size=16, image_size=16 * grid)
    _cast(device, dtype, transformer, head)
    pipe = ARImagePipeline(transformer, vqvae, eagle_head=head, text_tokenizer=WordTokenizer(list(WORDS)))
    return _quiet(ARImageSystem(spec, pipe, device, dtype, token_limit=c["vocab_size"]))


def build_janus(spec: SystemSpec, device: torch.device, dtype: torch.dtype) -> ARImageSystem:
    """Janus-Pro's generation path (transformers' Janus model through the repo's adapter) + EAGLE head. The
    understanding tower and the VQ decoder are minimal: image generation never runs them."""
    from transformers import (
        JanusConfig,
        JanusForConditionalGeneration,
        JanusVisionConfig,
        JanusVQVAEConfig,
        LlamaConfig,
    )

    from mmspec.models.eagle import EagleHead
    from mmspec.models.janus import JanusImageGenerator, JanusVQDecoder
    from mmspec.models.text import WordTokenizer
    from mmspec.pipelines import ARImagePipeline

    c = spec.config
    text = LlamaConfig(vocab_size=c["text_vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                       num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["heads"],
                       max_position_embeddings=c["max_positions"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = JanusVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4,
                               projection_dim=c["hidden"], num_image_tokens=16, mlp_ratio=2)
    vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=c["vocab_size"], latent_channels=32, base_channels=32,
                          channel_multiplier=[1, 1], num_res_blocks=1, projection_dim=c["hidden"],
                          image_token_embed_dim=c["hidden"], num_patches=c["grid"])
    model = JanusForConditionalGeneration(JanusConfig(text_config=text, vision_config=vision, vq_config=vq)).eval()
    _sharpen(model.model.generation_head.vision_head)
    generator = JanusImageGenerator(model, max_prompt_length=c["max_prompt_length"])
    head = EagleHead(hidden_size=c["hidden"], vocab_size=c["vocab_size"], num_attention_heads=c["heads"],
                     intermediate_size=c["intermediate"])
    _cast(device, dtype, generator, head)
    pipe = ARImagePipeline(generator, JanusVQDecoder(model.model.vqmodel), eagle_head=head,
                           text_tokenizer=WordTokenizer(list(WORDS)))
    return _quiet(ARImageSystem(spec, pipe, device, dtype, token_limit=c["vocab_size"]))


# -- VLMs ---------------------------------------------------------------------------------------------------------
def _vlm_heads(hidden: int, vocab: int, heads: int, kv_heads: int, intermediate: int) -> dict[str, Any]:
    """The VLM pipeline's draft heads on the target's width (FLASH: 64 latents, 5 futures; ViSpec: 2 queries;
    SpecVLM: stride 4, the papers' settings)."""
    from mmspec.models.vlm_drafters import EagleVLMHead, FlashHead, SpecVLMHead, ViSpecHead

    shape = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
             "max_position_embeddings": 8192}
    return {"eagle_head": EagleVLMHead(hidden, vocab, **shape),
            "flash_head": FlashHead(hidden, vocab, num_latents=64, num_future=5, **shape),
            "vispec_head": ViSpecHead(hidden, vocab, num_queries=2, **shape),
            "specvlm_head": SpecVLMHead(hidden, vocab, stride=4, **shape)}


def _llava_model(c: dict[str, Any], text: dict[str, Any], vision_depth: int) -> Any:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    clip = dict(model_type="clip_vision_model", hidden_size=c["vision_hidden"], intermediate_size=c["vision_intermediate"],
                num_hidden_layers=vision_depth, num_attention_heads=c["vision_heads"], image_size=c["image_size"],
                patch_size=c["patch"], projection_dim=c["vision_hidden"])
    lm = dict(model_type="llama", vocab_size=c["vocab"], hidden_size=text["hidden"], intermediate_size=text["intermediate"],
              num_hidden_layers=text["layers"], num_attention_heads=text["heads"], num_key_value_heads=text["kv_heads"],
              max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0, bos_token_id=None,
              eos_token_id=None)
    config = LlavaConfig(vision_config=clip, text_config=lm, image_token_index=c["image_token"],
                         image_seq_length=(c["image_size"] // c["patch"]) ** 2, tie_word_embeddings=False)
    model = LlavaForConditionalGeneration(config).eval()
    _sharpen(model.lm_head)
    return model


def build_llava(spec: SystemSpec, device: torch.device, dtype: torch.dtype) -> VLMSystem:
    """LLaVA-1.5 (CLIP tower + MLP projector + Llama LM) with the four draft heads and, when the spec names a
    ``draft`` LM, a draft VLM of that size."""
    c = spec.config
    depth = _vision_depth(c["vision_depth"], device)
    target = _llava_model(c, c, depth)
    parts = _vlm_heads(c["hidden"], c["vocab"], c["heads"], c["kv_heads"], c["intermediate"])
    if "draft" in c:
        parts["draft_model"] = _llava_model(c, {**c, **c["draft"]}, depth)
    return _vlm_system(spec, target, parts, device, dtype, token_limit=c["image_token"])


def qwen_special_ids(first_special: int) -> dict[str, int]:
    """Qwen2-VL's vision token ids at their offsets from the first special id (151643 in the release)."""
    return {"vision_start_token_id": first_special + 9, "vision_end_token_id": first_special + 10,
            "image_token_id": first_special + 12, "video_token_id": first_special + 13}


def build_qwen2_vl(spec: SystemSpec, device: torch.device, dtype: torch.dtype) -> VLMSystem:
    """Qwen2-VL (M-RoPE LM, 2x2-merging ViT) with the four draft heads."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    c = spec.config
    rope = {"rope_type": "default", "rope_theta": c["rope_theta"], "mrope_section": list(c["mrope_section"])}
    text = dict(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                max_position_embeddings=32768, rope_parameters=rope, pad_token_id=0, bos_token_id=None,
                eos_token_id=None, tie_word_embeddings=False)
    vision = dict(depth=_vision_depth(c["vision_depth"], device), embed_dim=c["vision_hidden"],
                  num_heads=c["vision_heads"], mlp_ratio=4, hidden_size=c["hidden"], patch_size=c["patch"],
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                           **qwen_special_ids(c["first_special"]))
    target = Qwen2VLForConditionalGeneration(config).eval()
    _sharpen(target.lm_head)
    parts = _vlm_heads(c["hidden"], c["vocab"], c["heads"], c["kv_heads"], c["intermediate"])
    return _vlm_system(spec, target, parts, device, dtype, token_limit=c["first_special"])


def _vlm_system(spec: SystemSpec, target: Any, parts: dict[str, Any], device: torch.device, dtype: torch.dtype,
                token_limit: int) -> VLMSystem:
    from mmspec.models.shapes_vlm import build_processor
    from mmspec.pipelines import VLMPipeline

    _cast(device, dtype, target, *parts.values())
    # the loop is driven with token ids directly; the processor is only the pipeline's required component
    pipe = VLMPipeline(target, build_processor(), **parts)
    return _quiet(VLMSystem(spec, pipe, device, dtype, token_limit=token_limit,
                            loop_kwargs={"eos_token_id": None, "pad_token_id": 0}))


# -- block families -----------------------------------------------------------------------------------------------
def build_mar(spec: SystemSpec, device: torch.device, dtype: torch.dtype) -> System:
    """A MAR target and the next size down as CSpD's draft, in a ContinuousARImagePipeline."""
    from mmspec.models.mar import MARModel
    from mmspec.models.tokenizers import ContinuousTokenizer
    from mmspec.pipelines import ContinuousARImagePipeline

    c = spec.config
    target, draft = MARModel(**c["target"]).eval(), MARModel(**c["draft"]).eval()
    _cast(device, dtype, target, draft)
    vae = ContinuousTokenizer(latent_dim=int(c["target"]["token_dim"])).to(device)
    pipe = ContinuousARImagePipeline(target, vae, draft_transformer=draft)
    return _quiet(System(spec, pipe, device, dtype))


def build_video_dit(spec: SystemSpec, device: torch.device, dtype: torch.dtype) -> System:
    """A block-causal video DiT target and a shallower drafter of the same width, in an ARVideoPipeline."""
    from mmspec.models.text import WordTokenizer
    from mmspec.models.tokenizers import ContinuousTokenizer
    from mmspec.models.video import BlockCausalVideoTransformer
    from mmspec.pipelines import ARVideoPipeline

    c = spec.config
    shape = dict(latent_channels=16, latent_size=c["latent_size"], patch_size=c["patch"], num_frames=c["num_frames"],
                 frames_per_block=c["frames_per_block"], dim=c["dim"], num_heads=c["heads"], mlp_ratio=c["mlp_ratio"],
                 text_vocab_size=len(WORDS), text_length=c["text_length"])
    target = BlockCausalVideoTransformer(num_layers=c["layers"], **shape).eval()
    drafter = BlockCausalVideoTransformer(num_layers=c["draft_layers"], condition_dropout=0.0, **shape).eval()
    _cast(device, dtype, target, drafter)
    vae = ContinuousTokenizer(latent_dim=16, image_size=4 * c["latent_size"]).to(device)
    pipe = ARVideoPipeline(target, vae, drafter=drafter, text_tokenizer=WordTokenizer(list(WORDS)))
    return _quiet(System(spec, pipe, device, dtype))


BUILDERS = {"llamagen": build_llamagen, "janus": build_janus, "llava": build_llava, "qwen2_vl": build_qwen2_vl,
            "mar": build_mar, "video_dit": build_video_dit}


def build_system(spec: SystemSpec, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> System:
    """``spec`` built with random weights (seeded) on ``device`` in ``dtype``."""
    torch.manual_seed(seed)
    with torch.inference_mode(False), torch.no_grad():
        return BUILDERS[spec.builder](spec, torch.device(device), dtype)


# -- helpers ------------------------------------------------------------------------------------------------------
def _vision_depth(full: int, device: torch.device) -> int:
    """The vision tower's depth: ``full`` on an accelerator, one layer on a CPU (:mod:`.specs`)."""
    return full if device.type != "cpu" else 1


def _sharpen(linear: torch.nn.Module) -> None:
    linear.weight.mul_(HEAD_SHARPENING)


def _cast(device: torch.device, dtype: torch.dtype, *models: torch.nn.Module) -> None:
    for model in models:  # nn.Module's own ``to`` (diffusers' warns about dtype casts of ModelMixin models)
        torch.nn.Module.to(model, device=device, dtype=dtype)


def _quiet(system: System) -> System:
    system.pipe.set_progress_bar_config(disable=True)
    return system
