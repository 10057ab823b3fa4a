"""Loading pipeline folders: zoo ids and the components of a ``save_pretrained`` folder.

:func:`resolve_pretrained` turns a zoo id ``mmspec/<name>`` into its folder under ``mmspec/models/zoo`` and
leaves any other path or hub id unchanged, so every pipeline's ``from_pretrained`` accepts all three.
:func:`load_components` loads a folder's components with errors that name the file and the component: it
imports only the libraries in :data:`ALLOWED_LIBRARIES` and refuses weights that are not finite.
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
from safetensors import safe_open
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


#: Libraries whose classes a ``model_index.json`` may name as components: each package and its submodules.
#: A folder naming any other module is refused *before* anything is imported (importing a module runs its
#: code, and a downloaded folder chooses what it names). To load components of your own package, add it
#: once before loading: ``mmspec.pipelines.hub.ALLOWED_LIBRARIES.add("my_package")``.
ALLOWED_LIBRARIES: set[str] = {"diffusers", "transformers", "mmspec"}

#: Suffixes of the weights files a component folder may hold (named in loading errors).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")

_NON_FINITE_CHUNK = 1 << 24  # elements checked at a time: bounds the temporary mask of a huge tensor


class ComponentLoadError(OSError):
    """A component of a pipeline folder could not be loaded (truncated or corrupt weights, a missing file,
    a config its class rejects). The message names the component and its file; ``__cause__`` holds the
    loader's own error."""


def load_components(pipeline_class: type, path: Path, names: Sequence[str], *, torch_dtype: torch.dtype | None = None,
                    check_weights: bool = True, extra: Sequence[str] = (), **overrides: Any) -> dict[str, Any]:
    """Load the components ``names`` of a ``save_pretrained`` pipeline folder, each with its own class's
    ``from_pretrained`` (the class named in ``model_index.json``), in eval mode.

    ``overrides`` replace components (or pass the non-loadable arguments listed in ``extra``); a component
    listed in the class's ``_optional_components`` may be absent (None). ``check_weights`` (default on)
    refuses a model component with a NaN or infinite weight (:func:`check_finite_weights`).

    Raises:
        ValueError: unknown keywords, a folder that holds another pipeline class, a missing required
            component, a library outside :data:`ALLOWED_LIBRARIES` (checked before importing it), a class
            its library does not define, non-finite weights. Each names ``model_index.json`` or the
            weights file, and the component.
        FileNotFoundError: a component listed in ``model_index.json`` without its folder.
        ComponentLoadError: a component whose files fail to load (the original error chained).

    Why not diffusers' loader: it looks the loadable base class (``ModelMixin``) up *in the component's own
    module*, and refuses classes that inherit it through another module (e.g. ``VQTokenizer`` via
    ``PatchTokenizerMixin``); it also cannot load the project's non-diffusers components by path.
    """
    unknown = sorted(set(overrides) - set(names) - set(extra))
    if unknown:
        raise ValueError(f"unexpected keyword arguments for a local pipeline folder: {unknown} (accepted: "
                         f"torch_dtype, check_weights and {sorted([*names, *extra])})")
    path = Path(path)
    index_path = path / "model_index.json"
    index = read_model_index(index_path)
    if index.get("_class_name") not in (None, pipeline_class.__name__):
        raise ValueError(f"{path} holds a {index['_class_name']}, not a {pipeline_class.__name__}")
    optional = set(getattr(pipeline_class, "_optional_components", ()))
    components: dict[str, Any] = dict(overrides)
    for name in names:
        if name in components:
            continue
        entry = _component_entry(index, index_path, name)
        if entry is None:
            if name not in optional:
                raise ValueError(f"{index_path} has no {name!r} component")
            components[name] = None
            continue
        component_class = import_component_class(index_path, name, *entry)
        components[name] = load_component(component_class, path / name, name, torch_dtype, check_weights)
    return components


def read_model_index(index_path: Path) -> dict[str, Any]:
    """The parsed ``model_index.json``; a malformed file raises ValueError naming it."""
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{index_path} is not valid JSON: {err}") from err
    if not isinstance(index, dict):
        raise ValueError(f"{index_path} must hold a JSON object, got {type(index).__name__}")
    return index


def _component_entry(index: dict[str, Any], index_path: Path, name: str) -> tuple[str, str] | None:
    """``(library, class name)`` of component ``name``, or None where the folder has none (absent or
    ``[null, null]``); an entry of another shape raises ValueError naming the file and the component."""
    entry = index.get(name)
    if entry is None or (isinstance(entry, list) and entry == [None, None]):
        return None
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(part, str) for part in entry)):
        raise ValueError(f"{index_path}: the component {name!r} must be [library, class name], got {entry!r}")
    return entry[0], entry[1]


def is_allowed_library(library: str) -> bool:
    """Whether ``library`` is a dotted module name inside one of :data:`ALLOWED_LIBRARIES`."""
    if not all(part.isidentifier() for part in library.split(".")):
        return False
    return any(library == allowed or library.startswith(allowed + ".") for allowed in ALLOWED_LIBRARIES)


def import_component_class(index_path: Path, name: str, library: str, class_name: str) -> type:
    """The class ``library.class_name`` named by component ``name`` of ``index_path``. The library is
    checked against :data:`ALLOWED_LIBRARIES` before it is imported; every failure raises ValueError naming
    the file, the component and the library or class."""
    where = f"{index_path}: the component {name!r}"
    if not is_allowed_library(library):
        raise ValueError(f"{where} names the library {library!r}, which is not among the allowed component "
                         f"libraries {sorted(ALLOWED_LIBRARIES)} (so it was not imported); if you trust it, add "
                         "its package to mmspec.pipelines.hub.ALLOWED_LIBRARIES")
    try:
        module = importlib.import_module(library)
    except ImportError as err:
        raise ValueError(f"{where} names the library {library!r}, which cannot be imported: {err}") from err
    component_class = getattr(module, class_name, None)
    if not isinstance(component_class, type):
        raise ValueError(f"{where} names the class {class_name!r}, which {library} does not define")
    if not callable(getattr(component_class, "from_pretrained", None)):
        raise ValueError(f"{where} names the class {library}.{class_name}, which has no from_pretrained to load it")
    return component_class


def load_component(component_class: type, folder: Path, name: str, torch_dtype: torch.dtype | None = None,
                   check_weights: bool = True) -> Any:
    """Component ``name`` from its ``folder``: ``component_class.from_pretrained``, models in eval mode and
    in ``torch_dtype``, their weights checked to be finite when ``check_weights``. Errors name the
    component and its file (see :func:`load_components`)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder.parent / 'model_index.json'} lists the component {name!r} but its folder "
                                f"{folder} is missing")
    is_model = issubclass(component_class, torch.nn.Module)  # tokenizers, processors: no dtype, no eval mode
    try:
        component = (_load_model(component_class, folder, torch_dtype).eval() if is_model
                     else component_class.from_pretrained(str(folder)))
    except Exception as err:
        qualified = f"{component_class.__module__}.{component_class.__qualname__}"
        raise ComponentLoadError(f"cannot load the component {name!r} ({qualified}) from "
                                 f"{_file_to_blame(folder) or folder}: {type(err).__name__}: {err}") from err
    if is_model and check_weights:
        check_finite_weights(component, name, folder)
    return component


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


# -- checking loaded weights ----------------------------------------------------------------------------------


def check_finite_weights(model: torch.nn.Module, name: str, folder: Path) -> None:
    """Refuse a loaded model with a NaN or infinite value in a parameter or saved buffer (its state dict):
    a corrupt file (random bytes under an intact header load silently) or a diverged training run.

    One pass over the weights, cheap next to reading them. Raises ValueError naming the weights file, the
    component, the first bad tensor and how many of its values are not finite.
    """
    bad = [(key, tensor, count) for key, tensor in model.state_dict().items() if (count := _count_non_finite(tensor))]
    if not bad:
        return
    key, tensor, count = bad[0]
    affected = f" ({len(bad)} tensors affected)" if len(bad) > 1 else ""
    raise ValueError(f"{_file_holding(folder, key)}: the component {name!r} has non-finite weights: {count} of "
                     f"{tensor.numel()} values of {key!r} ({tensor.dtype}) are NaN or infinite{affected}. The file "
                     "is corrupt or its training diverged; load with check_weights=False to inspect it anyway")


def _count_non_finite(tensor: torch.Tensor) -> int:
    """How many values of ``tensor`` are NaN or infinite (0 for integer and meta tensors); checked in
    chunks, so the temporary mask of a huge tensor stays small."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.is_meta:
        return 0
    count = 0
    for chunk in tensor.detach().reshape(-1).split(_NON_FINITE_CHUNK):
        finite = torch.isfinite(chunk)
        if not bool(finite.all()):
            count += int(finite.numel() - finite.sum())
    return count


def _weight_files(folder: Path) -> list[Path]:
    """The weights files of a component folder (by suffix), sorted."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def _file_to_blame(folder: Path) -> Path | None:
    """The file to name in a loading error: the first safetensors file of ``folder`` whose header is
    unreadable or does not match its size (truncated), else the folder's only weights file, else None."""
    files = _weight_files(folder) if folder.is_dir() else []
    for file in files:
        if file.suffix == ".safetensors":
            try:
                with safe_open(str(file), "pt"):
                    pass
            except Exception:  # any failure to open marks the file as the culprit
                return file
    return files[0] if len(files) == 1 else None


def _file_holding(folder: Path, tensor: str) -> Path:
    """The weights file of ``folder`` that holds ``tensor`` (the only one, or the safetensors shard listing
    it), else the folder itself."""
    files = _weight_files(folder)
    if len(files) == 1:
        return files[0]
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), "pt") as handle:
                if tensor in handle.keys():
                    return file
    return folder
