"""Make mmspec's pipeline classes resolvable on the ``diffusers`` module after ``import mmspec`` alone.

A saved pipeline's ``model_index.json`` records its class as ``"_class_name": "ARImagePipeline"``, and
``diffusers.DiffusionPipeline.from_pretrained`` looks that name up as an attribute of the ``diffusers`` module
(nowhere else without ``custom_pipeline=`` code in the folder). Importing a pipeline module exposes its class
there (:func:`mmspec.pipelines.pretrained.expose_to_diffusers`), but ``import mmspec`` must stay free of torch
and diffusers, so it cannot import the pipelines. Instead it installs this hook: once ``diffusers`` is imported
(already, or later), a module-level ``__getattr__`` (PEP 562) on it resolves mmspec's pipeline class names on
first use by importing the one pipeline module that defines the class. Every other name falls through to
diffusers' own lazy lookup, and a name diffusers defines is never replaced.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

#: pipeline class name -> the mmspec module that defines it (and exposes it on diffusers when imported)
PIPELINE_MODULES = {
    "ARImagePipeline": "mmspec.pipelines.ar_image",
    "VLMPipeline": "mmspec.pipelines.vlm",
    "ContinuousARImagePipeline": "mmspec.pipelines.continuous_ar_image",
    "ARVideoPipeline": "mmspec.pipelines.ar_video",
}


def _resolver(previous: Callable[[str], Any] | None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for diffusers: mmspec's pipeline names, else ``previous`` (or AttributeError,
    after which diffusers' own ``_LazyModule.__getattr__`` runs)."""

    def __getattr__(name: str) -> Any:
        if name in PIPELINE_MODULES:
            return getattr(importlib.import_module(PIPELINE_MODULES[name]), name)
        if previous is not None:
            return previous(name)
        raise AttributeError(name)

    __getattr__.mmspec_pipelines = True  # type: ignore[attr-defined]
    return __getattr__


def install_on(module: ModuleType) -> None:
    """Add the pipeline-name resolver to an imported ``diffusers`` module (once)."""
    previous = module.__dict__.get("__getattr__")
    if getattr(previous, "mmspec_pipelines", False):
        return
    module.__getattr__ = _resolver(previous)  # type: ignore[method-assign]


class _LoaderAfterExec(importlib.abc.Loader):
    """Wraps diffusers' loader: runs it, then installs the resolver on the module it left in ``sys.modules``
    (diffusers replaces itself there with a lazy module while it executes)."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        install_on(sys.modules.get(module.__name__, module))

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ... of the wrapped loader
        return getattr(self.loader, name)


class _DiffusersFinder(importlib.abc.MetaPathFinder):
    """Finds ``diffusers`` with the other finders and wraps its loader in :class:`_LoaderAfterExec`."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "diffusers":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderAfterExec(spec.loader)
                return spec
        return None


def install() -> None:
    """Install the resolver now if ``diffusers`` is imported, else when it is (``import mmspec`` calls this)."""
    if "diffusers" in sys.modules:
        install_on(sys.modules["diffusers"])
    elif not any(isinstance(finder, _DiffusersFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DiffusersFinder())
