"""What makes an mmspec pipeline a diffusers pipeline on disk: ``from_pretrained`` and the ``model_index.json``
it writes, readable by ``diffusers.DiffusionPipeline.from_pretrained`` too.

diffusers 0.42 resolves a folder's ``_class_name`` only as an attribute of the ``diffusers`` module (a
``[module, class]`` pair or ``custom_pipeline=`` load code shipped *in the folder*, and need
``trust_remote_code=True``), and a component library outside diffusers and transformers only when the caller
has imported it, looking the component's class and its loadable base class (``ModelMixin``,
``PreTrainedTokenizerFast``, ...) up on that module. :class:`PretrainedPipelineMixin` meets those rules:

* every pipeline class is exposed on the ``diffusers`` module when its module is imported (never replacing a
  name diffusers has), so ``DiffusionPipeline.from_pretrained(folder)`` finds it with no extra argument;
* each component is recorded under the library that serves it: the outermost package that exports both the
  class and a loadable base of it (``["mmspec.models.tokenizers", "VQTokenizer"]``), else the defining module
  (:func:`component_library`);
* when diffusers reads a folder, the allowed component libraries it names (:data:`~.hub.ALLOWED_LIBRARIES`)
  are imported first (:meth:`PretrainedPipelineMixin.extract_init_dict`).

The pipelines' own ``from_pretrained`` goes through :mod:`.hub` (zoo ids, hub snapshots, errors that name the
file, the finite-weights check) and then constructs the class exactly as diffusers would.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers.pipelines.pipeline_loading_utils import ALL_IMPORTABLE_CLASSES, LOADABLE_CLASSES

from mmspec.pipelines.hub import (
    LoadOptions,
    check_variant,
    is_allowed_library,
    load_components,
    locate_pretrained,
    read_model_index,
    resolve_pretrained,
)


def component_library(component_class: type) -> str:
    """The library to record for a component class in ``model_index.json``: the outermost package of its
    module that exports the class and a loadable base class of it (what diffusers' loader looks up on the
    library), else the defining module (diffusers' own choice)."""
    module = component_class.__module__
    parts = module.split(".")
    for end in range(1, len(parts) + 1):
        name = ".".join(parts[:end])
        library = sys.modules.get(name)
        if library is not None and _serves(library, component_class):
            return name
    return module


def _serves(library: Any, component_class: type) -> bool:
    """Whether diffusers' loader finds ``component_class`` on ``library``: the class under its own name, and a
    loadable base class (``ALL_IMPORTABLE_CLASSES``) it derives from."""
    if getattr(library, component_class.__name__, None) is not component_class:
        return False
    bases = (getattr(library, name, None) for name in ALL_IMPORTABLE_CLASSES)
    return any(isinstance(base, type) and issubclass(component_class, base) for base in bases)


def recorded_library(library: str, class_name: str) -> str:
    """``library`` as diffusers recorded it for a component of class ``class_name``, replaced by
    :func:`component_library` for classes outside diffusers' own libraries."""
    if library in LOADABLE_CLASSES or library not in sys.modules:
        return library
    component_class = getattr(sys.modules[library], class_name, None)
    return component_library(component_class) if isinstance(component_class, type) else library


def is_saveable_component(component: Any) -> bool:
    """Whether diffusers' ``save_pretrained`` can save ``component`` (an instance of one of its loadable base
    classes, e.g. ``ModelMixin``, ``PreTrainedModel``, ``PreTrainedTokenizerFast``)."""
    for library_name, classes in LOADABLE_CLASSES.items():
        library = sys.modules.get(library_name)
        for base_name in classes:
            base = getattr(library, base_name, None) if library is not None else None
            if isinstance(base, type) and isinstance(component, base):
                return True
    return False


def expose_to_diffusers(pipeline_class: type) -> None:
    """Make ``pipeline_class`` an attribute of the ``diffusers`` module, where ``DiffusionPipeline``'s loader
    looks a folder's ``_class_name`` up; a name diffusers already has is left alone."""
    import diffusers

    if getattr(diffusers, pipeline_class.__name__, None) is None:
        setattr(diffusers, pipeline_class.__name__, pipeline_class)


def import_component_libraries(config: dict[str, Any]) -> None:
    """Import the allowed libraries (:func:`~.hub.is_allowed_library`) that a ``model_index.json`` names for its
    components, so diffusers' loader, which only uses imported modules, finds them. Others are left to it."""
    for value in config.values():
        if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str):
            library = value[0]
            if library not in sys.modules and is_allowed_library(library):
                try:
                    importlib.import_module(library)
                except ImportError:  # diffusers' own error names the library
                    pass


class PretrainedPipelineMixin:
    """``from_pretrained`` and the component records of an mmspec pipeline (list it first in the bases, before
    ``DiffusionPipeline``).

    Class attributes: ``default_load_dtype`` (the dtype models are loaded in when the caller gives none;
    None: each loader's default) and ``extra_pipeline_files`` (files beside ``model_index.json`` a hub
    snapshot must hold, e.g. ``speculation_config.json``).
    """

    default_load_dtype: ClassVar[torch.dtype | None] = None
    extra_pipeline_files: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        expose_to_diffusers(cls)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> Any:
        """Load a pipeline from a ``save_pretrained`` folder, a zoo id ``mmspec/<name>`` or a hub repository
        ``owner/name`` (offline: from the Hugging Face cache).

        Keyword arguments: the loading options of :class:`~mmspec.pipelines.hub.LoadOptions` (``dtype`` /
        ``torch_dtype``, ``variant``, ``device_map``, ``low_cpu_mem_usage``, ``use_safetensors``,
        ``check_weights``, ``local_files_only``, ``revision``, ``cache_dir``, ``token``, ``force_download``);
        components by name (an object replaces the saved one, None drops an optional one); the class's other
        ``__init__`` arguments (default: the values saved in ``model_index.json``); ``speculation_settings``
        (a :class:`~mmspec.methods.SpeculationSettings` or its JSON mapping) for pipelines with stored method
        settings, replacing the folder's ``speculation_config.json``. Anything else raises ValueError.
        """
        options = LoadOptions.pop_from(kwargs, default_dtype=cls.default_load_dtype)
        settings = kwargs.pop("speculation_settings", None)
        folder = locate_pretrained(pretrained_model_name_or_path, cls, options, cls.extra_pipeline_files)
        modules, optional_kwargs = cls._get_signature_keys(cls)
        modules = [name for name in inspect.signature(cls.__init__).parameters if name in modules]  # __init__ order
        index = read_model_index(folder / "model_index.json")
        init_kwargs = {name: index[name] for name in optional_kwargs if name in index}
        init_kwargs.update({name: kwargs.pop(name) for name in optional_kwargs if name in kwargs})
        given = set(kwargs) & set(modules)
        components = load_components(cls, folder, modules, options=options, **kwargs)
        for name in modules:
            if components[name] is None and name not in given:
                components[name] = cls._fallback_component(name, folder, components)
        pipe = cls(**components, **init_kwargs)
        from_hub = not Path(resolve_pretrained(pretrained_model_name_or_path)).is_dir()  # the id, as diffusers records
        pipe.register_to_config(_name_or_path=os.fspath(pretrained_model_name_or_path) if from_hub else str(folder))
        if options.device_map is not None:
            pipe.hf_device_map = options.device_map
        if hasattr(pipe, "use_speculation_settings"):
            pipe.use_speculation_settings(settings, folder)
        elif settings is not None:
            raise ValueError(f"{cls.__name__} has no stored method settings: speculation_settings is not an argument")
        return pipe

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """diffusers' ``save_pretrained``, after checking what would otherwise fail half-way or write outside the
        folder: ``variant`` must be a plain name (:func:`~.hub.check_variant`: it is part of every weights
        file's name) and ``save_directory`` must not be an existing file. Raises ValueError naming either."""
        check_variant(kwargs.get("variant"))
        if Path(save_directory).is_file():
            raise ValueError(f"save_directory {os.fspath(save_directory)!r} is a file, not a folder to save the "
                             "pipeline in")
        super().save_pretrained(save_directory, **kwargs)  # type: ignore[misc]

    @classmethod
    def _fallback_component(cls, name: str, folder: Path, components: dict[str, Any]) -> Any:
        """An optional component the folder does not hold (and the caller did not pass): None, or what a
        subclass finds elsewhere (an older layout, a hook of another component)."""
        return None

    @classmethod
    def extract_init_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """diffusers' ``ConfigMixin.extract_init_dict``, after importing the allowed component libraries the
        folder names: ``DiffusionPipeline.from_pretrained`` calls it before loading the components."""
        import_component_libraries(config_dict)
        return super().extract_init_dict(config_dict, **kwargs)  # type: ignore[misc]

    def register_to_config(self, **kwargs: Any) -> None:
        """diffusers' ``register_to_config`` with each component recorded under the library that serves it
        (:func:`recorded_library`), so ``model_index.json`` loads with diffusers' own loader."""
        for name, value in kwargs.items():
            if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, str) for v in value):
                kwargs[name] = (recorded_library(value[0], value[1]), value[1])
        super().register_to_config(**kwargs)  # type: ignore[misc]

