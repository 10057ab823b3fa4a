"""Zoo ids: ``mmspec/<name>`` names the bundled, offline zoo entries of every pipeline.

:func:`resolve_pretrained` turns a zoo id into its folder under ``mmspec/models/zoo`` and leaves any
other path or hub id unchanged, so every pipeline's ``from_pretrained`` accepts all three.
"""

from __future__ import annotations

import os
from pathlib import Path

# Zoo ids -> the command that builds the entry's weights (the pipeline folder is written by save_pretrained).
ZOO_RECIPES = {
    "shapes-t2i": "python -m mmspec.models.recipes.train_t2i --out models/zoo/shapes-t2i/transformer "
                  "(then train_eagle, train_mulo and build_zoo_t2i; see docs/pipeline_ar_image.md)",
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
