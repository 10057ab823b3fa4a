"""The verification benchmark's command runs and writes its table (its timings are not asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec.evaluation import bench_verify


def test_bench_verify_writes_its_table_and_numbers(tmp_path):
    out = tmp_path / "verify.md"
    bench_verify.main(["--out", str(out), "--batch", "2", "--draft-len", "3", "--vocab", "50", "--repeats", "3",
                       "--threads", "1"])
    table = out.read_text()
    assert "| 2 | 3 | 50 |" in table and "chain_verify triton" not in table  # the Triton column is GPU-only
    command = table.split("Command: `")[1]  # the command that made it
    assert all(option in command for option in ("--batch 2", "--draft-len 3", "--vocab 50", "--repeats 3",
                                                 "--threads 1"))
    run = json.loads(out.with_suffix(".json").read_text())["runs"][0]
    assert run["meta"]["device"] == "CPU" and run["meta"]["gpu"] is None
    timings = run["results"][0]["timings"]
    assert set(timings) == set(bench_verify.CASES) and all(t["median_s"] > 0 for t in timings.values())
    assert 0 <= run["results"][0]["mean_accepted"] <= 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_bench_verify_on_cuda_without_a_gpu_says_so(tmp_path):
    with pytest.raises(RuntimeError, match="--device cuda: torch sees no CUDA GPU"):
        bench_verify.main(["--out", str(tmp_path / "v.md"), "--device", "cuda"])
    with pytest.raises(ValueError, match="--device must be cpu or cuda"):
        bench_verify.main(["--out", str(tmp_path / "v.md"), "--device", "mps"])
    with pytest.raises(ValueError, match="--splits times a Triton kernel: it needs --device cuda"):
        bench_verify.main(["--out", str(tmp_path / "v.md"), "--splits", "8"])
    with pytest.raises(ValueError, match="--splits must be at least 2"):
        bench_verify.main(["--out", str(tmp_path / "v.md"), "--device", "cuda", "--splits", "1"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_verify_on_cuda_times_the_triton_kernel_and_checks_it(tmp_path):
    out = tmp_path / "verify.md"
    bench_verify.main(["--out", str(out), "--device", "cuda", "--batch", "2", "--draft-len", "3", "--vocab", "500",
                       "--repeats", "3", "--splits", "4"])
    result = json.loads(out.with_suffix(".json").read_text())["runs"][0]["results"][0]
    assert "chain_verify_triton" in result["timings"] and result["triton_equals_reference"] is True
    assert "chain_verify_split" in result["timings"] and result["split_equals_reference"] is True
    assert "chain_verify triton" in out.read_text() and "| split-V | same" in out.read_text()
