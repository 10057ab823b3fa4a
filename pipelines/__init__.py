"""mmspec.pipelines: one diffusers-style pipeline per model family (imported lazily).

* :class:`ARImagePipeline` (:mod:`.ar_image`): discrete AR image generation (LlamaGen-style targets)
  with "none", "eagle", "lantern", "sjd", "gsd", "mulo".
* :class:`VLMPipeline` (:mod:`.vlm`): image/video + text -> text with transformers VLMs, "none",
  "eagle", "flash", "vispec", "specvlm", "draft_vlm", with streaming.
* :class:`ContinuousARImagePipeline` (:mod:`.continuous_ar_image`): MAR-style continuous-token image
  generation, "none" and "cspd" (continuous speculative decoding).
* :class:`ARVideoPipeline` (:mod:`.ar_video`): block-causal AR video, "none", "draft" and "sdvg" (reward
  routing of drafted blocks).
* :func:`resolve_pretrained` (:mod:`.hub`): zoo ids ``mmspec/<name>`` -> bundled folders.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ARImagePipeline": ".ar_image",
    "ARImagePipelineOutput": ".ar_image",
    "VLMPipeline": ".vlm",
    "VLMPipelineOutput": ".vlm",
    "VLMStreamChunk": ".vlm",
    "ContinuousARImagePipeline": ".continuous_ar_image",
    "ContinuousARImagePipelineOutput": ".continuous_ar_image",
    "ARVideoPipeline": ".ar_video",
    "ARVideoPipelineOutput": ".ar_video",
    "export_video": ".ar_video",
    "resolve_pretrained": ".hub",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'mmspec.pipelines' has no attribute {name!r}")


__all__ = list(_EXPORTS)
