"""Methods as configured, registered objects: configs validate, the registry resolves names per pipeline
family, stored settings resolve by decoding mode and batch, and bad settings name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest

from mmspec import methods
from mmspec.drafters import TreeConfig
from mmspec.methods import BuildRequest, MethodConfig, MethodPlan, SpeculationSettings
from mmspec.methods.eagle import EagleConfig, LanternConfig
from mmspec.methods.jacobi import GSDConfig, SJDConfig
from mmspec.methods.mulo import MuLoConfig
from mmspec.sampling import SamplingConfig

GREEDY = BuildRequest(SamplingConfig(do_sample=False))
SAMPLED = BuildRequest(SamplingConfig())


def test_builtin_methods_are_registered_per_pipeline_family():
    assert {"eagle", "lantern", "sjd", "gsd", "mulo"} <= set(methods.available("ar_image"))
    assert methods.get("lantern", "ar_image") is LanternConfig
    assert methods.get("gsd") is GSDConfig and issubclass(GSDConfig, SJDConfig)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        methods.get("nope")
    with pytest.raises(ValueError, match="does not run in continuous pipelines"):
        methods.get("lantern", "continuous")


@pytest.mark.parametrize("config_class, field, value, match", [
    (EagleConfig, "num_draft_tokens", 0, r"EagleConfig.num_draft_tokens must be an integer in \[1, 1024\]"),
    (EagleConfig, "num_draft_tokens", 2.5, "EagleConfig.num_draft_tokens"),
    (EagleConfig, "draft_confidence_threshold", math.nan, "draft_confidence_threshold"),
    (EagleConfig, "guided", "both", "EagleConfig.guided"),
    (EagleConfig, "lookup_only_from", 4, "set lookup_tail too"),
    (LanternConfig, "delta", 1.5, r"LanternConfig.delta must be a number in \[0.0, 1.0\]"),
    (LanternConfig, "lam", 1.0, "LanternConfig.lam"),
    (LanternConfig, "k", 0, "LanternConfig.k"),
    (SJDConfig, "init", "zeros", r"SJDConfig.init must be one of \['random', 'left'\]"),
    (GSDConfig, "prob_threshold", 0.0, "GSDConfig.prob_threshold"),
    (GSDConfig, "distance_threshold", math.nan, "GSDConfig.distance_threshold"),
    (MuLoConfig, "tau", 0.0, "MuLoConfig.tau"),
    (MuLoConfig, "resample", "fast", "MuLoConfig.resample"),
    (MuLoConfig, "guidance_scale", math.inf, "MuLoConfig.guidance_scale"),
])
def test_configs_refuse_out_of_range_values_naming_the_field(config_class, field, value, match):
    with pytest.raises(ValueError, match=match):
        config_class(**{field: value})


def test_configs_round_trip_through_plain_values_and_refuse_unknown_fields():
    config = LanternConfig(num_draft_tokens=6, tree=TreeConfig(depth=3, top_k=2, total_tokens=8), k=64, lam=3.0)
    assert LanternConfig.from_dict(config.to_dict()) == config
    assert GSDConfig.from_dict(GSDConfig().to_dict()).distance_threshold == math.inf  # "inf" in JSON
    with pytest.raises(ValueError, match="EagleConfig has no field 'lantern_k'"):
        EagleConfig.from_dict({"lantern_k": 5})
    with pytest.raises(ValueError, match="has no field 'window'"):
        EagleConfig().replace(window=3)
    assert EagleConfig().replace(num_draft_tokens=9).num_draft_tokens == 9
    with pytest.raises(ValueError, match="num_draft_tokens"):
        EagleConfig().replace(num_draft_tokens=-1)


def test_stored_settings_resolve_by_decoding_mode_and_batch():
    settings = SpeculationSettings.from_dict("ar_image", {
        "eagle": {"settings": {"num_draft_tokens": 8, "draft_confidence_threshold": 0.5},
                  "variants": [{"when": {"greedy": True, "batch_size": 1}, "settings": {"num_draft_tokens": 12}},
                               {"when": {"min_batch_size": 2}, "settings": {"num_draft_tokens": 2}}]},
    })
    assert settings.config_for("eagle", GREEDY) == EagleConfig(num_draft_tokens=12, draft_confidence_threshold=0.5)
    assert settings.config_for("eagle", SAMPLED).num_draft_tokens == 8
    batched = BuildRequest(SamplingConfig(do_sample=False), batch_size=4)
    assert settings.config_for("eagle", batched).num_draft_tokens == 2
    assert settings.config_for("sjd", SAMPLED) == SJDConfig()  # nothing stored: the class defaults
    again = SpeculationSettings.from_dict("ar_image", settings.to_dict())
    assert again.config_for("eagle", GREEDY) == settings.config_for("eagle", GREEDY)


@pytest.mark.parametrize("data, match", [
    ({"eagle": {"settings": {"lantern_k": 5}}}, "EagleConfig has no field 'lantern_k'"),
    ({"eagle": {"settings": {"num_draft_tokens": 0}}}, "num_draft_tokens"),
    ({"eagle": {"variants": [{"when": {"temperature": 1}, "settings": {}}]}}, "conditions"),
    ({"eagle": {"settings": {}, "extra": 1}}, "'settings' and optional 'variants'"),
    ({"nope": {"settings": {}}}, "unknown method 'nope'"),
    ({"cspd": {"settings": {}}}, "cspd"),
    ({"eagle": {"variants": [{"when": {"greedy": "yes"}, "settings": {}}]}},
     "variant 0 of 'eagle': condition 'greedy' must be true or false, got 'yes'"),
    ({"eagle": {"variants": [{"when": {"batch_size": 0}, "settings": {}}]}}, "'batch_size' must be an integer >= 1"),
    ({"eagle": {"variants": [{"when": {"min_batch_size": True}, "settings": {}}]}}, "'min_batch_size' must be an"),
    ({"eagle": {"settings": [1, 2]}}, "the 'settings' of 'eagle' must be a JSON object.*got list"),
    ({"eagle": {"variants": {"when": {}}}}, "the 'variants' of 'eagle' must be a list"),
    ({"eagle": {"variants": [[1]]}}, "variant 0 of 'eagle' must be an object"),
    ({"eagle": {"variants": [{"when": {}, "settings": 3}]}}, "variant 0 of 'eagle': its 'settings' must be a JSON"),
    ({"eagle": {"variants": [{"when": [], "settings": {}}]}}, "variant 0 of 'eagle': its 'when' must be a JSON"),
])
def test_bad_stored_settings_name_what_is_wrong(data, match):
    with pytest.raises(ValueError, match=match):
        SpeculationSettings.from_dict("ar_image", data)


def test_settings_files_round_trip(tmp_path):
    settings = SpeculationSettings.from_dict("ar_image", {"mulo": {"settings": {"tau": 0.25}}})
    settings.save(tmp_path)
    loaded = SpeculationSettings.load("ar_image", tmp_path)
    assert loaded.config_for("mulo", SAMPLED) == MuLoConfig(tau=0.25)
    assert SpeculationSettings.load("ar_image", tmp_path / "empty").config_for("mulo", SAMPLED) == MuLoConfig()
    (tmp_path / methods.SETTINGS_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="speculation_config.json is not valid JSON"):
        SpeculationSettings.load("ar_image", tmp_path)


def test_a_folder_named_like_the_settings_file_is_refused(tmp_path):
    """A directory where ``speculation_config.json`` should be is not "no stored settings": it is refused, naming
    the path, so a broken checkpoint does not silently run every method at its defaults."""
    (tmp_path / methods.SETTINGS_FILE).mkdir()
    with pytest.raises(ValueError, match=f"{methods.SETTINGS_FILE} is not a file"):
        SpeculationSettings.load("ar_image", tmp_path)


def test_registering_a_method_from_outside_and_refusals():
    @dataclass(frozen=True)
    class Toy(MethodConfig):
        pipelines: ClassVar[tuple[str, ...]] = ("ar_image",)
        width: int = 2

        def build(self, pipeline, request):
            return MethodPlan()

    methods.register("toy_registry_check", Toy)
    try:
        assert methods.get("toy_registry_check", "ar_image") is Toy and Toy.name == "toy_registry_check"
        assert methods.resolve_method("toy_registry_check", "ar_image").width == 2
        assert methods.resolve_method(Toy(width=3), "ar_image").width == 3
        with pytest.raises(ValueError, match="already registered"):
            methods.register("eagle", Toy)
        with pytest.raises(ValueError, match="not of this one"):
            methods.resolve_method(Toy(), "vlm")
    finally:
        methods.unregister("toy_registry_check")
    with pytest.raises(TypeError, match="MethodConfig subclass"):
        methods.register("x", dict)
    with pytest.raises(ValueError, match="other than 'none'"):
        methods.register("none", Toy)
    with pytest.raises(ValueError, match="method must be a method name or a MethodConfig"):
        methods.resolve_method(3, "ar_image")
    assert methods.resolve_method("none", "ar_image") is None
