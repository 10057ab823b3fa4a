"""A probe of careless and hostile inputs against every public entry point.

Each case calls a public function or pipeline with one bad argument and requires a clear refusal:
a ``ValueError`` or ``TypeError`` raised by mmspec's own code (not from deep inside torch, diffusers or
transformers) whose message names the argument at fault. The pipelines are the bundled zoo entries, so
the inputs reach the real checks; every case is refused before any model forward, which keeps the probe
fast.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pipeline_utils import quiet_pipeline

import mmspec
from mmspec import ExactRule, SamplingConfig, sample, verify_tokens
from mmspec.pipelines import ARImagePipeline, ARVideoPipeline, ContinuousARImagePipeline, VLMPipeline

REPO = Path(__file__).resolve().parent.parent
OWN_CODE = tuple(str(REPO / folder) for folder in ("mmspec", "pipelines", "models", "evaluation", "demos"))
BAD_NUMBERS = (float("nan"), float("inf"), -1, "x", None)


def refused(call: Callable[[], Any], argument: str) -> None:
    """``call()`` raises ValueError/TypeError from mmspec's own code, naming ``argument``."""
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
    message = str(caught.value)
    assert argument in message, f"the message does not name {argument!r}: {message}"
    raised_in = traceback.extract_tb(caught.value.__traceback__)[-1].filename
    assert raised_in.startswith(OWN_CODE), f"raised from {raised_in}, not from mmspec's checks: {message}"


@pytest.fixture(scope="module")
def t2i() -> ARImagePipeline:
    return quiet_pipeline(ARImagePipeline, "mmspec/shapes-t2i")


@pytest.fixture(scope="module")
def vlm() -> VLMPipeline:
    return quiet_pipeline(VLMPipeline, "mmspec/shapes-vlm")


@pytest.fixture(scope="module")
def continuous() -> ContinuousARImagePipeline:
    return quiet_pipeline(ContinuousARImagePipeline, "mmspec/shapes-t2i-continuous")


@pytest.fixture(scope="module")
def video() -> ARVideoPipeline:
    return quiet_pipeline(ARVideoPipeline, "mmspec/shapes-video")


# -- the core -------------------------------------------------------------------------------------------------
CORE_CASES = {
    "SamplingConfig temperature": ("temperature", [0.0, -1.0, 1e-45, math.inf, math.nan]),
    "SamplingConfig top_p": ("top_p", [0.0, 1.5, math.nan]),
    "SamplingConfig guidance_scale": ("guidance_scale", [-1.0, math.inf, math.nan]),
    "SamplingConfig top_k": ("top_k", [-1]),
    "SamplingConfig do_sample": ("do_sample", ["yes", 1, None]),
}


@pytest.mark.parametrize("case", sorted(CORE_CASES))
def test_sampling_config_refuses_out_of_range_values(case):
    argument, values = CORE_CASES[case]
    for value in values:
        refused(lambda v=value: SamplingConfig(**{argument: v}), argument)


@pytest.mark.parametrize("row", [[math.nan, 0.5, 0.5], [0.0, 0.0, 0.0], [-0.5, 1.0, 0.5], [math.inf, 0.0, 0.0]])
def test_sample_refuses_rows_that_are_not_distributions(row):
    probs = torch.tensor([[0.2, 0.3, 0.5], row])
    refused(lambda: sample(probs, torch.Generator().manual_seed(0)), "row [1]")


@pytest.mark.parametrize("field", ["top_k", "total_tokens"])
@pytest.mark.parametrize("value", [0, 10**6, 2.0, True])
def test_tree_config_refuses_sizes_outside_its_limits(field, value):
    """A tree of thousands of nodes makes every round slower than plain decoding (and 10**6 branches fail inside
    ``topk``): each size is bounded by :data:`~mmspec.validation.TREE_LIMITS`, the largest still accepted. The
    depth only has to be positive (a tree is never deeper than its nodes nor than what is left)."""
    from mmspec import TreeConfig
    from mmspec.validation import TREE_LIMITS

    refused(lambda: TreeConfig(**{field: value}), f"TreeConfig.{field}")
    assert TreeConfig(**{field: TREE_LIMITS[field]}) is not None
    refused(lambda: TreeConfig(depth=10**6, top_k=10**6, total_tokens=10**6), "TreeConfig.top_k")
    refused(lambda: TreeConfig(depth=0), "TreeConfig.depth")
    assert TreeConfig(depth=10**6, total_tokens=16).depth == 10**6


def test_verify_tokens_refuses_bad_shapes_ids_and_values():
    probs = torch.full((1, 3, 4), 0.25)
    drafts = torch.tensor([[1, 2]])
    refused(lambda: verify_tokens(drafts, None, probs[:, :2]), "target_probs")
    refused(lambda: verify_tokens(torch.tensor([[1, 9]]), None, probs), "draft_tokens")
    refused(lambda: verify_tokens(drafts.float(), None, probs), "draft_tokens")
    refused(lambda: verify_tokens(drafts, None, torch.full((1, 3, 4), math.nan)), "target_probs")
    refused(lambda: verify_tokens(drafts, torch.full((1, 2, 4), 0.5), probs), "draft_probs")
    refused(lambda: verify_tokens(drafts, None, probs, rule="exact"), "rule")
    assert verify_tokens(drafts, None, probs, ExactRule()).tokens.shape == (1, 3)  # the good call works


def test_reward_router_names_its_arguments():
    scorer = lambda frames, prompts: torch.ones(len(prompts))  # noqa: E731
    refused(lambda: mmspec.RewardRouter(scorer, tau="x"), "tau")
    refused(lambda: mmspec.RewardRouter(scorer, tau=math.nan), "tau")
    refused(lambda: mmspec.RewardRouter(scorer, tau=0.5, aggregate="median"), "aggregate")
    refused(lambda: mmspec.RewardRouter("not callable", tau=0.5), "reward_fn")


# -- the pipelines: one bad argument at a time ------------------------------------------------------------------
T2I_CASES = [
    ({"prompt": 123}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"prompt": ["a red circle", 5]}, "prompt"), ({"prompt": "a zorble"}, "zorble"),
    ({"method": "nope"}, "method"), ({"method": 5}, "method"),
    ({"temperature": 0.0}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": 1e-45}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_k": 10**9}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": math.nan}, "top_p"),
    ({"guidance_scale": -1.0}, "guidance_scale"), ({"guidance_scale": math.inf}, "guidance_scale"),
    ({"guidance_scale": math.nan}, "guidance_scale"), ({"guidance_scale": "x"}, "guidance_scale"),
    ({"num_images_per_prompt": 0}, "num_images_per_prompt"), ({"num_images_per_prompt": 1.5}, "num_images_per_prompt"),
    ({"num_images_per_prompt": True}, "num_images_per_prompt"), ({"num_images_per_prompt": 10**6}, "num_images_per_prompt"),
    ({"do_sample": "yes"}, "do_sample"), ({"do_sample": 1}, "do_sample"),
    ({"output_type": "jpeg"}, "output_type"), ({"callback_on_step_end": 5}, "callback_on_step_end"),
    ({"generator": "seed"}, "generator"),
]


@pytest.mark.parametrize("bad, argument", T2I_CASES, ids=[str(case[0]) for case in T2I_CASES])
def test_ar_image_pipeline_refuses(t2i, bad, argument):
    kwargs = {"prompt": "a red circle", "method": "eagle", **bad}
    refused(lambda: t2i(**kwargs), argument)


VLM_CASES = [
    ({"prompt": 123}, "prompt"), ({"prompt": ["describe the image.", 5]}, "prompt"),
    ({"method": "nope"}, "method"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"), ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"do_sample": "yes"}, "do_sample"),
    ({"do_sample": True, "temperature": math.nan}, "temperature"),
    ({"do_sample": True, "temperature": 1e-45}, "temperature"), ({"top_p": 2.0}, "top_p"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"), ({"images": "not an image"}, "images"),
    ({"images": torch.zeros(2, 2)}, "images"), ({"callback_on_step_end": 5}, "callback_on_step_end"),
    ({"prompt": " ".join(["circle"] * 2000)}, "max_position_embeddings"),
]


@pytest.mark.parametrize("bad, argument", VLM_CASES, ids=[str(case[0])[:60] for case in VLM_CASES])
def test_vlm_pipeline_refuses(vlm, bad, argument):
    from mmspec.models import shapes_vlm as sv

    example = sv.image_example("test", 0, 0, "describe")
    kwargs = {"images": example["frames"][0], "prompt": example["prompt"], "method": "eagle", "max_new_tokens": 8,
              **bad}
    refused(lambda: vlm(**kwargs), argument)


CONTINUOUS_CASES = [
    ({"method": "nope"}, "method"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": 0.0}, "temperature"),
    ({"guidance_scale": math.inf}, "guidance_scale"), ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"num_images_per_prompt": 0}, "num_images_per_prompt"), ({"num_images_per_prompt": 10**6}, "num_images_per_prompt"),
    ({"output_type": "jpeg"}, "output_type"),
    ({"prompt": ""}, "prompt"), ({"prompt": 3}, "prompt"),
]


@pytest.mark.parametrize("bad, argument", CONTINUOUS_CASES, ids=[str(case[0]) for case in CONTINUOUS_CASES])
def test_continuous_pipeline_refuses(continuous, bad, argument):
    kwargs = {"prompt": "a red circle", "method": "cspd", **bad}
    refused(lambda: continuous(**kwargs), argument)


VIDEO_CASES = [
    ({"method": "nope"}, "method"), ({"guidance_scale": math.inf}, "guidance_scale"),
    ({"guidance_scale": math.nan}, "guidance_scale"), ({"num_videos_per_prompt": 0}, "num_videos_per_prompt"),
    ({"num_inference_steps": 0}, "num_inference_steps"), ({"num_inference_steps": 10**5}, "num_inference_steps"),
    ({"num_videos_per_prompt": 10**6}, "num_videos_per_prompt"), ({"tau": "x"}, "tau"), ({"tau": math.nan}, "tau"),
    ({"output_type": "mp4"}, "output_type"), ({"prompt": 7}, "prompt"), ({"num_blocks": 0}, "num_blocks"),
    ({"num_blocks": 10**6}, "num_blocks"),
]


@pytest.mark.parametrize("bad, argument", VIDEO_CASES, ids=[str(case[0]) for case in VIDEO_CASES])
def test_video_pipeline_refuses(video, bad, argument):
    kwargs = {"prompt": "a red circle moving right", "method": "sdvg", **bad}
    refused(lambda: video(**kwargs), argument)


@pytest.mark.parametrize("pipeline_class", [ARImagePipeline, VLMPipeline, ContinuousARImagePipeline, ARVideoPipeline])
def test_from_pretrained_names_the_missing_folder(pipeline_class, tmp_path):
    missing = tmp_path / "no-such-pipeline"
    with pytest.raises((OSError, ValueError)) as caught:
        pipeline_class.from_pretrained(missing)
    assert "no-such-pipeline" in str(caught.value)
    with pytest.raises((OSError, ValueError)) as caught:
        pipeline_class.from_pretrained("mmspec/shapes-nothing")
    assert "shapes-nothing" in str(caught.value)


@pytest.mark.parametrize("zoo_id", ["mmspec/../../x", "mmspec/..", "mmspec/shapes-t2i/../shapes-vlm", "mmspec/a\\b"])
def test_zoo_ids_cannot_leave_the_zoo(zoo_id, tmp_path, monkeypatch):
    """A zoo id names one folder of the bundled zoo: a path out of it is refused before anything is read, even
    when it reaches a real pipeline folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x").mkdir()
    ARImagePipeline.from_pretrained("mmspec/shapes-t2i").save_pretrained(tmp_path / "x")  # a loadable target
    refused(lambda: ARImagePipeline.from_pretrained(zoo_id), "pretrained_model_name_or_path")


def test_a_local_folder_named_like_a_zoo_id_is_not_shadowed(tmp_path, monkeypatch):
    """``mmspec/<name>`` that is also a folder of the working directory: loaded when the zoo has no such entry,
    refused (naming both) when it has one; ``./mmspec/<name>`` always means the folder."""
    monkeypatch.chdir(tmp_path)
    pipe = ARImagePipeline.from_pretrained("mmspec/shapes-t2i")
    pipe.save_pretrained(tmp_path / "mmspec" / "my-pipe")
    loaded = ARImagePipeline.from_pretrained("mmspec/my-pipe")
    assert Path(loaded.config._name_or_path).resolve() == (tmp_path / "mmspec" / "my-pipe").resolve()
    pipe.save_pretrained(tmp_path / "mmspec" / "shapes-t2i")
    with pytest.raises(ValueError, match="both the zoo id.*pass ./mmspec/shapes-t2i"):
        ARImagePipeline.from_pretrained("mmspec/shapes-t2i")
    loaded = ARImagePipeline.from_pretrained("./mmspec/shapes-t2i")
    assert Path(loaded.config._name_or_path).resolve() == (tmp_path / "mmspec" / "shapes-t2i").resolve()


@pytest.mark.parametrize("variant", ["../x", "a/b", "fp16.x", "", 16])
def test_save_pretrained_refuses_a_variant_that_is_not_a_plain_name(t2i, variant, tmp_path):
    """The variant is part of every weights file's name: ``"../x"`` would write weights beside the folder. It is
    refused before anything is written."""
    refused(lambda: t2i.save_pretrained(tmp_path / "pipe", variant=variant), "variant")
    assert not list(tmp_path.iterdir())


def test_save_pretrained_refuses_a_file_as_the_folder(t2i, tmp_path):
    (tmp_path / "pipe").write_text("not a folder")
    refused(lambda: t2i.save_pretrained(tmp_path / "pipe"), "save_directory")
    assert (tmp_path / "pipe").read_text() == "not a folder"


@pytest.mark.parametrize("returned", [None, {"drafter": None}, "plan"])
def test_a_method_whose_build_returns_no_plan_is_named(t2i, returned):
    """A method registered from outside whose ``build()`` returns something else than a MethodPlan: the error
    names the method, its config class and what was expected, before the loop runs."""
    from dataclasses import dataclass
    from typing import ClassVar

    from mmspec import methods
    from mmspec.methods import MethodConfig

    @dataclass(frozen=True)
    class NoPlan(MethodConfig):
        pipelines: ClassVar[tuple[str, ...]] = ("ar_image",)

        def build(self, pipeline, request):
            return returned

    methods.register("no_plan_probe", NoPlan)
    try:
        with pytest.raises(TypeError) as caught:
            t2i("a red circle", method="no_plan_probe", output_type="tokens")
    finally:
        methods.unregister("no_plan_probe")
    message = str(caught.value)
    assert "'no_plan_probe'" in message and "NoPlan.build" in message and "expected a MethodPlan" in message
    assert type(returned).__name__ in message
