"""Finding and loading pipeline folders: zoo ids, local folders, hub snapshots, and their components.

:func:`resolve_pretrained` turns a zoo id ``mmspec/<name>`` into its folder under ``mmspec/models/zoo`` and
leaves any other path or hub id unchanged; :func:`locate_pretrained` turns any of the three into a local
folder (a hub id through diffusers' ``DiffusionPipeline.download``, so offline it is read from the Hugging Face
cache). :func:`load_components` loads a folder's components through diffusers' component loader
(``load_sub_model``) with the options of :class:`LoadOptions` (dtype, variant, device placement, ...), and adds
what that loader lacks: it imports only the libraries in :data:`ALLOWED_LIBRARIES`, its errors name the file
and the component, and it refuses weights that are not finite.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from diffusers import ModelMixin
from diffusers.models.modeling_utils import _LOW_CPU_MEM_USAGE_DEFAULT
from diffusers.pipelines.pipeline_loading_utils import (
    ALL_IMPORTABLE_CLASSES,
    _identify_model_variants,
    load_sub_model,
)
from diffusers.pipelines.pipeline_utils import SUPPORTED_DEVICE_MAP
from diffusers.utils import is_accelerate_available
from huggingface_hub import constants as hf_constants
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import safe_open

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


#: What follows ``mmspec/`` in a zoo id: one folder name of the bundled zoo (no separators, no ``.``/``..``).
ZOO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def resolve_pretrained(path_or_id: str | os.PathLike) -> str:
    """Map a zoo id ``mmspec/<name>`` to its bundled folder; return any other path or id unchanged.

    A zoo id names one folder of the bundled zoo, so it can never reach a folder outside it. A relative folder
    of the same spelling (``./mmspec/<name>`` in the working directory) is never shadowed silently: it is
    returned when the zoo has no such entry, and refused when both exist (write ``./mmspec/<name>`` for the
    folder).

    Raises:
        ValueError: ``mmspec/<name>`` whose name is not a single zoo folder name (``mmspec/../x``,
            ``mmspec/a/b``), or a zoo id that is also a folder in the working directory.
        FileNotFoundError: a zoo id whose folder is missing or has no ``model_index.json`` yet (the
            message names the recipe that builds it).
    """
    text = os.fspath(path_or_id)
    if not text.startswith("mmspec/"):
        return text
    name = text.split("/", 1)[1]
    local = Path(text).is_dir()
    if not ZOO_NAME.fullmatch(name) or ".." in name:
        if local:
            raise ValueError(f"pretrained_model_name_or_path {text!r} is not a zoo id (mmspec/<name> names one "
                             f"folder of the bundled zoo); to load the local folder, pass ./{text}")
        raise ValueError(f"pretrained_model_name_or_path {text!r} is not a zoo id: mmspec/<name> names one folder "
                         f"of the bundled zoo ({zoo_dir()}), without path separators or '..'")
    folder = zoo_dir() / name
    if local:
        if folder.is_dir():
            raise ValueError(f"pretrained_model_name_or_path {text!r} is both the zoo id of {folder} and the folder "
                             f"{Path(text).resolve()} of the working directory: pass ./{text} for the local folder, "
                             f"or {folder} for the zoo entry")
        return text
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


def check_variant(variant: str | None) -> None:
    """``variant`` (of ``from_pretrained`` or ``save_pretrained``) is None or a plain name such as ``"fp16"``: it
    becomes part of weights file names (``diffusion_pytorch_model.<variant>.safetensors``), so a '.', '/' or
    '\\' in it would read or write files elsewhere than the component's folder (``variant="../x"``)."""
    if variant is not None and (not isinstance(variant, str) or not variant or any(c in variant for c in "./\\")):
        raise ValueError(f"variant must be a non-empty name without '.', '/' or '\\' (e.g. 'fp16') or None, got "
                         f"{variant!r}")


# -- loading options --------------------------------------------------------------------------------------------


def _supported_device_maps() -> list[str]:
    """The ``device_map`` values a pipeline takes: diffusers' whole-pipeline placements on one device."""
    return sorted(set(SUPPORTED_DEVICE_MAP) - {"balanced"})


@dataclass(frozen=True)
class LoadOptions:
    """How ``from_pretrained`` finds and loads a pipeline's components: the keywords of diffusers'
    ``DiffusionPipeline.from_pretrained`` that mmspec's pipelines take, checked once, then handed to
    diffusers' own machinery (``DiffusionPipeline.download`` for hub ids, ``load_sub_model`` per component).

    Attributes:
        dtype: the models' dtype (``torch_dtype`` is its older name), or a mapping component -> dtype with an
            optional ``"default"``; None: each loader's default.
        variant: load weights files of this variant (``diffusion_pytorch_model.<variant>.safetensors``, as
            ``save_pretrained(..., variant=...)`` writes them).
        device_map: None or a device every component is loaded onto ("cpu", or the machine's accelerator);
            diffusers' "balanced" (components spread over several GPUs) is refused: a speculative loop runs
            the target and its drafters on one device.
        low_cpu_mem_usage: build models without initialising their weights first (needs accelerate; the default
            is True where accelerate is installed, else False, so a load without it does not make diffusers
            warn once per model that it falls back).
        use_safetensors: None (prefer safetensors), True (require them) or False (also load pickled weights).
        check_weights: refuse a model with NaN or infinite weights (:func:`check_finite_weights`).
        local_files_only / revision / cache_dir / token / force_download: where a hub id is looked up
            (huggingface_hub's meaning; offline, ``HF_HUB_OFFLINE=1``, only the local cache is read).
    """

    dtype: torch.dtype | Mapping[str, torch.dtype] | None = None
    variant: str | None = None
    device_map: str | None = None
    low_cpu_mem_usage: bool = _LOW_CPU_MEM_USAGE_DEFAULT and is_accelerate_available()
    use_safetensors: bool | None = None
    check_weights: bool = True
    local_files_only: bool | None = None
    revision: str | None = None
    cache_dir: str | os.PathLike | None = None
    token: str | bool | None = None
    force_download: bool = False

    def __post_init__(self) -> None:
        dtypes = self.dtype.values() if isinstance(self.dtype, Mapping) else [self.dtype]
        if not all(d is None or isinstance(d, torch.dtype) for d in dtypes):
            raise ValueError(f"dtype must be a torch.dtype (e.g. torch.float16), a mapping component -> dtype or None, "
                             f"got {self.dtype!r}")
        check_variant(self.variant)
        if self.device_map is not None and self.device_map not in _supported_device_maps():
            raise ValueError(f"device_map={self.device_map!r} is not supported: use None or one of "
                             f"{_supported_device_maps()} (every component on that device; diffusers' 'balanced' "
                             "would split the target from its drafters, which every speculative step runs together)")
        for name in ("low_cpu_mem_usage", "check_weights", "force_download"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("use_safetensors", "local_files_only"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if self.device_map is not None and not self.low_cpu_mem_usage:
            raise ValueError(f"device_map={self.device_map!r} needs low_cpu_mem_usage=True (diffusers places the "
                             "weights while loading them)")
        if self.revision is not None and not isinstance(self.revision, str):
            raise ValueError(f"revision must be a branch, tag or commit name (a string) or None, got {self.revision!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(f"cache_dir must be a path or None, got {type(self.cache_dir).__name__}")
        if self.token is not None and not isinstance(self.token, (str, bool)):
            raise ValueError(f"token must be a string, a bool or None, got {type(self.token).__name__}")

    #: the ``from_pretrained`` keywords these options take (``torch_dtype``: ``dtype``'s older name)
    @classmethod
    def keywords(cls) -> list[str]:
        return sorted([f.name for f in fields(cls)] + ["torch_dtype"])

    @classmethod
    def pop_from(cls, kwargs: dict[str, Any], default_dtype: torch.dtype | None = None) -> LoadOptions:
        """The options among ``from_pretrained``'s keyword arguments (removed from ``kwargs``); ``dtype`` and
        ``torch_dtype`` are one argument (both given and different: ValueError), ``default_dtype`` applies
        when neither is given (and as the ``"default"`` of a per-component mapping)."""
        dtype, torch_dtype = kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None)
        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree: they are one argument "
                             "(torch_dtype is its older name); pass only dtype")
        dtype = dtype if dtype is not None else torch_dtype
        if dtype is None:
            dtype = default_dtype
        elif isinstance(dtype, Mapping) and default_dtype is not None:
            dtype = {"default": default_dtype, **dtype}
        values = {f.name: kwargs.pop(f.name) for f in fields(cls) if f.name != "dtype" and f.name in kwargs}
        return cls(dtype=dtype, **values)

    def dtype_for(self, name: str) -> torch.dtype | None:
        """The dtype component ``name`` is loaded in (None: its loader's default)."""
        if isinstance(self.dtype, Mapping):
            return self.dtype.get(name, self.dtype.get("default"))
        return self.dtype

    def hub_kwargs(self) -> dict[str, Any]:
        """The options that say where a hub repository is looked up (for ``huggingface_hub``)."""
        names = ("local_files_only", "revision", "cache_dir", "token", "force_download")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


# -- where a pipeline folder is -----------------------------------------------------------------------------------


def locate_pretrained(pretrained_model_name_or_path: str | os.PathLike, pipeline_class: type,
                      options: LoadOptions | None = None, extra_files: Sequence[str] = ()) -> Path:
    """The local folder of a pipeline: a zoo id's bundled folder (:func:`resolve_pretrained`), a local folder,
    or the snapshot of a hub repository ``owner/name`` in the Hugging Face cache, downloaded by diffusers'
    ``DiffusionPipeline.download`` unless ``local_files_only`` / ``HF_HUB_OFFLINE`` (then only the cache is
    read). ``extra_files`` of the repository that diffusers does not download (pipeline-level files such as
    ``speculation_config.json``) are fetched into the same snapshot when the repository has them.

    Raises:
        FileNotFoundError: naming the path or id: a folder without ``model_index.json``, a path that does not
            exist, or a hub id that is neither cached nor downloadable.
    """
    options = options or LoadOptions()
    text = resolve_pretrained(pretrained_model_name_or_path)
    folder = Path(text)
    if folder.is_dir():
        if not (folder / "model_index.json").is_file():
            raise FileNotFoundError(f"{folder} is not a saved {pipeline_class.__name__} folder: it has no "
                                    "model_index.json (write one with save_pretrained)")
        return folder
    if not _is_repo_id(text):
        raise FileNotFoundError(f"there is no pipeline folder at {text!r} (nor is it a zoo id mmspec/<name> or a "
                                "hub repository id owner/name)")
    hub = options.hub_kwargs()
    try:
        snapshot = Path(pipeline_class.download(text, variant=options.variant, use_safetensors=options.use_safetensors,
                                                **hub))
    except (OSError, HFValidationError) as error:
        offline = bool(options.local_files_only) or hf_constants.HF_HUB_OFFLINE
        where = "in the local Hugging Face cache (offline)" if offline else "on the hub or in the local cache"
        raise FileNotFoundError(f"cannot load {text!r}: it is not a local folder or a zoo id, and no hub repository "
                                f"{text!r} was found {where}: {error}") from error
    for name in extra_files:
        if not (snapshot / name).is_file():
            _fetch_repo_file(text, name, hub)
    return snapshot


def _is_repo_id(text: str) -> bool:
    """Whether ``text`` can name a hub repository (``name`` or ``owner/name``), not a local path."""
    if os.path.isabs(text) or text.startswith(".") or text.count("/") > 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _fetch_repo_file(repo_id: str, filename: str, hub: dict[str, Any]) -> None:
    """Download ``filename`` of ``repo_id`` into its cached snapshot; a repository without it is fine."""
    try:
        hf_hub_download(repo_id, filename, **{k: v for k, v in hub.items() if k != "force_download"})
    except (EntryNotFoundError, OSError):  # absent there, or not cached offline: the pipeline does without it
        return


# -- loading the components ---------------------------------------------------------------------------------------


def load_components(pipeline_class: type, path: Path, names: Sequence[str], *, options: LoadOptions | None = None,
                    extra: Sequence[str] = (), **overrides: Any) -> dict[str, Any]:
    """Load the components ``names`` of a ``save_pretrained`` pipeline folder, each with its own class (the one
    ``model_index.json`` names) through diffusers' component loader, in eval mode.

    ``overrides`` replace components (or pass the non-component arguments listed in ``extra``); a component
    listed in the class's ``_optional_components`` may be absent (None). ``options`` (:class:`LoadOptions`)
    set dtype, variant, device placement and the weights check.

    Raises:
        ValueError: unknown keywords, a folder that holds another pipeline class, a missing required
            component, a library outside :data:`ALLOWED_LIBRARIES` (checked before importing it), a class
            its library does not define, a ``variant`` no component has, non-finite weights. Each names
            ``model_index.json`` or the weights file, and the component.
        FileNotFoundError: a component listed in ``model_index.json`` without its folder.
        ComponentLoadError: a component whose files fail to load (the original error chained).
    """
    options = options or LoadOptions()
    unknown = sorted(set(overrides) - set(names) - set(extra))
    if unknown:
        raise ValueError(f"unexpected keyword arguments for {pipeline_class.__name__}.from_pretrained: {unknown} "
                         f"(accepted: the loading options {LoadOptions.keywords()}, speculation_settings, the "
                         f"components {sorted(names)} and {sorted(extra)})")
    path = Path(path)
    index_path = path / "model_index.json"
    index = read_model_index(index_path)
    if index.get("_class_name") not in (None, pipeline_class.__name__):
        raise ValueError(f"{path} holds a {index['_class_name']}, not a {pipeline_class.__name__}")
    variants = _model_variants(path, index, options.variant)
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
        components[name] = load_component(component_class, path / name, name, options, variants.get(name),
                                          pipeline_class)
    return components


def _model_variants(path: Path, index: dict[str, Any], variant: str | None) -> dict[str, str]:
    """Component -> ``variant`` for the components whose folder has weights of that variant (diffusers'
    rule); a variant no component has raises ValueError naming it."""
    if variant is None:
        return {}
    variants = _identify_model_variants(folder=str(path), variant=variant, config=index)
    if not variants:
        raise ValueError(f"variant={variant!r}: no component of {path} has weights of that variant (files named "
                         f"like diffusion_pytorch_model.{variant}.safetensors, written by "
                         f"save_pretrained(folder, variant={variant!r}))")
    return variants


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


def load_component(component_class: type, folder: Path, name: str, options: LoadOptions | None = None,
                   variant: str | None = None, pipeline_class: type | None = None) -> Any:
    """Component ``name`` from its ``folder`` with diffusers' ``load_sub_model`` (which passes dtype, variant,
    device placement, ``low_cpu_mem_usage`` and ``use_safetensors`` in the form the component's library takes
    them); models in eval mode, their weights checked to be finite unless ``options.check_weights`` is off.
    Errors name the component and its file (see :func:`load_components`)."""
    options = options or LoadOptions()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder.parent / 'model_index.json'} lists the component {name!r} but its folder "
                                f"{folder} is missing")
    try:
        component = _load_sub_model(component_class, folder, name, options, variant, pipeline_class)
    except Exception as err:
        qualified = f"{component_class.__module__}.{component_class.__qualname__}"
        raise ComponentLoadError(f"cannot load the component {name!r} ({qualified}) from "
                                 f"{_file_to_blame(folder) or folder}: {type(err).__name__}: {err}") from err
    if isinstance(component, torch.nn.Module):  # tokenizers and processors: no eval mode, no weights
        component.eval()
        if options.check_weights:
            check_finite_weights(component, name, folder)
    return component


def _load_sub_model(component_class: type, folder: Path, name: str, options: LoadOptions, variant: str | None,
                    pipeline_class: type | None) -> Any:
    """diffusers' ``load_sub_model`` on a class this module has already resolved and checked.

    diffusers' own lookup would import the library by name and look the loadable base class up in that
    module; its ``is_pipeline_module`` path instead takes the class from the namespace it is given, the path
    it uses for classes that ship with a pipeline, which is what a resolved class is here. A diffusers model
    class whose folder is another library's checkpoint goes to :func:`_load_adapter` instead."""
    if issubclass(component_class, ModelMixin) and not _written_by_diffusers(folder):
        return _load_adapter(component_class, folder, name, options, variant)
    namespace = SimpleNamespace(component=SimpleNamespace(**{component_class.__name__: component_class}))
    return load_sub_model(
        library_name="component", class_name=component_class.__name__, importable_classes=ALL_IMPORTABLE_CLASSES,
        pipelines=namespace, is_pipeline_module=True, pipeline_class=pipeline_class, dtype=options.dtype_for(name),
        provider=None, sess_options=None, device_map=options.device_map, max_memory=None, offload_folder=None,
        offload_state_dict=False, model_variants={name: variant} if variant else {}, name=name, variant=variant,
        low_cpu_mem_usage=options.low_cpu_mem_usage, cached_folder=str(folder.parent),
        use_safetensors=options.use_safetensors, provider_options=None, disable_mmap=False)


def _written_by_diffusers(folder: Path) -> bool:
    """Whether ``folder`` holds a diffusers model (its ``config.json`` records ``_diffusers_version``); an
    unreadable config counts as one, so diffusers' loader reports what is wrong with it."""
    try:
        return "_diffusers_version" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return True


def _load_adapter(component_class: type, folder: Path, name: str, options: LoadOptions, variant: str | None) -> Any:
    """A diffusers model class over another library's checkpoint (an adapter, e.g. Janus's, whose
    ``from_pretrained`` loads a transformers model and would reject diffusers' own loader keywords): its
    ``from_pretrained`` with only the options the caller set."""
    kwargs: dict[str, Any] = {"torch_dtype": options.dtype_for(name), "variant": variant,
                              "device_map": options.device_map, "use_safetensors": options.use_safetensors}
    return component_class.from_pretrained(str(folder), **{k: v for k, v in kwargs.items() if v is not None})


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
