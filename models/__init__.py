"""mmspec.models: networks of the project.

Draft heads (:mod:`.eagle`), MuLo-SD's multi-scale drafter (:mod:`.mulo`), reference targets
(:mod:`.llamagen` LlamaGen-compatible AR image transformer, :mod:`.llamagen_vq` its VQ tokenizer), the
Janus-Pro adapter (:mod:`.janus`), VLM target runners for LLaVA / Qwen2-VL (:mod:`.vlm_targets`), the VLM
draft heads EagleVLM / FLASH / ViSpec / SpecVLM (:mod:`.vlm_drafters`), the shapes captioner
(:mod:`.shapes_vlm`), the lean Llama decoder of draft heads (:mod:`.lean_llama`), the shapes world's
tokenizers (:mod:`.tokenizers`, :mod:`.text`)
and the training recipes of the reference zoo with their losses (:mod:`.recipes`). Submodules import lazily.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "EagleHead": ".eagle",
    "EagleDrafter": ".eagle",
    "LlamaGenTransformer": ".llamagen",
    "LlamaGenVQModel": ".llamagen_vq",
    "LLAMAGEN_PRESETS": ".llamagen",
    "TokenUpsampler": ".mulo",
    "MuLoDrafter": ".mulo",
    "downsample_tokens": ".mulo",
    "JanusImageGenerator": ".janus",
    "JanusPromptTokenizer": ".janus",
    "JanusVQDecoder": ".janus",
    "load_janus_components": ".janus",
    "WordTokenizer": ".text",
    "VLMRunner": ".vlm_targets",
    "VLMPrefillOutput": ".vlm_targets",
    "VLMStepOutput": ".vlm_targets",
    "EagleVLMHead": ".vlm_drafters",
    "EagleVLMDrafter": ".vlm_drafters",
    "FlashHead": ".vlm_drafters",
    "FlashDrafter": ".vlm_drafters",
    "ViSpecHead": ".vlm_drafters",
    "ViSpecDrafter": ".vlm_drafters",
    "SpecVLMHead": ".vlm_drafters",
    "SpecVLMDrafter": ".vlm_drafters",
    "drafter_for": ".vlm_drafters",
    "format_vlm_prompt": ".vlm_prompts",
    "LeanLlamaDecoder": ".lean_llama",
    "VQTokenizer": ".tokenizers",
    "ContinuousTokenizer": ".tokenizers",
    "load_zoo_tokenizer": ".tokenizers",
    "zoo_tokenizer_path": ".tokenizers",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'mmspec.models' has no attribute {name!r}")


__all__ = list(_EXPORTS)
