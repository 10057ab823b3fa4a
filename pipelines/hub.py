"""Zoo ids: ``mmspec/<name>`` names the bundled, offline zoo entries of every pipeline.

:func:`resolve_pretrained` turns a zoo id into its folder under ``mmspec/models/zoo`` and leaves any
other path or hub id unchanged, so every pipeline's ``from_pretrained`` accepts all three.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import ModelMixin
from transformers import PreTrainedModel

# Zoo ids -> the command that builds the entry's weights (the pipeline folder is written by save_pretrained).
ZOO_RECIPES = {
    "shapes-t2i": "python -m mmspec.models.recipes.train_t2i --out models/zoo/shapes-t2i/transformer "
                  "(then train_eagle, train_mulo and build_zoo_t2i; see docs/pipeline_ar_image.md)",
    "shapes-t2i-continuous": "python -m mmspec.models.recipes.train_mar --role target / --role draft, then "
                             "report_mar (see docs/pipeline_continuous.md)",
    "shapes-video": "python -m mmspec.models.recipes.train_video --role target / --role drafter, then report_video "
                    "build (see docs/pipeline_video.md)",
    "shapes-vlm": "bash scripts/build_zoo_vlm.sh (train_vlm for the captioner and its draft VLM, train_vlm_drafter "
                  "for each head, build_zoo_vlm; see docs/pipeline_vlm.md)",
}


def zoo_dir() -> Path:
    """Folder of the bundled zoo (``mmspec/models/zoo``)."""
    import mmspec.models.zoo as zoo

    return Path(zoo.__file__).resolve().parent


def resolve_pretrained(path_or_id: str | os.PathLike) -> str:
    """Map a zoo id ``mmspec/<name>`` to its bundled folder; return any other path or id unchanged.

    Raises:
        FileNotFoundError: a zoo id whose folder is missing or has no ``model_index.json`` yet (the
            message names the recipe that builds it).
    """
    text = os.fspath(path_or_id)
    if not text.startswith("mmspec/"):
        return text
    name = text.split("/", 1)[1]
    folder = zoo_dir() / name
    recipe = ZOO_RECIPES.get(name)
    how = (f" Its weights are built by `{recipe}`; the pipeline folder (model_index.json, transformer/, vqvae/, "
           "...) is then written with the pipeline's save_pretrained(folder).") if recipe else ""
    if not folder.is_dir():
        raise FileNotFoundError(f"unknown zoo id {text!r}: there is no bundled folder {folder}." + how)
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"the zoo entry {text!r} is not built yet: {folder} has no model_index.json." + how)
    return str(folder)


def load_components(pipeline_class: type, path: Path, names: Sequence[str], *, torch_dtype: torch.dtype | None = None,
                    extra: Sequence[str] = (), **overrides: Any) -> dict[str, Any]:
    """Load the components ``names`` of a ``save_pretrained`` pipeline folder, each with its own class's
    ``from_pretrained`` (the class named in ``model_index.json``), in eval mode.

    ``overrides`` replace components (or pass the non-loadable arguments listed in ``extra``); a component
    listed in the class's ``_optional_components`` may be absent (None). Unknown keywords, a folder that
    holds another pipeline class, or a missing required component raise ``ValueError``.

    Why not diffusers' loader: it looks the loadable base class (``ModelMixin``) up *in the component's own
    module*, and refuses classes that inherit it through another module (e.g. ``VQTokenizer`` via
    ``PatchTokenizerMixin``); it also cannot load the project's non-diffusers components by path.
    """
    unknown = sorted(set(overrides) - set(names) - set(extra))
    if unknown:
        raise ValueError(f"unexpected keyword arguments for a local pipeline folder: {unknown} (accepted: "
                         f"torch_dtype and {sorted([*names, *extra])})")
    index = json.loads((Path(path) / "model_index.json").read_text())
    if index.get("_class_name") not in (None, pipeline_class.__name__):
        raise ValueError(f"{path} holds a {index['_class_name']}, not a {pipeline_class.__name__}")
    optional = set(getattr(pipeline_class, "_optional_components", ()))
    components: dict[str, Any] = dict(overrides)
    for name in names:
        if name in components:
            continue
        library, class_name = index.get(name) or (None, None)
        if library is None:
            if name not in optional:
                raise ValueError(f"{path}/model_index.json has no {name!r} component")
            components[name] = None
            continue
        component_class = getattr(importlib.import_module(library), class_name)
        if not issubclass(component_class, torch.nn.Module):  # tokenizers, processors: no dtype, no eval mode
            components[name] = component_class.from_pretrained(str(Path(path) / name))
            continue
        components[name] = _load_model(component_class, Path(path) / name, torch_dtype).eval()
    return components


def _load_model(component_class: type, folder: Path, torch_dtype: torch.dtype | None) -> Any:
    """``component_class.from_pretrained(folder)`` in ``torch_dtype``: through the loader's own dtype
    argument where the class has one (diffusers ``torch_dtype``, transformers ``dtype``; casting with
    ``.to`` afterwards makes diffusers warn on every load), else by ``.to``."""
    if torch_dtype is None:
        return component_class.from_pretrained(str(folder))
    if issubclass(component_class, ModelMixin):
        return component_class.from_pretrained(str(folder), torch_dtype=torch_dtype)
    if issubclass(component_class, PreTrainedModel):
        return component_class.from_pretrained(str(folder), dtype=torch_dtype)
    return component_class.from_pretrained(str(folder)).to(torch_dtype)
