"""mmspec.models: networks of the project.

Draft heads (:mod:`.eagle`), reference targets (:mod:`.llamagen` LlamaGen-compatible AR image
transformer, :mod:`.llamagen_vq` its VQ tokenizer), the shapes world's tokenizers (:mod:`.tokenizers`)
and the training recipes of the reference zoo (:mod:`.recipes`). Submodules import lazily.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "EagleHead": ".eagle",
    "EagleDrafter": ".eagle",
    "eagle_loss": ".eagle",
    "LlamaGenTransformer": ".llamagen",
    "LlamaGenVQModel": ".llamagen_vq",
    "LLAMAGEN_PRESETS": ".llamagen",
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
