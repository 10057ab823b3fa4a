"""CSpD as a configured, registered method of ContinuousARImagePipeline: ``method="cspd"`` runs the settings
stored with the checkpoint (the same latents as the explicit config), bad settings name the field, removed
call keywords name the config field, settings survive save/load, and a method registered from outside runs
its own loop."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from test_continuous_pipeline import make_pipe, run, tiny_mar

from mmspec import methods
from mmspec.methods import MethodConfig, MethodPlan, SpeculationSettings
from mmspec.methods.cspd import CSpDConfig
from mmspec.methods.eagle import EagleConfig
from mmspec.pipelines import ContinuousARImagePipeline
from mmspec.pipelines.hub import zoo_dir
from mmspec.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: stored settings that differ from CSpDConfig's defaults in every field the loop reads
STORED = {"draft_length": 2, "prefill_ratio": 0.4, "verify_order": "chain", "verify_context": "exact",
          "density_temperature": 30.0, "max_tries": 8}


@pytest.fixture
def pipe() -> ContinuousARImagePipeline:
    pipe = make_pipe(tiny_mar(7, depth=1, width=16))
    pipe.set_speculation_settings({"cspd": {"settings": STORED}})
    return pipe


def test_cspd_is_registered_for_continuous_pipelines_only(pipe):
    assert methods.get("cspd", "continuous") is CSpDConfig and CSpDConfig.name == "cspd"
    assert pipe.methods() == ["none", *methods.available("continuous")] and "cspd" in pipe.methods()
    assert "cspd" not in methods.available("ar_image")
    assert "eagle" not in pipe.methods()


def test_plain_method_name_runs_the_stored_settings(pipe):
    stored = CSpDConfig(**STORED)
    assert pipe.method_config("cspd") == stored and pipe.method_config("cspd", batch_size=8) == stored
    by_name = run(pipe, "cspd", seed=3)
    explicit = run(pipe, stored, seed=3)
    assert torch.equal(by_name.tokens, explicit.tokens) and torch.equal(by_name.drafted, explicit.drafted)
    assert by_name.stats.target_calls == explicit.stats.target_calls
    # and the stored settings matter: the class defaults run differently (so the equality above can fail)
    defaults = run(pipe, CSpDConfig(), seed=3)
    assert defaults.stats.prefill_tokens != by_name.stats.prefill_tokens
    assert not torch.equal(defaults.tokens, by_name.tokens)


def test_without_stored_settings_a_name_runs_the_class_defaults():
    pipe = make_pipe(tiny_mar(7, depth=1, width=16))
    assert pipe.method_config("cspd") == CSpDConfig()
    assert torch.equal(run(pipe, "cspd", seed=1).tokens, run(pipe, CSpDConfig(), seed=1).tokens)


def test_replace_keeps_the_other_stored_fields(pipe):
    changed = pipe.method_config("cspd").replace(draft_length=4)
    assert changed == CSpDConfig(**{**STORED, "draft_length": 4})
    out = run(pipe, changed)
    assert out.stats.drafted_tokens > 0 and torch.isfinite(out.tokens).all()


@pytest.mark.parametrize("field, value, match", [
    ("draft_length", 0, r"CSpDConfig.draft_length must be an integer in \[1, 1024\], got 0"),
    ("draft_length", 2.5, "CSpDConfig.draft_length"),
    ("draft_length", True, "CSpDConfig.draft_length"),
    ("prefill_ratio", 1.0, r"CSpDConfig.prefill_ratio must be a number in \[0.0, 1.0\)"),
    ("prefill_ratio", math.nan, "CSpDConfig.prefill_ratio"),
    ("verify_order", "tree", r"CSpDConfig.verify_order must be one of \['independent', 'chain', 'iteration'\]"),
    ("verify_context", "all", r"CSpDConfig.verify_context must be one of \['round', 'exact'\]"),
    ("density_temperature", 0.0, r"CSpDConfig.density_temperature must be a number in \[0.01, 1000.0\]"),
    ("density_temperature", math.inf, "CSpDConfig.density_temperature must be a finite number"),
    ("max_tries", 0, r"CSpDConfig.max_tries must be an integer in \[1, 100000\]"),
])
def test_out_of_range_settings_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        CSpDConfig(**{field: value})


def test_bad_configs_and_methods_name_what_is_wrong(pipe):
    with pytest.raises(ValueError, match="CSpDConfig has no field 'gamma'"):
        CSpDConfig.from_dict({"gamma": 3})
    with pytest.raises(ValueError, match="CSpDConfig has no field 'gamma'"):
        pipe.method_config("cspd").replace(gamma=3)
    with pytest.raises(ValueError, match="EagleConfig configures a method of ar_image pipelines, not of this one "
                                         r"\(continuous\)"):
        run(pipe, EagleConfig())
    with pytest.raises(ValueError, match="method='eagle' is not a method of ContinuousARImagePipeline"):
        run(pipe, "eagle")
    with pytest.raises(ValueError, match="method must be a method name or a MethodConfig"):
        run(pipe, 3)
    with pytest.raises(ValueError, match=r"CSpDConfig.draft_length must be an integer"):  # a bad stored value
        pipe.set_speculation_settings({"cspd": {"settings": {"draft_length": 0}}})
    with pytest.raises(ValueError, match="CSpDConfig has no field 'draft'"):
        pipe.set_speculation_settings({"cspd": {"settings": {"draft": 2}}})
    no_draft = make_pipe(None)
    with pytest.raises(ValueError, match="method 'cspd' needs a draft_transformer"):
        run(no_draft, "cspd")


@pytest.mark.parametrize("keyword, field", [
    ("draft_length", "draft_length"), ("prefill_ratio", "prefill_ratio"), ("verify_order", "verify_order"),
    ("verify_context", "verify_context"), ("density_temperature", "density_temperature"), ("max_tries", "max_tries"),
])
def test_removed_call_keywords_name_the_config_field(pipe, keyword, field):
    with pytest.raises(TypeError, match=rf"no longer takes {keyword}: .*{keyword} -> CSpDConfig\.{field}.*"
                                        rf"method_config\('cspd', \.\.\.\)\.replace\({field}=\.\.\.\)"):
        run(pipe, "cspd", **{keyword: 1})
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'gamma'"):
        run(pipe, "cspd", gamma=3)


def test_save_and_load_keep_the_settings(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "pipe")
    saved = json.loads((tmp_path / "pipe" / methods.SETTINGS_FILE).read_text())
    assert saved == {"cspd": {"settings": STORED}}
    loaded = ContinuousARImagePipeline.from_pretrained(tmp_path / "pipe", torch_dtype=torch.float64)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.method_config("cspd") == CSpDConfig(**STORED)
    assert torch.equal(run(loaded, "cspd", seed=2).tokens, run(pipe, "cspd", seed=2).tokens)
    replaced = ContinuousARImagePipeline.from_pretrained(tmp_path / "pipe", speculation_settings={
        "cspd": {"settings": {"draft_length": 5}}})
    assert replaced.method_config("cspd") == CSpDConfig(draft_length=5)
    bare = make_pipe(tiny_mar(7, depth=1, width=16))
    bare.save_pretrained(tmp_path / "bare")  # nothing stored: no file, the class defaults
    assert not (tmp_path / "bare" / methods.SETTINGS_FILE).exists()
    assert ContinuousARImagePipeline.from_pretrained(tmp_path / "bare").method_config("cspd") == CSpDConfig()


def test_the_zoo_stores_the_benchmarks_settings():
    from mmspec.models.recipes.report_mar import SPECULATION_SETTINGS

    folder = zoo_dir() / "shapes-t2i-continuous"
    assert json.loads((folder / methods.SETTINGS_FILE).read_text()) == SPECULATION_SETTINGS
    stored = SpeculationSettings.load("continuous", folder)
    config = stored.config_for("cspd", methods.BuildRequest(SamplingConfig(), batch_size=32))
    assert config == CSpDConfig(draft_length=3, prefill_ratio=0.25)  # the quality-keeping row of the benchmark
    assert config.draft_length != 8  # not the official code's gamma, which costs quality on the zoo


# -- a method registered from outside the package runs its own loop ------------------------------------------------


@dataclass(frozen=True)
class TargetLoopConfig(MethodConfig):
    """A toy continuous method: its loop runs the target's MAR iterations through the state's interface."""

    pipelines: ClassVar[tuple[str, ...]] = ("continuous",)

    def build(self, pipeline: Any, request: Any) -> MethodPlan:
        def loop(target: Any, drafter: Any, state: Any) -> None:
            state.target_iterations(target, until=state.seq_len)
        return MethodPlan(loop=loop)


@dataclass(frozen=True)
class DrafterWithoutLoopConfig(MethodConfig):
    pipelines: ClassVar[tuple[str, ...]] = ("continuous",)

    def build(self, pipeline: Any, request: Any) -> MethodPlan:
        return MethodPlan(drafter=pipeline.draft_transformer)


def test_a_method_registered_from_outside_runs_its_loop(pipe):
    methods.register("toy_target_loop", TargetLoopConfig)
    try:
        assert "toy_target_loop" in pipe.methods()
        out = run(pipe, "toy_target_loop", seed=4)
        assert torch.equal(out.tokens, run(pipe, "none", seed=4).tokens)  # the target's own iterations
        assert out.stats.target_calls == 8 and not out.drafted.any()
    finally:
        methods.unregister("toy_target_loop")
    with pytest.raises(ValueError, match="must give its own loop"):
        run(pipe, DrafterWithoutLoopConfig())


def test_the_demo_page_runs_the_stored_settings_with_its_knobs_over_them(pipe):
    from mmspec.demos import continuous_tab
    from mmspec.demos.common import STORED as PAGE_STORED
    from mmspec.demos.common import DemoError

    page = continuous_tab.method_config
    assert page(pipe, batch_size=2, guidance_scale=1.0) == CSpDConfig(**STORED)
    assert page(pipe, batch_size=2, guidance_scale=1.0, draft_length=" ", verify_order=PAGE_STORED,
                verify_context=None) == CSpDConfig(**STORED)  # empty knobs keep the stored values
    assert page(pipe, batch_size=2, guidance_scale=1.0, draft_length="4", verify_order="independent") == \
        CSpDConfig(**{**STORED, "draft_length": 4, "verify_order": "independent"})
    with pytest.raises(DemoError, match=r"CSpD gamma .* must be an integer in \[1, 64\], got '0'"):
        page(pipe, batch_size=2, guidance_scale=1.0, draft_length="0")
    with pytest.raises(DemoError, match="target context must be one of"):
        page(pipe, batch_size=2, guidance_scale=1.0, verify_context="future")


def test_the_benchmark_resolves_settings_as_a_users_call(pipe):
    from mmspec.evaluation import bench_continuous as bench

    shared = {"num_iter": 8}
    assert bench.call_kwargs(pipe, "cspd", {"method": "cspd"}, shared, 8) == {"num_iter": 8, "method": "cspd"}
    reference = bench.call_kwargs(pipe, "cspd (reference)", {"method": "cspd", "reference": True}, shared, 8)
    assert reference["method"] == bench.REFERENCE_CONFIG == CSpDConfig(draft_length=8, prefill_ratio=0.05)
    over_stored = bench.call_kwargs(pipe, "x", {"method": "cspd", "draft_length": 4, "num_iter": 16, "batches": [8]},
                                    shared, 8)
    assert over_stored == {"num_iter": 16, "method": CSpDConfig(**{**STORED, "draft_length": 4})}
    with pytest.raises(SystemExit, match="sets 'gamma', which is neither a field of CSpDConfig"):
        bench.call_kwargs(pipe, "x", {"method": "cspd", "gamma": 4}, shared, 8)
    with pytest.raises(SystemExit, match="CSpDConfig.draft_length"):
        bench.call_kwargs(pipe, "x", {"method": "cspd", "draft_length": 0}, shared, 8)
    with pytest.raises(SystemExit, match="target-only decoding, which has no settings"):
        bench.call_kwargs(pipe, "x", {"method": "none", "draft_length": 4}, shared, 8)
