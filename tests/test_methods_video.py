"""The video family's methods as configs: ``method="sdvg"`` / ``"draft"`` run the checkpoint's stored settings
(exactly what the explicit config runs), bad configs and removed keywords name the field, the settings survive
save/load, a callable reward works in a config but never in a settings file, and a method registered from
outside runs in the same block loop."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from test_video_pipeline import tiny

from mmspec import methods
from mmspec.methods import BuildRequest, MethodConfig, MethodPlan, SpeculationSettings
from mmspec.methods.eagle import EagleConfig
from mmspec.methods.sdvg import DraftConfig, SDVGConfig
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import load_zoo_tokenizer
from mmspec.pipelines.ar_video import ARVideoPipeline
from mmspec.video_blocks import VideoDrafter
from mmspec.world import make_video_prompt_set, vocabulary

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["a red circle moving right", "a blue square moving up"]
#: settings unlike SDVGConfig's defaults in every routing field (the mean of the match reward, 2 drafter steps,
#: rejected drafts refined from 750), so a call that ignored them would differ
STORED = {"sdvg": {"settings": {"tau": 0.3, "reward": "shapes", "reward_kwargs": {"mode": "match"},
                                "aggregate": "mean", "draft_num_inference_steps": 2, "refine_rejected_from": 750.0,
                                "lazy_target_cache": False}},
          "draft": {"settings": {"draft_num_inference_steps": 1, "draft_guidance_scale": 2.0}}}


@pytest.fixture(scope="module")
def pipe() -> ARVideoPipeline:
    p = ARVideoPipeline(tiny(2, 0), load_zoo_tokenizer("continuous"), tiny(1, 1, dim=16), WordTokenizer(vocabulary()))
    p.set_progress_bar_config(disable=True)
    p.set_speculation_settings(STORED)
    return p


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_video_methods_are_registered_for_the_video_family(pipe):
    assert methods.get("sdvg", "video") is SDVGConfig and methods.get("draft", "video") is DraftConfig
    assert pipe.methods() == ["none", "draft", "sdvg"]
    assert SDVGConfig.pipelines == DraftConfig.pipelines == ("video",)
    with pytest.raises(ValueError, match="method='sdvg' does not run in ar_image pipelines"):
        methods.get("sdvg", "ar_image")


def test_a_plain_method_name_runs_the_stored_settings_exactly(pipe):
    stored = SDVGConfig(**STORED["sdvg"]["settings"])
    assert pipe.method_config("sdvg") == stored and pipe.method_config("draft") == DraftConfig(1, 2.0)
    by_name = pipe(PROMPTS, "sdvg", generator=gen(), output_type="pt")
    explicit = pipe(PROMPTS, stored, generator=gen(), output_type="pt")
    assert torch.equal(by_name.frames, explicit.frames) and torch.equal(by_name.latents, explicit.latents)
    assert by_name.stats.source == explicit.stats.source
    assert by_name.stats.draft_calls == 1 + 2 * 3  # the stored 2 drafter steps per drafted block (block 0 forced)
    defaults = pipe(PROMPTS, SDVGConfig(), generator=gen(), output_type="pt")
    assert defaults.stats.draft_calls == 1 + 4 * 3 and not torch.equal(defaults.latents, by_name.latents)
    draft = pipe(PROMPTS, "draft", generator=gen(), output_type="latent")
    assert torch.equal(draft.latents, pipe(PROMPTS, DraftConfig(1, 2.0), generator=gen(), output_type="latent").latents)
    assert draft.stats.draft_calls == 1 + 1 * 4 and draft.stats.target_calls == 0


@pytest.mark.parametrize("config_class, field, value, match", [
    (SDVGConfig, "tau", math.nan, r"SDVGConfig.tau must be a number or \+-inf, got NaN"),
    (SDVGConfig, "tau", "high", "SDVGConfig.tau must be a number"),
    (SDVGConfig, "reward", "vision", r"SDVGConfig.reward must be one of \['shapes', 'imagereward', 'clip'\]"),
    (SDVGConfig, "reward_kwargs", ["mode"], "SDVGConfig.reward_kwargs must be None or a mapping"),
    (SDVGConfig, "aggregate", "max", r"SDVGConfig.aggregate must be one of \['min', 'mean'\]"),
    (SDVGConfig, "force_reject_first", "yes", "SDVGConfig.force_reject_first must be True or False"),
    (SDVGConfig, "refine_rejected_from", 0, r"SDVGConfig.refine_rejected_from must be a number in \(0.0, 1000.0\]"),
    (SDVGConfig, "refine_rejected_from", 1500.0, "SDVGConfig.refine_rejected_from"),
    (SDVGConfig, "lazy_target_cache", 1, "SDVGConfig.lazy_target_cache must be True or False"),
    (SDVGConfig, "draft_num_inference_steps", 0, "SDVGConfig.draft_num_inference_steps must be an integer"),
    (DraftConfig, "draft_num_inference_steps", 2.0, "DraftConfig.draft_num_inference_steps must be an integer"),
    (DraftConfig, "draft_guidance_scale", math.inf, "DraftConfig.draft_guidance_scale must be a number"),
])
def test_configs_refuse_out_of_range_values_naming_the_field(config_class, field, value, match):
    with pytest.raises(ValueError, match=match):
        config_class(**{field: value})


def test_bad_methods_and_keywords_raise_naming_the_field(pipe):
    with pytest.raises(ValueError, match="SDVGConfig has no field 'threshold'"):
        SDVGConfig.from_dict({"threshold": 0.5})
    with pytest.raises(ValueError, match="SDVGConfig has no field 'k'"):
        pipe.method_config("sdvg").replace(k=4)
    with pytest.raises(ValueError, match="reward_kwargs .* only apply to named rewards"):
        SDVGConfig(reward=lambda frames, prompt: [1.0] * len(frames), reward_kwargs={"mode": "match"})
    with pytest.raises(ValueError, match="EagleConfig configures a method of ar_image pipelines, not of this one"):
        pipe(PROMPTS, EagleConfig())
    with pytest.raises(ValueError, match="method='eagle' is not a method of ARVideoPipeline"):
        pipe(PROMPTS, "eagle")
    # removed keywords name the field of the call's method
    with pytest.raises(TypeError, match=r"no longer takes tau.*SDVGConfig\.tau.*method_config\('sdvg'"):
        pipe(PROMPTS, "sdvg", tau=0.5)
    with pytest.raises(TypeError, match=r"draft_guidance_scale -> SDVGConfig.draft_guidance_scale / "
                                        r"DraftConfig.draft_guidance_scale.*method_config\('draft'"):
        pipe(PROMPTS, "draft", draft_guidance_scale=3.0)
    with pytest.raises(TypeError, match=r"<your SDVGConfig>.replace\(refine_rejected_from=...\)"):
        pipe(PROMPTS, SDVGConfig(), refine_rejected_from=750)
    with pytest.raises(TypeError, match="no longer takes callback_on_block_end: it is callback_on_step_end"):
        pipe(PROMPTS, "none", callback_on_block_end=lambda p, n, state: None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temperature'"):
        pipe(PROMPTS, "none", temperature=1.0)
    with pytest.raises(ValueError, match="callback_on_step_end must be callable"):
        pipe(PROMPTS, "none", callback_on_step_end="print")
    # a stored timestep that the call's schedule lacks names the field and how to change it
    with pytest.raises(ValueError, match=r"refine_rejected_from must be None or one of the target's timesteps .*"
                                         r"replace\(refine_rejected_from=\.\.\.\)"):
        pipe(PROMPTS, "sdvg", num_inference_steps=2)
    lone = ARVideoPipeline(pipe.transformer, pipe.vae, None, pipe.text_tokenizer)
    for name in ("sdvg", "draft"):
        with pytest.raises(ValueError, match=f"method='{name}' needs a drafter; this pipeline has none"):
            lone(PROMPTS, name)


def test_callback_on_step_end_is_called_after_every_block(pipe):
    """diffusers' convention: fn(pipeline, step, timestep, callback_kwargs) -> dict; a step is a block."""
    seen = []

    def callback(p, n, timestep, state):
        seen.append((p, n, timestep, state["latents"].shape[1], state["accepted"].tolist()))
        return state

    out = pipe(PROMPTS, "sdvg", generator=gen(), output_type="latent", callback_on_step_end=callback)
    assert [(p, n, t, frames) for p, n, t, frames, _ in seen] == [(pipe, n, n, 2 * (n + 1)) for n in range(4)]
    assert [accepted for *_, accepted in seen] == out.stats.accepted.T.tolist()
    keys = []
    pipe(PROMPTS, "none", generator=gen(), output_type="latent", callback_on_step_end_tensor_inputs=["accepted"],
         callback_on_step_end=lambda p, n, t, state: keys.append(sorted(state)) or state)
    assert keys and all(k == ["accepted"] for k in keys)
    frames, latents, stats = pipe(PROMPTS, "sdvg", generator=gen(), output_type="latent", return_dict=False)
    assert frames is None and torch.equal(latents, out.latents) and stats.source == out.stats.source


def test_save_and_load_keep_the_stored_settings(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "pipe")
    stored = json.loads((tmp_path / "pipe" / "speculation_config.json").read_text())
    assert stored == STORED
    loaded = ARVideoPipeline.from_pretrained(tmp_path / "pipe", torch_dtype=torch.float64)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.method_config("sdvg") == pipe.method_config("sdvg")
    assert loaded.method_config("draft") == pipe.method_config("draft")
    again = loaded(PROMPTS, "sdvg", generator=gen(), output_type="latent")
    first = pipe(PROMPTS, "sdvg", generator=gen(), output_type="latent")
    assert again.stats.source == first.stats.source and again.stats.draft_calls == first.stats.draft_calls
    # speculation_settings= replaces the folder's; a folder without the file runs the class defaults
    other = ARVideoPipeline.from_pretrained(tmp_path / "pipe", speculation_settings={"sdvg": {"settings": {"tau": 1}}})
    assert other.method_config("sdvg") == SDVGConfig(tau=1)
    (tmp_path / "pipe" / "speculation_config.json").unlink()
    assert ARVideoPipeline.from_pretrained(tmp_path / "pipe").method_config("sdvg") == SDVGConfig()
    (tmp_path / "pipe" / "speculation_config.json").write_text(json.dumps({"sdvg": {"settings": {"taus": 1}}}))
    with pytest.raises(ValueError, match="SDVGConfig has no field 'taus' in .*speculation_config.json"):
        ARVideoPipeline.from_pretrained(tmp_path / "pipe")


def test_a_callable_reward_works_in_a_config_but_not_in_a_settings_file(pipe):
    calls = []

    def first_frame_bright(frames, prompt):  # frame scores: 1 for every frame, the prompt recorded
        calls.append(prompt)
        return [1.0] * frames.shape[0]

    config = pipe.method_config("sdvg").replace(reward=first_frame_bright, reward_kwargs=None, tau=0.5)
    out = pipe(PROMPTS, config, generator=gen(), output_type="latent")
    assert out.stats.source == [["target", "draft", "draft", "draft"]] * 2  # every routed draft scores 1 >= 0.5
    assert calls == PROMPTS * 3 and out.stats.reward_calls == 6
    with pytest.raises(ValueError, match="SDVGConfig.reward is a callable .*first_frame_bright.*cannot store"):
        config.to_dict()
    with pytest.raises(ValueError, match="SDVGConfig.reward .* must be a reward name"):
        pipe.set_speculation_settings({"sdvg": {"settings": {"reward": first_frame_bright}}})
    with pytest.raises(ValueError, match="SDVGConfig.reward .* must be a reward name"):
        SpeculationSettings.from_dict("video", {"sdvg": {"settings": {"reward": 3}}})
    named = SDVGConfig(tau=-math.inf, reward="shapes", reward_kwargs={"mode": "match"})
    assert SDVGConfig.from_dict(json.loads(json.dumps(named.to_dict()))) == named  # -inf survives JSON


def test_demo_knobs_replace_the_stored_settings_and_empty_keeps_them(pipe):
    from mmspec.demos import video_tab

    stored = pipe.method_config("sdvg")
    empty = dict(tau="", reward=video_tab.STORED, reward_weights="", aggregate=video_tab.STORED,
                 force_reject_first=video_tab.STORED, refine_rejected_from=" ")
    assert video_tab.sdvg_config(pipe, batch_size=1, guidance_scale=3.0, steps=4, **empty) == stored
    assert video_tab.sdvg_config(pipe, batch_size=1, guidance_scale=3.0, steps=4) == stored  # None: stored too
    knobs = video_tab.sdvg_config(pipe, batch_size=1, guidance_scale=3.0, steps=4, tau="inf", reward="shapes",
                                  aggregate="min", force_reject_first="no", refine_rejected_from=0)
    assert knobs == stored.replace(tau=math.inf, aggregate="min", force_reject_first=False, refine_rejected_from=None)
    assert knobs.reward_kwargs == {"mode": "match"}  # the stored reward chosen again keeps its stored settings


@dataclass(frozen=True)
class OneStepDraftConfig(MethodConfig):
    """A toy outside video method: the drafter in one step, every block its own (built by hand)."""

    pipelines: ClassVar[tuple[str, ...]] = ("video",)

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        return MethodPlan(drafter=VideoDrafter(pipeline.drafter, num_inference_steps=1))


def test_a_method_registered_from_outside_runs_in_the_block_loop(pipe):
    methods.register("one_step_draft", OneStepDraftConfig)
    try:
        assert "one_step_draft" in pipe.methods()
        out = pipe(PROMPTS, "one_step_draft", generator=gen(), output_type="latent")
    finally:
        methods.unregister("one_step_draft")
    expected = pipe(PROMPTS, DraftConfig(draft_num_inference_steps=1, draft_guidance_scale=1.0), generator=gen(),
                    output_type="latent")
    assert torch.equal(out.latents, expected.latents) and out.stats.draft_calls == 1 + 4


def _zoo_built() -> bool:
    from mmspec.pipelines.hub import zoo_dir

    return (zoo_dir() / "shapes-video" / "speculation_config.json").is_file()


@pytest.mark.skipif(not _zoo_built(), reason="mmspec/shapes-video is not built yet (see docs/pipeline_video.md)")
def test_zoo_stores_the_builders_settings_and_a_plain_call_runs_them():
    from mmspec.models.recipes.report_video import SPECULATION_SETTINGS

    pipe = ARVideoPipeline.from_pretrained("mmspec/shapes-video")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.speculation_settings.to_dict() == SPECULATION_SETTINGS
    stored = pipe.method_config("sdvg")
    assert (stored.tau, stored.reward, stored.reward_kwargs, stored.refine_rejected_from) == (
        0.1, "shapes", {"mode": "match"}, 750.0)
    prompt = make_video_prompt_set(1)[0].text
    plain = pipe(prompt, "sdvg", num_blocks=3, guidance_scale=3.0, generator=gen(), output_type="np")
    explicit = pipe(prompt, SDVGConfig(**SPECULATION_SETTINGS["sdvg"]["settings"]), num_blocks=3, guidance_scale=3.0,
                    generator=gen(), output_type="np")
    assert (plain.frames == explicit.frames).all() and plain.stats.source == explicit.stats.source
    assert plain.stats.draft_calls == 1 + 2  # the reflow drafter: one step per drafted block
