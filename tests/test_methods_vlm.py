"""The VLM methods as configured, registered objects (mmspec/methods/vlm_heads.py) in VLMPipeline: configs
validate and round-trip, a plain ``method="name"`` call runs the zoo's stored settings exactly as the same
config given explicitly, a method registered from outside runs losslessly, bad methods and removed keywords
are refused naming the field, and the settings travel with a saved pipeline folder."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pipeline_utils import copy_pending_method, quiet_pipeline

from mmspec import methods
from mmspec.drafters import TreeConfig
from mmspec.methods import BuildRequest, SpeculationSettings
from mmspec.methods.eagle import EagleConfig
from mmspec.methods.vlm_heads import (
    DraftVLMConfig,
    FlashConfig,
    SpecVLMConfig,
    ViSpecConfig,
    VLMDraftConfig,
    VLMEagleConfig,
    draft_component,
)
from mmspec.models import shapes_vlm as sv
from mmspec.models.recipes.build_zoo_vlm import SPECULATION_SETTINGS
from mmspec.pipelines import VLMPipeline
from mmspec.pipelines.hub import zoo_dir
from mmspec.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONFIGS = {"eagle": VLMEagleConfig, "flash": FlashConfig, "vispec": ViSpecConfig, "specvlm": SpecVLMConfig,
           "draft_vlm": DraftVLMConfig}
COMPONENTS = {"eagle": "eagle_head", "flash": "flash_head", "vispec": "vispec_head", "specvlm": "specvlm_head",
              "draft_vlm": "draft_model"}
TREE = TreeConfig(depth=3, top_k=2, total_tokens=6)
LIMIT = 1024  # the zoo captioner's max_position_embeddings


@pytest.fixture(scope="module")
def pipe() -> VLMPipeline:
    return quiet_pipeline(VLMPipeline, "mmspec/shapes-vlm")


@pytest.fixture(scope="module")
def example() -> dict:
    return sv.image_example("test", 0, 1, "describe")


def _run(pipe: VLMPipeline, example: dict, method, seed: int | None = None, **kwargs):
    sampled = {} if seed is None else {"do_sample": True, "generator": torch.Generator().manual_seed(seed)}
    return pipe(example["frames"][0], example["prompt"], method, max_new_tokens=48, **sampled, **kwargs)


# -- configs and the registry -------------------------------------------------------------------------------------
def test_vlm_methods_are_registered_beside_the_ar_image_ones():
    assert set(CONFIGS) <= set(methods.available("vlm"))
    for name, config_class in CONFIGS.items():
        assert methods.get(name, "vlm") is config_class and issubclass(config_class, VLMDraftConfig)
        assert config_class.component == COMPONENTS[name] and draft_component(name) == COMPONENTS[name]
        assert draft_component(config_class()) == COMPONENTS[name]
    assert methods.get("eagle", "ar_image") is EagleConfig and VLMEagleConfig is not EagleConfig
    with pytest.raises(ValueError, match="'eagle' exists for several pipeline families"):
        methods.get("eagle")
    with pytest.raises(ValueError, match="method='lantern' does not run in vlm pipelines"):
        methods.get("lantern", "vlm")
    assert draft_component("none") is None and draft_component(None) is None


@pytest.mark.parametrize("config_class, field, value, match", [
    (VLMEagleConfig, "num_draft_tokens", 0, r"VLMEagleConfig.num_draft_tokens must be an integer in \[1, 1024\]"),
    (FlashConfig, "num_draft_tokens", 2.5, "FlashConfig.num_draft_tokens"),
    (DraftVLMConfig, "num_draft_tokens", True, "DraftVLMConfig.num_draft_tokens"),
    (ViSpecConfig, "draft_confidence_threshold", 1.0, r"ViSpecConfig.draft_confidence_threshold must be a number in "
                                                      r"\[0.0, 1.0\)"),
    (SpecVLMConfig, "draft_confidence_threshold", math.nan, "SpecVLMConfig.draft_confidence_threshold"),
    (VLMEagleConfig, "draft_confidence_threshold", -0.1, "VLMEagleConfig.draft_confidence_threshold"),
    (VLMEagleConfig, "tree", {"depth": 3}, "VLMEagleConfig.tree must be a TreeConfig or None"),
    (FlashConfig, "tree", TREE, "FlashConfig.tree must be None: this method drafts chains only"),
])
def test_configs_refuse_out_of_range_values_naming_the_field(config_class, field, value, match):
    with pytest.raises(ValueError, match=match):
        config_class(**{field: value})


def test_a_tree_and_a_confidence_threshold_exclude_each_other():
    assert ViSpecConfig(tree=TREE).tree == TREE and ViSpecConfig(draft_confidence_threshold=0.5).tree is None
    with pytest.raises(ValueError, match=r"ViSpecConfig.draft_confidence_threshold .* dynamic already"):
        ViSpecConfig(tree=TREE, draft_confidence_threshold=0.5)


def test_configs_round_trip_through_plain_values_and_refuse_unknown_fields():
    config = DraftVLMConfig(num_draft_tokens=5, tree=TREE)
    assert config.to_dict() == {"num_draft_tokens": 5, "tree": {"depth": 3, "top_k": 2, "total_tokens": 6, "adaptive": None},
                                "draft_confidence_threshold": 0.0}
    assert DraftVLMConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config  # the tree from JSON
    with pytest.raises(ValueError, match="VLMEagleConfig has no field 'lantern_k'"):
        VLMEagleConfig.from_dict({"lantern_k": 5})
    with pytest.raises(ValueError, match=r"FlashConfig has no field 'k' in .* \(flash\)"):
        SpeculationSettings.from_dict("vlm", {"flash": {"settings": {"k": 5}}})
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculationSettings.from_dict("vlm", {"vispec": {"settings": {"num_draft_tokens": 0}}})


# -- the zoo's stored settings --------------------------------------------------------------------------------------
def test_the_zoo_stores_what_its_builder_writes(pipe):
    stored = json.loads((zoo_dir() / "shapes-vlm" / "speculation_config.json").read_text())
    assert stored == SPECULATION_SETTINGS == pipe.speculation_settings.to_dict()
    for do_sample in (False, True):  # batch 1 has its own chain lengths (measured on an idle machine)
        request = {"do_sample": do_sample, "batch_size": 1}
        assert pipe.method_config("flash", **request) == FlashConfig(num_draft_tokens=15)
        assert pipe.method_config("draft_vlm", **request) == DraftVLMConfig(num_draft_tokens=10,
                                                                              draft_confidence_threshold=0.5)
        request = {"do_sample": do_sample, "batch_size": 4}
        assert pipe.method_config("flash", **request) == FlashConfig(num_draft_tokens=10)
        assert pipe.method_config("draft_vlm", **request) == DraftVLMConfig(num_draft_tokens=8)
    assert pipe.method_config("none") is None


def _recipe_settings_at_batch_1(name: str) -> dict:
    """The recipe's settings of ``name`` for one prompt per call: its base settings updated by the variants
    whose condition names batch size 1 (the zoo VLM's variants depend on the batch size alone)."""
    entry = SPECULATION_SETTINGS[name]
    settings = dict(entry["settings"])
    for variant in entry.get("variants", []):
        if variant["when"].get("batch_size") == 1:
            settings.update(variant["settings"])
    return settings


@pytest.mark.parametrize("seed", [None, 3], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_plain_method_call_runs_the_stored_settings(pipe, example, name, seed):
    """``method=name`` equals the stored config given explicitly (same tokens, same rounds), and that config
    is not the class's default (K = 6), which drafts in other rounds."""
    stored = CONFIGS[name](**_recipe_settings_at_batch_1(name))
    plain, explicit = _run(pipe, example, name, seed), _run(pipe, example, stored, seed)
    assert [t.tolist() for t in plain.tokens] == [t.tolist() for t in explicit.tokens]
    assert plain.stats.target_calls == explicit.stats.target_calls
    assert plain.stats.draft_calls == explicit.stats.draft_calls
    assert plain.stats.position_attempts == explicit.stats.position_attempts
    default = _run(pipe, example, CONFIGS[name](), seed)
    assert default.stats.position_attempts != plain.stats.position_attempts  # chains of 6, not of the stored K


def test_stream_and_the_context_check_take_a_config(pipe, example):
    config = pipe.method_config("flash").replace(num_draft_tokens=5)
    *chunks, final = pipe.stream(example["frames"][0], example["prompt"], config, max_new_tokens=24)
    assert final.text == pipe(example["frames"][0], example["prompt"], "none", max_new_tokens=24).text
    assert sum(sum(chunk.drafted) for chunk in chunks) == int(final.drafted[0].sum()) > 0
    assert pipe.position_limits(config) == {"target": LIMIT, "flash_head": LIMIT}
    assert pipe.position_limits("draft_vlm") == {"target": LIMIT, "draft_model": LIMIT}


# -- a method registered from outside -----------------------------------------------------------------------------
def test_a_method_registered_from_outside_runs_losslessly(pipe, example):
    """The toy method of tests/pipeline_utils.py: listed, run by name (its class defaults: nothing is stored
    for it) and as a config, greedy output equal to target-only; it declares no draft component, so only
    the target bounds the context."""
    baseline = _run(pipe, example, "none")
    with copy_pending_method() as config_class:
        assert "copy_pending" in pipe.methods() and pipe.method_config("copy_pending") == config_class()
        assert pipe.position_limits("copy_pending") == {"target": LIMIT} and draft_component("copy_pending") is None
        for method in ("copy_pending", config_class(num_tokens=5)):
            out = _run(pipe, example, method)
            assert [t.tolist() for t in out.tokens] == [t.tolist() for t in baseline.tokens]
            assert sum(out.stats.position_attempts) > 0 and out.draft_visual_tokens is None  # drafts were verified
    assert "copy_pending" not in pipe.methods()


# -- refusals -------------------------------------------------------------------------------------------------------
def test_bad_methods_are_refused_naming_what_to_pass(pipe, example):
    image, prompt = example["frames"][0], example["prompt"]
    with pytest.raises(ValueError, match="VLMEagleConfig has no field 'window'; its fields are num_draft_tokens"):
        pipe.method_config("eagle").replace(window=3)
    with pytest.raises(ValueError, match=r"SpecVLMConfig.num_draft_tokens must be an integer in \[1, 1024\], got 0"):
        pipe.method_config("specvlm").replace(num_draft_tokens=0)
    with pytest.raises(ValueError, match=r"EagleConfig configures a method of ar_image pipelines, not of this one "
                                         r"\(vlm\)"):
        pipe(image, prompt, EagleConfig())
    for name in ("lantern", "cspd", "medusa"):  # AR image, continuous, unknown
        with pytest.raises(ValueError, match=f"method='{name}' is not a method of VLMPipeline.*'flash'"):
            pipe(image, prompt, name)
    with pytest.raises(ValueError, match="method must be a method name or a MethodConfig, got int"):
        pipe(image, prompt, 5)
    bare = VLMPipeline(pipe.target, pipe.processor)
    with pytest.raises(ValueError, match="method='vispec' needs a vispec_head; this pipeline has none"):
        bare(image, prompt, "vispec")


def test_removed_keywords_name_the_config_field(pipe, example):
    image, prompt = example["frames"][0], example["prompt"]
    with pytest.raises(TypeError, match=r"no longer takes num_draft_tokens.*num_draft_tokens -> "
                                        r"VLMEagleConfig.num_draft_tokens / FlashConfig.num_draft_tokens.*"
                                        r"method=pipe.method_config\('flash', \.\.\.\)\.replace\(num_draft_tokens"):
        pipe(image, prompt, "flash", num_draft_tokens=4)
    with pytest.raises(TypeError, match=r"no longer takes tree, draft_confidence_threshold.*"
                                        r"method=<your ViSpecConfig>\.replace\(tree=\.\.\., "
                                        r"draft_confidence_threshold=\.\.\.\)"):
        pipe(image, prompt, ViSpecConfig(), tree=TREE, draft_confidence_threshold=0.5)
    with pytest.raises(TypeError, match=r"draft_confidence_threshold -> VLMEagleConfig.*method=VLMEagleConfig\("):
        pipe(image, prompt, "none", draft_confidence_threshold=0.5)  # target-only: EAGLE's config suggested
    with pytest.raises(TypeError, match="unexpected keyword argument 'guidance_scale'"):
        pipe(image, prompt, "eagle", guidance_scale=3.0)
    with pytest.raises(TypeError, match="no longer takes num_draft_tokens"):
        list(pipe.stream(image, prompt, "eagle", num_draft_tokens=4))


# -- settings files -------------------------------------------------------------------------------------------------
def test_stored_settings_travel_with_the_folder(pipe, example, tmp_path):
    """save_pretrained writes ``speculation_config.json``, from_pretrained reads it (``speculation_settings=``
    replaces it); variants by decoding mode and batch resolve per call."""
    stored = {"eagle": {"settings": {"num_draft_tokens": 4},
                        "variants": [{"when": {"greedy": False}, "settings": {"draft_confidence_threshold": 0.5}},
                                     {"when": {"min_batch_size": 2}, "settings": {"num_draft_tokens": 2}}]},
              "vispec": {"settings": {"tree": {"depth": 4, "top_k": 2, "total_tokens": 8}}}}
    source = VLMPipeline(**pipe.components)
    source.set_speculation_settings(stored)
    source.save_pretrained(tmp_path / "p")
    assert json.loads((tmp_path / "p" / "speculation_config.json").read_text()) == stored
    loaded = quiet_pipeline(VLMPipeline, tmp_path / "p")
    assert loaded.speculation_settings.to_dict() == stored
    assert loaded.method_config("eagle") == VLMEagleConfig(num_draft_tokens=4)
    assert loaded.method_config("eagle", do_sample=True) == VLMEagleConfig(num_draft_tokens=4,
                                                                          draft_confidence_threshold=0.5)
    assert loaded.method_config("eagle", batch_size=2).num_draft_tokens == 2
    assert loaded.method_config("vispec") == ViSpecConfig(tree=TreeConfig(depth=4, top_k=2, total_tokens=8))
    assert loaded.method_config("flash") == FlashConfig()  # nothing stored: the class defaults
    request = BuildRequest(SamplingConfig(do_sample=False))
    assert loaded.resolve_method("vispec", request) == loaded.method_config("vispec")
    assert _run(loaded, example, "vispec").stats.position_attempts == \
        _run(loaded, example, ViSpecConfig(tree=TreeConfig(depth=4, top_k=2, total_tokens=8))).stats.position_attempts
    replaced = VLMPipeline.from_pretrained(tmp_path / "p", speculation_settings={"flash": {"settings": {
        "num_draft_tokens": 3}}})
    assert replaced.method_config("flash") == FlashConfig(num_draft_tokens=3)
    assert replaced.method_config("eagle") == VLMEagleConfig()
    (tmp_path / "p" / "speculation_config.json").write_text(json.dumps({"flash": {"settings": {"tree": {
        "depth": 2, "top_k": 2, "total_tokens": 4}}}}))
    with pytest.raises(ValueError, match="FlashConfig.tree must be None"):
        VLMPipeline.from_pretrained(tmp_path / "p")


def test_the_demo_tab_starts_from_the_stored_settings(pipe):
    """The VLM tab's knobs replace fields of the stored config; an empty K keeps the stored one."""
    from mmspec.demos.common import DemoError
    from mmspec.demos.vlm_tab import method_config

    assert method_config(pipe, "flash", greedy=True) == FlashConfig(num_draft_tokens=15)  # one prompt per call
    assert method_config(pipe, "flash", greedy=False, num_draft_tokens="") == FlashConfig(num_draft_tokens=15)
    assert method_config(pipe, "draft_vlm", greedy=True, num_draft_tokens=4) == \
        DraftVLMConfig(num_draft_tokens=4, draft_confidence_threshold=0.5)  # the stored cut-off stays
    tree = method_config(pipe, "vispec", greedy=True, use_tree=True, tree_depth=4, tree_top_k=2, tree_total_tokens=8)
    assert tree == ViSpecConfig(num_draft_tokens=10, tree=TreeConfig(depth=4, top_k=2, total_tokens=8))
    with pytest.raises(DemoError, match="flash drafts chains only"):
        method_config(pipe, "flash", greedy=True, use_tree=True)
    with pytest.raises(DemoError, match="K"):
        method_config(pipe, "eagle", greedy=True, num_draft_tokens=0)
