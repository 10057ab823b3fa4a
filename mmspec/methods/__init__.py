"""Speculative decoding methods as configured, registered objects.

Every method is a frozen config dataclass (validated on construction) registered under a name; a pipeline
call takes ``method="name"`` (the checkpoint's stored settings, :mod:`mmspec.methods.settings`) or a config
instance (explicit settings); ``pipe.method_config("name", do_sample=..., batch_size=...)`` is the config a
name resolves to, a starting point for ``.replace(...)``. A method registered from outside the package works
the same way::

    from dataclasses import dataclass
    from mmspec.methods import MethodConfig, MethodPlan, register

    @register("my_method")
    @dataclass(frozen=True)
    class MyConfig(MethodConfig):
        pipelines = ("ar_image", "vlm")
        num_draft_tokens: int = 4

        def build(self, pipeline, request):
            return MethodPlan(drafter=MyDrafter(self.num_draft_tokens))
"""

from mmspec.methods.base import (
    PIPELINE_FAMILIES,
    BuildRequest,
    MethodConfig,
    MethodPlan,
    available,
    get,
    register,
    resolve_method,
    set_builtin_modules,
    unregister,
)
from mmspec.methods.settings import SETTINGS_FILE, MethodSettings, SpeculationSettings, Variant

set_builtin_modules((
    "mmspec.methods.cspd",
    "mmspec.methods.eagle",
    "mmspec.methods.jacobi",
    "mmspec.methods.mulo",
    "mmspec.methods.scd",
    "mmspec.methods.sjd_pac",
    "mmspec.methods.vlm_heads",
    "mmspec.methods.sdvg",
    "mmspec.methods.relaxed",
))

__all__ = [
    "PIPELINE_FAMILIES", "SETTINGS_FILE", "BuildRequest", "MethodConfig", "MethodPlan", "MethodSettings",
    "SpeculationSettings", "Variant", "available", "get", "register", "resolve_method", "unregister",
]
