"""The EAGLE round profiler counts exactly the calls the speculation loop makes."""

from __future__ import annotations

import pytest
import torch
from tiny_shapes_pipeline import tiny_shapes_pipeline

from mmspec.evaluation.profile_eagle_rounds import MAX_POSITION, profile, timing_model_calls
from mmspec.methods.eagle import EagleConfig


def test_profile_counts_every_target_call_and_head_step():
    pipe = tiny_shapes_pipeline()
    prompts = ["a red circle", "two blue squares"]
    method = EagleConfig(num_draft_tokens=12)  # chains longer than MAX_POSITION: the last bucket pools them
    result = profile(pipe, prompts, repeats=1, method=method)
    stats = [pipe(p, method=method, do_sample=False, output_type="tokens", generator=torch.Generator().manual_seed(0)
                  ).stats for p in prompts]
    eagle = result["eagle"]["calls"]
    per_image = lambda key: sum(getattr(s, key) for s in stats) / len(prompts)  # noqa: E731
    assert eagle["target"]["calls_per_image"] == per_image("target_calls")  # prefill + one per round
    head = sum(v["calls_per_image"] for k, v in eagle.items() if k.startswith("head"))
    assert head == per_image("draft_calls")  # the head's prefill forward included
    assert set(eagle) <= {"target"} | {f"head {i}" for i in range(MAX_POSITION + 1)} and f"head {MAX_POSITION}" in eagle
    assert result["none"]["calls"]["target"]["calls_per_image"] == 64  # prefill + 63 single-token calls
    assert all(v["ms_per_call"] > 0 for v in eagle.values()) and result["speedup"] > 0
    phases = result["eagle"]["phases"]
    assert set(phases) == {"prefill", "draft", "target", "verify", "commit"} and set(result["none"]["phases"]) == \
        {"prefill", "target", "verify"}
    head_ms = sum(v["calls_per_image"] * v["ms_per_call"] for k, v in eagle.items() if k.startswith("head"))
    assert phases["draft"] >= head_ms  # the head's calls run inside the draft phase
    assert sum(phases.values()) + result["eagle"]["outside_phases"] == pytest.approx(result["eagle"]["ms_per_image"])
    with pytest.raises(ValueError, match="at least one prompt"):
        profile(pipe, [], repeats=1)


def test_timing_hook_is_removed_after_the_block():
    from mmspec.models.eagle import EagleHead
    from mmspec.runner import CausalLMRunner

    original = CausalLMRunner._run
    with timing_model_calls(EagleHead):
        assert CausalLMRunner._run is not original
    assert CausalLMRunner._run is original
