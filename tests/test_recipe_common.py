"""The shared training loop of the recipes: a time-limited run (a GPU lease of fixed length)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from mmspec.models.recipes import common
from mmspec.models.recipes.common import fit_schedule, start_run, train_loop


def test_fit_schedule_keeps_what_fits_and_shortens_what_does_not():
    assert fit_schedule(1000, 60, seconds_per_step=0.1, seconds_left=200.0) == 1000  # 94 s of work: fits
    assert fit_schedule(1000, 60, seconds_per_step=1.0, seconds_left=90.0) == 60 + int(0.95 * 90)
    assert fit_schedule(1000, 60, seconds_per_step=10.0, seconds_left=5.0) == 100  # never below the warm-up
    assert fit_schedule(1000, 160, seconds_per_step=10.0, seconds_left=5.0) == 160  # nor below the steps done
    assert fit_schedule(80, 60, seconds_per_step=10.0, seconds_left=5.0) == 100  # a floor above a short schedule
    assert fit_schedule(1000, 60, seconds_per_step=0.0, seconds_left=5.0) == 1000


class _Clock:
    """Stands in for ``time.time`` in the loop: each training step costs one second."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now


def _run(tmp_path, name: str, steps: int, clock: _Clock, time_limit: float | None, seconds_per_step: float = 1.0):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = torch.randn(50, 3)

    def loss_fn(index: torch.Tensor) -> torch.Tensor:
        clock.now += seconds_per_step
        return model(data[index]).pow(2).mean()

    saved = []
    train_loop(model, loss_fn, 50, steps=steps, batch=4, lr=1e-2, work=tmp_path / name,
               save=lambda m: saved.append({k: v.clone() for k, v in m.state_dict().items()}), save_every=1000,
               time_limit=time_limit)
    log = [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
    return saved[-1], log, torch.load(tmp_path / name / "checkpoint.pt")["step"]


def test_a_time_limited_run_shortens_its_schedule_and_equals_the_run_of_that_length(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(common, "time", clock)
    limited, log, last = _run(tmp_path, "limited", 1000, clock, time_limit=150.0)
    fitted = [entry for entry in log if entry.get("reason") == "time limit"]
    assert fitted == [{"steps": 145, "reason": "time limit"}]  # 60 + 0.95 * 90 s left at 1 s a step
    assert last == 145 and clock.now <= 150.0
    plain, _, _ = _run(tmp_path, "plain", 145, clock, time_limit=None)  # --steps 145 repeats it
    assert all(torch.equal(limited[k], plain[k]) for k in plain)


def test_a_time_limited_run_that_fits_keeps_its_schedule(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(common, "time", clock)
    _, log, last = _run(tmp_path, "fits", 120, clock, time_limit=1000.0)
    assert last == 120 and not [entry for entry in log if "reason" in entry]


def test_a_resumed_run_stops_saved_when_its_time_is_up(tmp_path, monkeypatch):
    """A resumed run cannot reshape a schedule already under way; it ends (saved) once the limit passes."""
    clock = _Clock()
    monkeypatch.setattr(common, "time", clock)
    _run(tmp_path, "pieces", 20, clock, time_limit=None)  # a finished 20-step run to resume from ...
    checkpoint = torch.load(tmp_path / "pieces" / "checkpoint.pt")
    checkpoint["step"] = 5  # ... rewound, as if it had stopped at step 5 of 400
    torch.save(checkpoint, tmp_path / "pieces" / "checkpoint.pt")
    _, log, last = _run(tmp_path, "pieces", 400, clock, time_limit=30.5)
    assert last == 5 + 31  # the step that crossed 30.5 s was the last, and it was saved
    assert [entry for entry in log if "reason" in entry] == [{"stopped_at": 36, "reason": "time limit"}]


@pytest.mark.parametrize("limit", [0.0, -5.0, float("nan")])
def test_time_limit_must_be_positive(limit):
    args = argparse.Namespace(device="cpu", time_limit=limit, threads=1, seed=0, work=None)
    with pytest.raises(ValueError, match="--time-limit must be a positive number of seconds"):
        start_run(args)


def test_a_recipe_with_a_time_limit_it_does_not_reach_trains_as_without(tmp_path):
    from mmspec.models.recipes import train_video
    from mmspec.models.video import BlockCausalVideoTransformer

    small = ["--dim", "32", "--layers", "1", "--heads", "4", "--num-frames", "4", "--train-clips", "6", "--batch", "2",
             "--save-every", "100", "--threads", "1", "--steps", "3"]
    train_video.main(["--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa"), *small])
    train_video.main(["--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb"), "--time-limit", "3600", *small])
    plain = BlockCausalVideoTransformer.from_pretrained(tmp_path / "a").state_dict()
    limited = BlockCausalVideoTransformer.from_pretrained(tmp_path / "b").state_dict()
    assert all(torch.equal(plain[k], limited[k]) for k in plain)
    with pytest.raises(ValueError, match="--time-limit must be a positive"):
        train_video.main(["--out", str(tmp_path / "c"), "--work", str(tmp_path / "wc"), "--time-limit", "0", *small])


def test_cached_data_builds_once_then_loads(tmp_path):
    calls = []

    def build() -> dict:
        calls.append(1)
        return {"tokens": torch.arange(6)}

    first = common.cached_data(tmp_path, build)
    second = common.cached_data(tmp_path, build)
    assert len(calls) == 1 and torch.equal(first["tokens"], second["tokens"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.pt"]  # no partial file left behind


def test_cached_data_refuses_a_cache_built_for_other_arguments(tmp_path):
    """With a key the cache is reused for the same arguments and refused, naming what changed, for others;
    a cache without a key file (older runs, or copied without it) is used as it is."""
    calls = []

    def build() -> dict:
        calls.append(1)
        return {"tokens": torch.arange(len(calls) + 5)}

    key = {"train_images": 6, "seed": 0, "vq": Path("models/vq")}
    first = common.cached_data(tmp_path, build, key=key)
    again = common.cached_data(tmp_path, build, key=dict(key))
    assert len(calls) == 1 and torch.equal(first["tokens"], again["tokens"])
    assert json.loads((tmp_path / "data.pt.key.json").read_text())["vq"] == "models/vq"
    with pytest.raises(SystemExit, match=r"train_images: 6 there, 8 now\); use another --work"):
        common.cached_data(tmp_path, build, key={**key, "train_images": 8})
    (tmp_path / "data.pt.key.json").unlink()
    assert torch.equal(common.cached_data(tmp_path, build, key={**key, "train_images": 8})["tokens"], first["tokens"])
    assert len(calls) == 1


def test_save_atomically_keeps_the_previous_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    common.save_atomically({"step": 1}, path)
    real_save = torch.save

    def failing_save(obj, target):  # writes part of the file, then the process "dies"
        real_save({"step": 2, "padding": torch.zeros(1000)}, target)
        with open(target, "r+b") as handle:
            handle.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(common.torch, "save", failing_save)
    with pytest.raises(KeyboardInterrupt):
        common.save_atomically({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path) == {"step": 1}  # the complete previous checkpoint, not a truncated one


def test_save_fp16_copy_leaves_the_model_and_warns_nothing(tmp_path, caplog):
    import logging

    from diffusers.utils import logging as diffusers_logging

    from mmspec.models.recipes.common import save_fp16_copy
    from mmspec.models.video import BlockCausalVideoTransformer

    model = BlockCausalVideoTransformer(num_layers=1, dim=16, num_heads=2, num_frames=4, text_length=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    diffusers_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            save_fp16_copy(model, tmp_path / "m")
    finally:
        diffusers_logging.disable_propagation()
    assert not [r for r in caplog.records if "kept in float32" in r.getMessage()]
    assert all(torch.equal(before[k], v) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "m" / "diffusion_pytorch_model.safetensors"))
    assert all(v.dtype == torch.float16 for v in saved.values())
    assert torch.equal(saved["head.weight"], before["head.weight"].half())
    # the cast this replaces: diffusers' ModelMixin.to warns even with no fp32 modules (what the test guards)
    diffusers_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            model.to(torch.float16)
    finally:
        diffusers_logging.disable_propagation()
    assert [r for r in caplog.records if "kept in float32" in r.getMessage()]
