"""What every method is: a frozen, validated config that knows how to build its drafter and rule.

A method is one config class (a frozen dataclass deriving :class:`MethodConfig`) registered under a
name. A pipeline call ``pipe(..., method="eagle")`` resolves the name to the config stored with the
checkpoint (:mod:`mmspec.methods.settings`), ``pipe(..., method=EagleConfig(...))`` uses the given one;
either way the pipeline then asks the config for a :class:`MethodPlan` (the drafter, the acceptance rule
and, for methods with a loop of their own, that loop) and runs it. A new method is one file with its
config class and one :func:`register` line; no pipeline changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from mmspec.rules import AcceptanceRule
from mmspec.sampling import SamplingConfig

C = TypeVar("C", bound="MethodConfig")

#: the pipeline families a method can run in
PIPELINE_FAMILIES = ("ar_image", "vlm", "continuous", "video")


@dataclass(frozen=True)
class BuildRequest:
    """What a pipeline call asks of a method: the decoding settings shared by every method.

    Attributes:
        sampling: how logits become distributions (greedy when ``do_sample`` is False).
        generator: the call's random source.
        guidance_scale: the target's classifier-free guidance (1.0: none).
        batch_size: rows decoded per call (images or prompts times outputs per prompt).
    """

    sampling: SamplingConfig
    generator: torch.Generator | None = None
    guidance_scale: float = 1.0
    batch_size: int = 1

    @property
    def greedy(self) -> bool:
        return not self.sampling.do_sample


@dataclass
class MethodPlan:
    """What a method gives the pipeline's loop.

    Attributes:
        drafter: the drafting strategy (None: target-only decoding).
        rule: the acceptance rule (None: exact sampling, or an argmax match when greedy).
        loop: for methods that decode differently from the pipeline's token-level loop (block-wise
            MuLo-SD, CSpD rounds, reward-routed video blocks): the loop to run instead, a callable with the
            signature of the pipeline's own loop (for token pipelines
            :func:`~mmspec.speculate.speculative_generate`'s); None: the pipeline's default loop.
    """

    drafter: Any = None
    rule: AcceptanceRule | None = None
    loop: Any = None


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method's settings: frozen, validated on construction.

    Subclasses are frozen dataclasses that set :attr:`name` and :attr:`pipelines` and override
    :meth:`validate` (checks that raise ``ValueError`` naming the field) and :meth:`build`.
    """

    #: the registry name (``method="..."``)
    name: ClassVar[str] = ""
    #: the pipeline families the method runs in: "ar_image", "vlm", "continuous", "video"
    pipelines: ClassVar[tuple[str, ...]] = ()
    #: whether the method, at its default settings, samples exactly the target's distribution (greedy: the
    #: target's tokens); False for relaxed or routed acceptance. Command lines list the lossless methods.
    lossless: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when a value is out of its range."""

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        """The drafter, rule and loop settings of this method for ``pipeline`` and one call."""
        raise NotImplementedError(f"{type(self).__name__} does not implement build()")

    # -- conversions ----------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls: type[C], values: Mapping[str, Any], *, source: str = "") -> C:
        """Build from plain values (a stored settings file, JSON); an unknown key raises naming it."""
        where = f" in {source}" if source else ""
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {unknown[0]!r}{where}; its fields are "
                             f"{', '.join(cls.field_names()) or 'none'}")
        return cls(**{key: _from_json(cls, key, value) for key, value in values.items()})

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-compatible) of every field."""
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self: C, **changes: Any) -> C:
        """A copy with ``changes`` (validated again); an unknown field raises naming it."""
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise ValueError(f"{type(self).__name__} has no field {unknown[0]!r}; its fields are "
                             f"{', '.join(self.field_names())}")
        return dataclasses.replace(self, **changes)


def _to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _from_json(cls: type, key: str, value: Any) -> Any:
    """Undo :func:`_to_json` for a field: nested dataclass configs from dicts, infinities from strings."""
    field_types = getattr(cls, "_nested_fields", {})
    if key in field_types and isinstance(value, Mapping):
        return field_types[key](**value)
    if value in ("inf", "-inf"):
        return float(value)
    return value


# -- field checks shared by the config classes ------------------------------------------------------------------
def _owner(config: MethodConfig) -> str:
    return type(config).__name__


def check_int_field(config: MethodConfig, name: str, low: int = 1, high: int | None = None,
                    optional: bool = False) -> None:
    """``config.name`` is an integer in ``[low, high]`` (None allowed when ``optional``)."""
    value = getattr(config, name)
    if value is None and optional:
        return
    bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        raise ValueError(f"{_owner(config)}.{name} must be an integer {bounds}, got {value!r}")


def check_float_field(config: MethodConfig, name: str, low: float = -math.inf, high: float = math.inf, *,
                      low_open: bool = False, high_open: bool = False, allow_inf: bool = False,
                      optional: bool = False) -> None:
    """``config.name`` is a real number in the stated range (NaN never; infinity only with ``allow_inf``)."""
    value = getattr(config, name)
    if value is None and optional:
        return
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    text = f"a number in {left}{low}, {high}{right}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{_owner(config)}.{name} must be {text}, got {value!r}")
    if math.isinf(value) and not allow_inf:
        raise ValueError(f"{_owner(config)}.{name} must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        raise ValueError(f"{_owner(config)}.{name} must be {text}, got {value!r}")


def check_choice_field(config: MethodConfig, name: str, choices: Iterable[Any]) -> None:
    """``config.name`` is one of ``choices``."""
    value, allowed = getattr(config, name), tuple(choices)
    if not any(value is choice or (type(value) is type(choice) and value == choice) for choice in allowed):
        raise ValueError(f"{_owner(config)}.{name} must be one of {list(allowed)}, got {value!r}")


def check_bool_field(config: MethodConfig, name: str, optional: bool = False) -> None:
    value = getattr(config, name)
    if not (isinstance(value, bool) or (optional and value is None)):
        allowed = "True, False or None" if optional else "True or False"
        raise ValueError(f"{_owner(config)}.{name} must be {allowed}, got {value!r}")


# -- the registry -----------------------------------------------------------------------------------------------
#: name -> pipeline family -> config class ("eagle" is one class for AR images, another for VLMs)
_REGISTRY: dict[str, dict[str, type[MethodConfig]]] = {}


def register(name: str, config_class: type[MethodConfig] | None = None) -> Any:
    """Register ``config_class`` as ``method=name`` in each pipeline family it names (``pipelines``); also
    usable as a class decorator, ``@register("x")``. Registering a (name, family) pair twice with another
    class raises.
    """
    def add(cls: type[MethodConfig]) -> type[MethodConfig]:
        if not (isinstance(cls, type) and issubclass(cls, MethodConfig)):
            raise TypeError(f"register({name!r}, ...) needs a MethodConfig subclass, got {cls!r}")
        if not isinstance(name, str) or not name or name == "none":
            raise ValueError(f"a method name must be a non-empty string other than 'none', got {name!r}")
        if not cls.pipelines or any(family not in PIPELINE_FAMILIES for family in cls.pipelines):
            raise ValueError(f"{cls.__name__}.pipelines must name pipeline families among {PIPELINE_FAMILIES}, "
                             f"got {cls.pipelines!r}")
        families = _REGISTRY.setdefault(name, {})
        for family in cls.pipelines:
            known = families.get(family)
            if known is not None and known is not cls:
                raise ValueError(f"method {name!r} is already registered for {family} pipelines to {known.__name__}")
        cls.name = name
        families.update({family: cls for family in cls.pipelines})
        return cls

    return add if config_class is None else add(config_class)


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (tests and plugins that register temporary methods)."""
    _REGISTRY.pop(name, None)


def get(name: str, pipeline: str | None = None) -> type[MethodConfig]:
    """The config class registered as ``name`` (for the ``pipeline`` family when the name has several)."""
    _load_builtin_methods()
    families = _REGISTRY.get(name)
    if not families:
        raise ValueError(f"unknown method {name!r}; registered methods: {', '.join(sorted(_REGISTRY))}")
    if pipeline is None:
        classes = set(families.values())
        if len(classes) > 1:
            raise ValueError(f"method {name!r} exists for several pipeline families ({', '.join(sorted(families))}): "
                             "name the family")
        return classes.pop()
    if pipeline not in families:
        raise ValueError(f"method={name!r} does not run in {pipeline} pipelines; methods there: "
                         f"{', '.join(['none', *available(pipeline)])}")
    return families[pipeline]


def available(pipeline: str | None = None) -> list[str]:
    """Registered method names, those that run in ``pipeline`` (a family name) when given."""
    _load_builtin_methods()
    return sorted(name for name, families in _REGISTRY.items() if pipeline is None or pipeline in families)


_BUILTIN_MODULES: tuple[str, ...] = ()
_builtins_loaded = False


def set_builtin_modules(modules: tuple[str, ...]) -> None:
    """The package's own method modules, imported on the first registry lookup (they import models)."""
    global _BUILTIN_MODULES
    _BUILTIN_MODULES = modules


def _load_builtin_methods() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    from importlib import import_module

    for module in _BUILTIN_MODULES:
        import_module(module)


def resolve_method(method: str | MethodConfig, pipeline: str,
                   stored: Callable[[str], MethodConfig] | None = None) -> MethodConfig | None:
    """``method`` as a config for a ``pipeline`` family: None for "none", the config itself when given one,
    else ``stored(name)`` (the checkpoint's settings) or the registered class's defaults.

    Raises ``ValueError`` for unknown names and for methods of another pipeline family.
    """
    if isinstance(method, MethodConfig):
        config = method
    elif isinstance(method, str):
        if method == "none":
            return None
        get(method, pipeline)  # unknown names and methods of other families raise here
        config = stored(method) if stored is not None else get(method, pipeline)()
    else:
        raise ValueError(f"method must be a method name or a MethodConfig, got {type(method).__name__}")
    if pipeline not in config.pipelines:
        raise ValueError(f"{type(config).__name__} configures a method of {', '.join(config.pipelines)} "
                         f"pipelines, not of this one ({pipeline})")
    return config
