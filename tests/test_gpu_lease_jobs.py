"""scripts/gpu_lease_jobs.sh in its CPU smoke mode: every job's recipe command runs (tiny sizes, 2 steps) and
its run folders come back as archive parts that unpack into runs/ with trained model folders and logs."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_lease_jobs.sh"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})}, check=False)


@pytest.mark.slow
def test_smoke_run_of_every_job_packs_models_and_logs(tmp_path):
    runs = tmp_path / "runs"
    jobs = ["vlm_widened", "vlm_control", "vlm_lookalikes", "vlm_referent", "video", "mar_draft", "eagle_head"]
    env = {"MMSPEC_LEASE_SMOKE": "1", "MMSPEC_LEASE_RUNS": str(runs), "MMSPEC_LEASE_PYTHON": sys.executable}
    result = _run("60", *jobs, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parts = sorted((runs / "lease_out").iterdir())
    assert len(parts) <= 8 and all(p.stat().st_size <= 15 * 2**20 for p in parts)  # what the lease tool returns
    # a second lease: a stage from vlm_referent's model, and the video drafter's own stage (eight jobs at once
    # would come back as more files than the lease tool returns)
    result = _run("60", "vlm_referent2", "video_draft_stage", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jobs += ["vlm_referent2", "video_draft_stage"]
    parts = sorted((runs / "lease_out").iterdir())
    assert {p.name.split(".tar.gz.part")[0] for p in parts} == set(jobs)
    unpacked = tmp_path / "unpacked"
    for job in jobs:
        archive = tmp_path / f"{job}.tar.gz"
        archive.write_bytes(b"".join(p.read_bytes() for p in parts if p.name.startswith(f"{job}.tar.gz.part")))
        with tarfile.open(archive) as tar:
            names = tar.getnames()
            assert not any(name.endswith(".pt") for name in names), names
            tar.extractall(unpacked, filter="data")
    models = {job: [f"lease_{job}"] for job in jobs if job != "video"}
    models["video"] = ["lease_video", "lease_video_drafter"]
    for job, folders in models.items():
        assert (unpacked / "runs" / f"lease_{job}.log").is_file()
        for folder in folders:
            model = unpacked / "runs" / folder / "model"
            assert (model / "config.json").is_file() and list(model.glob("*.safetensors")), folder
            assert (unpacked / "runs" / folder / "log.jsonl").is_file()


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    env = {"MMSPEC_LEASE_SMOKE": "1", "MMSPEC_LEASE_RUNS": str(tmp_path / "runs")}
    for args in (("10",), ("abc",), ("60", "vlm_wide")):
        result = _run(*args, env=env)
        assert result.returncode == 2 and ("usage" in result.stderr or "unknown job" in result.stderr), args
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_gpu_host_installs_once_then_serves_concurrent_commands(tmp_path):
    """gpu_lease_jobs.sh installs mmspec through gpu_host.sh once, then starts its jobs side by side with
    MMSPEC_SITE_READY=1: those calls must not rebuild the tree (concurrent builds share build/ and failed on
    a GPU lease) and must still import mmspec from the installed copy. Here the host's Python is this
    environment's (it has torch and transformers, as a GPU host does)."""
    site = tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable, "MMSPEC_SITE": str(site),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    host = ["bash", str(ROOT / "scripts" / "gpu_host.sh"), "python", "-c"]
    where = "import mmspec.models, sys; print(mmspec.models.__file__); sys.exit(0)"
    first = subprocess.run([*host, where], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.strip().startswith(str(site)), first.stdout
    installed = (site / "mmspec" / "__init__.py").stat().st_mtime_ns
    ready = {**env, "MMSPEC_SITE_READY": "1"}
    calls = [subprocess.Popen([*host, where], cwd=ROOT, env=ready, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    for call in calls:
        out, err = call.communicate(timeout=600)
        assert call.returncode == 0, err[-3000:]
        assert out.strip().startswith(str(site)), out
    assert (site / "mmspec" / "__init__.py").stat().st_mtime_ns == installed  # nothing was reinstalled
