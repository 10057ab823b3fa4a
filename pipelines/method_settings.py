"""A pipeline's methods: names resolved to the settings stored with its checkpoint, or explicit configs.

:class:`MethodSettingsMixin` gives a pipeline its ``speculation_settings`` (read from the folder's
``speculation_config.json`` by ``from_pretrained``, written by ``save_pretrained``), :meth:`method_config`
(what a plain ``method="name"`` call uses, for inspection or as a starting point for
``config.replace(...)``) and the one resolution step every ``__call__`` runs.

:func:`reject_removed_keywords` turns a method keyword that ``__call__`` no longer takes (``lantern_k=``,
``num_draft_tokens=``) into an error that names the config field to set instead; any other unknown
keyword raises as Python does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from mmspec.methods import (
    SETTINGS_FILE,
    BuildRequest,
    MethodConfig,
    MethodPlan,
    SpeculationSettings,
    available,
    get,
    resolve_method,
)
from mmspec.sampling import SamplingConfig

#: A removed ``__call__`` keyword -> (the config field that replaces it, the methods whose configs have it;
#: the first is the one an error message suggests when the call's method has no such field).
MovedKeywords = Mapping[str, tuple[str, tuple[str, ...]]]


class MethodSettingsMixin:
    """For a ``DiffusionPipeline`` whose ``__call__`` takes ``method=`` (list it before ``DiffusionPipeline``).

    Set :attr:`pipeline_family` in the pipeline class ("ar_image", "vlm", "continuous", "video").
    """

    pipeline_family: ClassVar[str] = ""

    @property
    def speculation_settings(self) -> SpeculationSettings:
        """The stored recommended settings: those ``from_pretrained`` read or :meth:`set_speculation_settings`
        set; otherwise, for a pipeline that diffusers' own ``DiffusionPipeline.from_pretrained`` loaded, the
        ``speculation_config.json`` of the folder or hub repository it came from (read on first use), else
        none (every method at its defaults)."""
        settings = self.__dict__.get("_speculation_settings")
        if settings is None:
            origin = self._loaded_from()
            if origin is None:
                self.__dict__["_speculation_settings"] = SpeculationSettings(self.pipeline_family)
            else:
                self.read_speculation_settings(origin)
            settings = self.__dict__["_speculation_settings"]
        return settings

    def _loaded_from(self) -> str | None:
        """The folder or hub id diffusers recorded as this pipeline's origin (``_name_or_path``), if any."""
        config = getattr(self, "config", None)
        origin = config.get("_name_or_path") if isinstance(config, Mapping) else None
        return os.fspath(origin) if isinstance(origin, (str, os.PathLike)) and os.fspath(origin) else None

    def set_speculation_settings(self, settings: SpeculationSettings | Mapping[str, Any]) -> None:
        """Replace the stored recommended settings (a :class:`SpeculationSettings` or its JSON mapping)."""
        if not isinstance(settings, SpeculationSettings):
            settings = SpeculationSettings.from_dict(self.pipeline_family, settings)
        elif settings.pipeline != self.pipeline_family:
            raise ValueError(f"these settings are for {settings.pipeline} pipelines, not {self.pipeline_family}")
        self.__dict__["_speculation_settings"] = settings

    def methods(self) -> list[str]:
        """The method names this pipeline's ``__call__`` accepts ("none" first)."""
        return ["none", *available(self.pipeline_family)]

    def method_config(self, name: str, *, do_sample: bool = True, batch_size: int = 1,
                      guidance_scale: float = 1.0) -> MethodConfig | None:
        """The config a call with ``method=name`` uses for this decoding mode and batch (None for "none")."""
        request = BuildRequest(SamplingConfig(do_sample=do_sample), guidance_scale=guidance_scale,
                               batch_size=batch_size)
        return self.resolve_method(name, request)

    def check_method(self, method: Any) -> None:
        """``method`` is "none", a method name of this pipeline's family or a config of it (``ValueError``
        naming the choices otherwise); cheap, so a call can refuse a bad method before encoding anything."""
        if isinstance(method, str):
            if method not in self.methods():
                raise ValueError(f"method={method!r} is not a method of {type(self).__name__} ({self.pipeline_family} "
                                 f"pipelines); choose from {self.methods()} or pass a MethodConfig")
            return
        resolve_method(method, self.pipeline_family)  # a config of another family, or not a config: raises

    def resolve_method(self, method: str | MethodConfig, request: BuildRequest) -> MethodConfig | None:
        """``method`` as a config: the stored settings for a name, the config itself when given one."""
        self.check_method(method)
        return resolve_method(method, self.pipeline_family,
                              lambda name: self.speculation_settings.config_for(name, request))

    def build_method(self, method: str | MethodConfig, request: BuildRequest) -> tuple[MethodConfig | None, MethodPlan]:
        """Resolve ``method`` and build its drafter, rule and loop for one call (target-only for "none").

        Raises:
            TypeError: a method (one registered from outside, typically) whose ``build()`` returned something
                other than a :class:`~mmspec.methods.MethodPlan`, naming the method and its config class.
        """
        config = self.resolve_method(method, request)
        if config is None:
            return None, MethodPlan()
        plan = config.build(self, request)
        if not isinstance(plan, MethodPlan):
            raise TypeError(f"method {config.name!r} ({type(config).__name__}.build) returned "
                            f"{type(plan).__name__}, expected a MethodPlan (drafter, rule, loop) for "
                            f"{type(self).__name__}")
        return config, plan

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """The pipeline folder plus ``speculation_config.json`` (when any method has stored settings)."""
        super().save_pretrained(save_directory, **kwargs)  # type: ignore[misc]
        self.speculation_settings.save(save_directory)

    def use_speculation_settings(self, settings: SpeculationSettings | Mapping[str, Any] | None,
                                 folder: str | os.PathLike, **hub_kwargs: Any) -> None:
        """What ``from_pretrained`` does last: the given ``settings`` (its ``speculation_settings=``) win,
        otherwise the folder's (or hub repository's) ``speculation_config.json`` is read."""
        if settings is not None:
            self.set_speculation_settings(settings)
        else:
            self.read_speculation_settings(folder, **hub_kwargs)

    def read_speculation_settings(self, folder: str | os.PathLike, **hub_kwargs: Any) -> None:
        """Load ``speculation_config.json`` of a pipeline folder (none there: every method at its defaults).

        ``folder`` may also be a hub repository id (a pipeline ``from_pretrained`` downloaded); the file is
        then fetched with ``huggingface_hub`` (``hub_kwargs``: ``revision``, ``cache_dir``, ``token``,
        ``local_files_only``). A repository without the file has no stored settings."""
        if Path(folder).is_dir():
            self.set_speculation_settings(SpeculationSettings.load(self.pipeline_family, Path(folder)))
            return
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        wanted = {key: hub_kwargs[key] for key in ("revision", "cache_dir", "token", "local_files_only")
                  if hub_kwargs.get(key) is not None}
        try:
            path = hf_hub_download(os.fspath(folder), SETTINGS_FILE, **wanted)
        except (EntryNotFoundError, LocalEntryNotFoundError):
            self.set_speculation_settings(SpeculationSettings(self.pipeline_family))
            return
        self.set_speculation_settings(SpeculationSettings.load(self.pipeline_family, Path(path).parent))


def reject_removed_keywords(pipeline: Any, kwargs: Mapping[str, Any], moved: MovedKeywords,
                            method: str | MethodConfig | None = None) -> None:
    """Refuse keywords a pipeline's ``__call__`` does not take: a method setting that became a config field
    (``moved``) raises ``TypeError`` naming the field and how to pass it, for the call's ``method`` when its
    config has that field; any other keyword raises like Python's own unexpected-keyword error."""
    if not kwargs:
        return
    call = f"{type(pipeline).__name__}.__call__()"
    unknown = [name for name in kwargs if name not in moved]
    if unknown:
        raise TypeError(f"{call} got an unexpected keyword argument {unknown[0]!r}")
    family = pipeline.pipeline_family
    lines, fields = [], {}
    for name in kwargs:
        field, owners = moved[name]
        lines.append(f"{name} -> {' / '.join(f'{get(m, family).__name__}.{field}' for m in owners)}")
        fields[name] = (field, owners)
    target = _suggested_method(method, family, [field for field, _ in fields.values()],
                               next(iter(fields.values()))[1][0])
    changes = ", ".join(f"{field}=..." for field, _ in fields.values())
    if isinstance(target, MethodConfig):
        how = f"method=<your {type(target).__name__}>.replace({changes})"
    else:
        config = get(target, family).__name__
        how = (f"method={config}({changes}) or method=pipe.method_config({target!r}, ...).replace({changes}) "
               "(the checkpoint's settings with yours)")
    names = ", ".join(kwargs)
    raise TypeError(f"{call} no longer takes {names}: method settings are fields of the method's config "
                    f"({'; '.join(lines)}). Pass {how}")


def _suggested_method(method: Any, family: str, fields: list[str], fallback: str) -> str | MethodConfig:
    """The call's method (a name or config) when its config has every field; else ``fallback``."""
    if isinstance(method, MethodConfig):
        return method if set(fields) <= set(method.field_names()) else fallback
    if isinstance(method, str) and method in available(family):
        if set(fields) <= set(get(method, family).field_names()):
            return method
    return fallback
