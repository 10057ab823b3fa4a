"""mmspec.pipelines: one diffusers-style pipeline per model family (imported lazily).

* :class:`ARImagePipeline` (:mod:`.ar_image`): discrete AR image generation (LlamaGen-style targets)
  with "none", "eagle", "lantern", "sjd", "gsd", "mulo".
* :class:`VLMPipeline` (:mod:`.vlm`): image/video + text -> text with transformers VLMs, "none",
  "eagle", "flash", "vispec", "specvlm", "draft_vlm", with streaming.
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
    "resolve_pretrained": ".hub",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'mmspec.pipelines' has no attribute {name!r}")


__all__ = list(_EXPORTS)
