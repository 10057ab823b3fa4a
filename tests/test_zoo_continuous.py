"""The bundled zoo entry mmspec/shapes-t2i-continuous: loads offline in fp32, its draft is the cheaper
model, CSpD runs on it with the settings stored with it, and its report holds the measured target quality."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pipeline_utils import quiet_pipeline

from mmspec.pipelines import ContinuousARImagePipeline
from mmspec.pipelines.continuous_ar_image import mar_schedule
from mmspec.pipelines.hub import zoo_dir

FOLDER = zoo_dir() / "shapes-t2i-continuous"


@pytest.fixture(scope="module")
def pipe() -> ContinuousARImagePipeline:
    return quiet_pipeline(ContinuousARImagePipeline, "mmspec/shapes-t2i-continuous")


def test_zoo_entry_loads_offline(pipe):
    assert pipe.transformer.dtype == torch.float32 and pipe.draft_transformer.dtype == torch.float32
    size = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert size(pipe.draft_transformer) < size(pipe.transformer) / 3
    assert pipe.text_tokenizer.encode("a red circle") and pipe.grid_size == 8
    assert sum(f.stat().st_size for f in FOLDER.rglob("*") if f.is_file()) < 12 * 2**20


def test_cspd_on_the_zoo_replaces_target_forwards(pipe):
    kwargs = dict(num_iter=32, output_type="np", num_diffusion_steps=5)
    base = pipe(["a red circle", "two blue squares"], method="none", generator=torch.Generator().manual_seed(0),
                **kwargs)
    spec = pipe(["a red circle", "two blue squares"], method="cspd", generator=torch.Generator().manual_seed(0),
                **kwargs)
    assert spec.images.shape == base.images.shape == (2, 32, 32, 3)
    # the stored settings: whole target iterations until the pre-fill, then one target forward per gamma iterations
    config = pipe.method_config("cspd", batch_size=2)
    prefill = next(i for i, c in enumerate(mar_schedule(64, 32).starts) if c >= math.ceil(config.prefill_ratio * 64))
    assert spec.stats.target_calls == prefill + math.ceil((32 - prefill) / config.draft_length)
    assert spec.stats.target_calls < base.stats.target_calls * 0.7
    assert spec.stats.drafted_tokens > 0 and 0.0 <= spec.stats.acceptance_rate <= 1.0


def test_report_states_the_measured_target_quality():
    report = json.loads((FOLDER / "report.json").read_text())
    assert report["images"] == 300 and set(report["per_category"]) == {
        "single_object", "two_object", "counting", "colors", "position", "color_attr"}
    mean = sum(report["per_category"].values()) / 6
    assert abs(mean - report["geneval_overall"]) < 1e-9
