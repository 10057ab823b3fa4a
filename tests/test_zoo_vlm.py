"""The bundled zoo entry mmspec/shapes-vlm: loads offline in fp32 with every drafter, and every method is
lossless on it (greedy text equals target-only decoding on held-out images and videos) while the
trained heads are actually accepted; the accuracy report matches a fresh measurement."""

from __future__ import annotations

import json

import pytest
import torch
from pipeline_utils import quiet_pipeline

from mmspec.models import shapes_vlm as sv
from mmspec.models.recipes import report_vlm
from mmspec.pipelines import VLMPipeline
from mmspec.pipelines.hub import zoo_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FOLDER = zoo_dir() / "shapes-vlm"
BUILT = (FOLDER / "model_index.json").is_file()
METHODS = ("eagle", "flash", "vispec", "specvlm", "draft_vlm")


@pytest.fixture(scope="module")
def pipe() -> VLMPipeline:
    if not BUILT:
        pytest.fail(f"{FOLDER} is not built (bash scripts/build_zoo_vlm.sh)")
    return quiet_pipeline(VLMPipeline, "mmspec/shapes-vlm")


def _examples() -> tuple[list, list[str]]:
    image = sv.image_example("test", 0, 0, "describe")
    video = sv.video_example("test", 0, 0, "narrate")
    return [list(image["frames"]), list(video["frames"])], [image["prompt"], video["prompt"]]


def test_zoo_entry_loads_offline_with_every_drafter(pipe):
    assert pipe.target.dtype == torch.float32  # fp16 on disk, fp32 compute
    for name in ("eagle_head", "flash_head", "vispec_head", "specvlm_head", "draft_model"):
        assert getattr(pipe, name) is not None, name
    assert pipe.format_prompt("describe the image in detail.", 1) == sv.task_prompt("describe")
    assert sum(f.stat().st_size for f in FOLDER.rglob("*") if f.is_file()) < 20 * 2**20


@pytest.mark.parametrize("method", METHODS)
def test_greedy_methods_reproduce_target_only_text_on_the_zoo(pipe, method):
    videos, prompts = _examples()
    kwargs = dict(do_sample=False, max_new_tokens=48)
    base = pipe(videos=videos, prompt=prompts, method="none", **kwargs)
    spec = pipe(videos=videos, prompt=prompts, method=method, **kwargs)
    assert spec.text == base.text and len(spec.tokens) == len(base.tokens) == 2
    assert all(torch.equal(a, b) for a, b in zip(spec.tokens, base.tokens))
    assert spec.stats.mean_accepted_length > 2.0, method  # trained drafters are accepted: equality means something


@pytest.mark.parametrize("task, num", [("describe", 12), ("qa", 12), ("narrate", 6), ("video_caption", 12)])
def test_report_matches_a_fresh_measurement(task, num):
    """The accuracy in report.json (400 / 200 held-out examples) is what the bundled target does: a fresh
    greedy run on the first ``num`` examples agrees within sampling error (3 standard errors + 1/num)."""
    report = json.loads((FOLDER / "report.json").read_text())
    expected = report["target"]["tasks"][task]["exact"]
    model, processor = sv.load_model(FOLDER / "target"), sv.load_processor(FOLDER / "processor")
    examples = report_vlm.held_out_examples(task, num)
    answers = report_vlm.generate_answers(model, processor, examples, batch=num)
    exact = sum(text == e["answer"] for (text, _), e in zip(answers, examples)) / num
    assert abs(exact - expected) <= 3 * (expected * (1 - expected) / num) ** 0.5 + 1 / num, (task, exact, expected)
