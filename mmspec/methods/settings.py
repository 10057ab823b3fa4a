"""Recommended method settings stored with a checkpoint (``speculation_config.json``).

A pipeline folder carries, per method, the settings measured best for its models; ``method="eagle"``
uses them, so a plain call gets what the benchmarks report. The best settings may depend on how a call
decodes (greedy chains accept more drafts than sampled ones; several rows per call make every verified
position cost more), so a method's entry is a base plus variants that apply when their condition holds::

    {
      "eagle": {
        "settings": {"num_draft_tokens": 8, "draft_confidence_threshold": 0.5},
        "variants": [
          {"when": {"greedy": true, "batch_size": 1}, "settings": {"num_draft_tokens": 12}},
          {"when": {"min_batch_size": 2}, "settings": {"num_draft_tokens": 2}}
        ]
      }
    }

Resolution starts from the config class's defaults, applies ``settings``, then every matching variant in
file order (later ones win). Conditions: ``greedy`` (bool), ``batch_size`` (exact), ``min_batch_size``.
A method missing from the file runs with its class defaults.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmspec.files import write_json_atomic
from mmspec.methods.base import BuildRequest, MethodConfig, get

SETTINGS_FILE = "speculation_config.json"
CONDITIONS = ("greedy", "batch_size", "min_batch_size")


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    """``value`` as a JSON object of a settings file, else ValueError naming ``what`` and what it got."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a JSON object of field: value, got {type(value).__name__} {value!r}")
    return value


def _check_condition(name: str, value: Any, what: str) -> None:
    """A variant condition's value has the type its comparison needs: ``greedy`` a bool, ``batch_size`` and
    ``min_batch_size`` an integer >= 1 (``{"greedy": "yes"}`` would otherwise never match, silently)."""
    if name == "greedy":
        ok, wanted = isinstance(value, bool), "true or false"
    else:
        ok, wanted = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an integer >= 1"
    if not ok:
        raise ValueError(f"{what}: condition {name!r} must be {wanted}, got {value!r}")


@dataclass(frozen=True)
class Variant:
    """Settings that apply when every condition of ``when`` holds for a call."""

    when: Mapping[str, Any]
    settings: Mapping[str, Any]

    def applies(self, request: BuildRequest) -> bool:
        checks = {"greedy": lambda v: request.greedy == v, "batch_size": lambda v: request.batch_size == v,
                  "min_batch_size": lambda v: request.batch_size >= v}
        return all(checks[name](value) for name, value in self.when.items())


@dataclass(frozen=True)
class MethodSettings:
    """One method's stored settings: a base and conditional variants."""

    settings: Mapping[str, Any] = field(default_factory=dict)
    variants: tuple[Variant, ...] = ()

    def values_for(self, request: BuildRequest) -> dict[str, Any]:
        values = dict(self.settings)
        for variant in self.variants:
            if variant.applies(request):
                values.update(variant.settings)
        return values


class SpeculationSettings:
    """The recommended settings of every method for one checkpoint (see the module docstring)."""

    def __init__(self, pipeline: str, methods: Mapping[str, MethodSettings] | None = None, source: str = "") -> None:
        self.pipeline = pipeline
        self.methods: dict[str, MethodSettings] = dict(methods or {})
        self.source = source or SETTINGS_FILE

    # -- resolution -----------------------------------------------------------------------------------
    def config_for(self, name: str, request: BuildRequest) -> MethodConfig:
        """The config of method ``name`` for a call described by ``request``."""
        config_class = get(name, self.pipeline)
        entry = self.methods.get(name)
        values = entry.values_for(request) if entry is not None else {}
        return config_class.from_dict(values, source=f"{self.source} ({name})")

    # -- files ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, pipeline: str, data: Mapping[str, Any], source: str = "") -> SpeculationSettings:
        """Parse and check a settings mapping (unknown methods, fields and conditions raise naming them)."""
        where = source or SETTINGS_FILE
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must hold a JSON object of methods, got {type(data).__name__}")
        methods = {}
        for name, entry in data.items():
            if not isinstance(entry, Mapping) or set(entry) - {"settings", "variants"}:
                raise ValueError(f"{where}: the entry of {name!r} must be an object with 'settings' and optional "
                                 f"'variants', got {entry!r}")
            settings = _mapping(entry.get("settings", {}), f"{where}: the 'settings' of {name!r}")
            variant_list = entry.get("variants", [])
            if not isinstance(variant_list, list):
                raise ValueError(f"{where}: the 'variants' of {name!r} must be a list of objects "
                                 f"{{'when': ..., 'settings': ...}}, got {type(variant_list).__name__}")
            variants = []
            for index, variant in enumerate(variant_list):
                what = f"{where}: variant {index} of {name!r}"
                if not isinstance(variant, Mapping) or set(variant) - {"when", "settings"}:
                    raise ValueError(f"{what} must be an object with 'when' and 'settings', got {variant!r}")
                when = _mapping(variant.get("when", {}), f"{what}: its 'when'")
                if set(when) - set(CONDITIONS):
                    raise ValueError(f"{what} has conditions {dict(when)!r}; allowed: {', '.join(CONDITIONS)}")
                for condition, value in when.items():
                    _check_condition(condition, value, what)
                variants.append(Variant(dict(when), dict(_mapping(variant.get("settings", {}),
                                                                  f"{what}: its 'settings'"))))
            methods[name] = MethodSettings(dict(settings), tuple(variants))
        settings = cls(pipeline, methods, where)
        settings.check()
        return settings

    def check(self) -> None:
        """Every stored method is registered and every stored value is valid for its config."""
        for name, entry in self.methods.items():
            config_class = get(name, self.pipeline)
            for values in (entry.settings, *(dict(entry.settings, **v.settings) for v in entry.variants)):
                config_class.from_dict(values, source=f"{self.source} ({name})")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, entry in self.methods.items():
            out[name] = {"settings": dict(entry.settings)}
            if entry.variants:
                out[name]["variants"] = [{"when": dict(v.when), "settings": dict(v.settings)} for v in entry.variants]
        return out

    @classmethod
    def load(cls, pipeline: str, folder: str | os.PathLike) -> SpeculationSettings:
        """The settings saved in ``folder`` (none stored: an empty set, every method at its defaults)."""
        path = Path(folder) / SETTINGS_FILE
        if path.exists() and not path.is_file():
            raise ValueError(f"{path} is not a file: a pipeline folder's {SETTINGS_FILE} holds its stored method "
                             "settings (remove or rename what is there)")
        if not path.is_file():
            return cls(pipeline, source=str(path))
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from None
        return cls.from_dict(pipeline, data, source=str(path))

    def save(self, folder: str | os.PathLike) -> Path | None:
        """Write ``speculation_config.json`` into ``folder`` (nothing when no method has settings)."""
        if not self.methods:
            return None
        return write_json_atomic(Path(folder) / SETTINGS_FILE, self.to_dict())
