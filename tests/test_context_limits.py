"""Unbounded inputs are refused with the numbers that matter: a VLM context (long prompt, many video frames)
past the target's max_position_embeddings, before any forward; ``mmspec generate --scale`` past the largest
image side it writes."""

from __future__ import annotations

import pytest
from pipeline_utils import quiet_pipeline
from tiny_shapes_pipeline import save_tiny_shapes_pipeline

from mmspec.cli import main as cli_main
from mmspec.models import shapes_vlm as sv
from mmspec.models.vlm_drafters import EagleVLMHead
from mmspec.pipelines import VLMPipeline
from mmspec.pipelines.generate_cli import MAX_OUTPUT_SIDE, check_scale
from mmspec.validation import max_position_embeddings

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LIMIT = 1024  # the zoo captioner's max_position_embeddings
FRAME_TOKENS = 64  # image tokens per frame


@pytest.fixture(scope="module")
def vlm() -> VLMPipeline:
    return quiet_pipeline(VLMPipeline, "mmspec/shapes-vlm")


@pytest.fixture
def no_forward(vlm, monkeypatch):
    """Fail the test if the target runs: the checks must come before any forward."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target ran before the context-length check")
    monkeypatch.setattr(vlm.target, "forward", refuse)


def _frame():
    return sv.image_example("test", 0, 0, "describe")["frames"][0]


def test_a_2000_word_prompt_is_refused_naming_both_numbers(vlm, no_forward):
    prompt = "describe the image in detail. " * 400  # 2000 words the captioner knows
    with pytest.raises(ValueError, match=rf"prompt takes \d{{4}} positions.*max_position_embeddings is {LIMIT}"):
        vlm(_frame(), prompt, "eagle", max_new_tokens=16)


@pytest.mark.parametrize("frames", [20, 40])
def test_many_video_frames_are_refused_in_call_and_stream(vlm, no_forward, frames):
    kwargs = dict(videos=[[_frame()] * frames], prompt="narrate the video.", max_new_tokens=16)
    pattern = rf"prompt takes \d+ positions.*max_position_embeddings is {LIMIT}.*fewer images or video frames"
    with pytest.raises(ValueError, match=pattern):
        vlm(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        list(vlm.stream(**kwargs))


def test_prompt_plus_max_new_tokens_past_the_limit_names_the_room_left(vlm, no_forward):
    """14 frames fit (896 image tokens) but not with 256 new tokens: the message says how many would."""
    frames = [[_frame()] * 14]
    with pytest.raises(ValueError, match=r"max_new_tokens=256 more.*lower max_new_tokens to at most (\d+)") as info:
        vlm(videos=frames, prompt="narrate the video.", max_new_tokens=256)
    room = int(info.value.args[0].split("at most ")[1].split(",")[0])
    prompt = int(info.value.args[0].split("takes ")[1].split(" ")[0])
    assert prompt > 14 * FRAME_TOKENS and prompt + room == LIMIT


def test_a_context_that_fits_exactly_runs(vlm):
    frames = [[_frame()] * 14]
    batch = vlm.encode(None, "narrate the video.", videos=frames)
    prompt = int(batch.inputs["attention_mask"].sum())
    vlm.check_context_length(batch, LIMIT - prompt, "eagle")  # no error at the limit itself
    with pytest.raises(ValueError, match=f"max_new_tokens={LIMIT - prompt + 1} more"):
        vlm.check_context_length(batch, LIMIT - prompt + 1, "eagle")


def test_position_limits_cover_the_target_and_the_methods_draft_model():
    """The target's language model and the drafting component's own limit (heads read the target's positions)."""
    head = EagleVLMHead(32, 40, max_position_embeddings=300)
    assert max_position_embeddings(head) == 300
    assert max_position_embeddings(object()) is None


def test_zoo_position_limits(vlm):
    assert vlm.position_limits("none") == {"target": LIMIT}
    assert vlm.position_limits("flash") == {"target": LIMIT, "flash_head": LIMIT}
    assert vlm.position_limits("draft_vlm") == {"target": LIMIT, "draft_model": LIMIT}


# -- mmspec generate --scale --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_shapes_pipeline(tmp_path_factory.mktemp("tiny") / "pipe")


def test_generate_refuses_a_scale_past_the_largest_png_before_generating(folder, tmp_path, monkeypatch):
    """The tiny pipeline makes 32 px images: --scale 129 would write 4128 px PNGs."""
    from mmspec.pipelines.ar_image import ARImagePipeline

    def refuse(*args, **kwargs):
        raise AssertionError("generated before checking --scale")
    monkeypatch.setattr(ARImagePipeline, "__call__", refuse)
    with pytest.raises(SystemExit, match=rf"--scale 129 would write 4128x4128 px PNGs from 32x32 px images.*"
                                         rf"{MAX_OUTPUT_SIDE} px.*--scale 128 or less"):
        cli_main(["generate", "a red circle", "--pipeline", str(folder), "--outdir", str(tmp_path / "out"),
                  "--scale", "129", "--greedy"])
    assert not (tmp_path / "out").exists()


def test_generate_refuses_a_huge_scale_before_loading_anything(tmp_path):
    with pytest.raises(SystemExit, match=rf"--scale 100000 .*{MAX_OUTPUT_SIDE} px"):
        cli_main(["generate", "a red circle", "--pipeline", str(tmp_path / "missing"), "--scale", "100000"])


def test_check_scale_bounds():
    check_scale(128, 32)  # exactly the limit
    check_scale(1)
    for scale, side in ((0, 32), (-1, None)):
        with pytest.raises(SystemExit, match="--scale must be >= 1"):
            check_scale(scale, side)
    with pytest.raises(SystemExit, match=f"the limit is {MAX_OUTPUT_SIDE} px"):
        check_scale(MAX_OUTPUT_SIDE + 1)
