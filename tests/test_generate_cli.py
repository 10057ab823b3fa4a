"""`mmspec generate` and the AR image benchmark script, end to end on a tiny saved pipeline."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_shapes_pipeline import save_tiny_shapes_pipeline

from mmspec import TreeConfig
from mmspec.cli import main as cli_main
from mmspec.evaluation import bench_ar_image
from mmspec.methods.eagle import EagleConfig, LanternConfig
from mmspec.methods.jacobi import GSDConfig, SJDConfig
from mmspec.methods.mulo import MuLoConfig
from mmspec.pipelines import ARImagePipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_shapes_pipeline(tmp_path_factory.mktemp("tiny") / "pipe")


def test_generate_writes_pngs_and_reports_speedup(folder, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli_main(["generate", "a red circle", "two blue squares", "--pipeline", str(folder), "--method", "eagle",
                     "--outdir", str(out), "--num-images", "2", "--scale", "2", "--greedy"])
    assert code == 0
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 8 and sum(name.endswith("-drafted.png") for name in files) == 4
    assert "00-a-red-circle-0.png" in files and "01-two-blue-squares-1.png" in files
    assert Image.open(out / "00-a-red-circle-0.png").size == (64, 64)
    text = capsys.readouterr().out
    assert "speedup:" in text and "mean accepted length" in text and "none (baseline" in text


def test_generate_computes_in_the_requested_precision(folder, tmp_path, capsys, monkeypatch):
    """``--dtype bfloat16``: every component of the pipeline (target, head, tokenizer) computes in bfloat16, and
    the run completes with images and the speedup line."""
    from mmspec.pipelines.ar_image import ARImagePipeline

    seen = []
    original = ARImagePipeline.__call__

    def spy(self, *args, **kwargs):
        seen.append({self.transformer.dtype, self.eagle_head.dtype, self.vqvae.dtype})
        return original(self, *args, **kwargs)
    monkeypatch.setattr(ARImagePipeline, "__call__", spy)
    out = tmp_path / "bf16"
    assert cli_main(["generate", "a red circle", "--pipeline", str(folder), "--outdir", str(out), "--greedy",
                     "--dtype", "bfloat16"]) == 0
    assert len(seen) >= 2 and all(dtypes == {torch.bfloat16} for dtypes in seen)  # the method and the baseline
    assert (out / "00-a-red-circle-0.png").is_file() and "speedup:" in capsys.readouterr().out


def test_benchmark_cases_can_run_in_another_precision(folder):
    """A case's ``"dtype"`` runs it on a copy of the pipeline in that precision, made once and kept; the run's
    own precision (or None) is the pipeline itself; an unknown name is a command-line error."""
    from mmspec.pipelines import ARImagePipeline

    pipe = ARImagePipeline.from_pretrained(folder)
    assert bench_ar_image.pipeline_variant(pipe, None) is pipe
    assert bench_ar_image.pipeline_variant(pipe, "float32") is pipe
    copy = bench_ar_image.pipeline_variant(pipe, "bfloat16")
    assert copy is not pipe and copy.transformer.dtype == torch.bfloat16 and copy.eagle_head.dtype == torch.bfloat16
    assert pipe.transformer.dtype == torch.float32  # the run's pipeline is untouched
    assert bench_ar_image.pipeline_variant(pipe, "bfloat16") is copy
    images, stats = bench_ar_image.generate(pipe, ["a red circle"], "none", {"dtype": "bfloat16"},
                                            {"do_sample": False}, batch=1, seed=0)
    assert len(images) == 1 and stats[0].target_calls > 0
    with pytest.raises(SystemExit, match="dtype must be one of"):
        bench_ar_image.pipeline_variant(pipe, "int8")


def test_benchmark_cases_can_run_with_plain_or_packed_gemms(folder):
    """A case's ``"cpu_gemm"`` runs it on a copy with the CPU linears packed or plain (the run's own setting:
    the pipeline itself), so a table can put plain-GEMM rows beside packed ones; both give the same tokens."""
    from mmspec.pipelines import ARImagePipeline

    pipe = ARImagePipeline.from_pretrained(folder)
    pipe.set_cpu_gemm("packed")
    assert pipe.packed_cpu_gemm
    assert bench_ar_image.pipeline_variant(pipe, cpu_gemm="packed") is pipe
    plain = bench_ar_image.pipeline_variant(pipe, cpu_gemm="plain")
    assert plain is not pipe and not plain.packed_cpu_gemm and pipe.packed_cpu_gemm
    assert bench_ar_image.pipeline_variant(pipe, cpu_gemm="plain") is plain
    runs = [bench_ar_image.generate(pipe, ["a red circle"], "eagle", {"cpu_gemm": gemm}, {"do_sample": False},
                                    batch=1, seed=0)[0][0] for gemm in ("packed", "plain")]
    np.testing.assert_allclose(runs[0], runs[1])
    with pytest.raises(SystemExit, match="cpu_gemm must be one of"):
        bench_ar_image.pipeline_variant(pipe, cpu_gemm="mkl")


@pytest.fixture
def pipeline_calls(monkeypatch) -> list[dict]:
    """The keyword arguments of every ARImagePipeline call made while the test runs."""
    from mmspec.pipelines.ar_image import ARImagePipeline

    calls: list[dict] = []
    original = ARImagePipeline.__call__

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(ARImagePipeline, "__call__", spy)
    return calls


ZOO = "mmspec/shapes-t2i"


@pytest.mark.parametrize("method", ["none", "eagle", "lantern", "sjd", "gsd", "mulo"])
def test_generate_runs_every_method_on_the_zoo_with_its_stored_settings(tmp_path, capsys, pipeline_calls, method):
    """Every method runs with one prompt and with two (sampling, the default), passing the pipeline nothing but
    ``method=``: the zoo's stored settings for that batch, as a user's call gets them."""
    for prompts in (["a red circle"], ["a red circle", "two blue squares"]):
        out = tmp_path / str(len(prompts))
        assert cli_main(["generate", *prompts, "--pipeline", ZOO, "--method", method, "--outdir", str(out),
                         "--no-baseline", "--scale", "1"]) == 0
        assert len(list(out.glob("*-drafted.png"))) == len(prompts)
        assert pipeline_calls[-1]["method"] == method and pipeline_calls[-1]["do_sample"]
    assert f"{method}: " in capsys.readouterr().out


def test_generate_lantern_with_its_baseline_on_the_zoo(tmp_path, capsys, pipeline_calls):
    """``mmspec generate "a red circle" --method lantern``: LANTERN with the zoo's stored settings (argmax
    drafts with the LANTERN++ bound when sampling) and the baseline, which gets the sampling settings only
    (it once stopped with "argmax_drafts ... method='none' drafts no EAGLE chain"); both warmed up once,
    then timed alternately, and the speedup printed with its range."""
    assert cli_main(["generate", "a red circle", "--pipeline", ZOO, "--method", "lantern", "--outdir",
                     str(tmp_path), "--scale", "1", "--repeats", "2"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"speedup: \d+\.\d\dx \(range \d+\.\d\d-\d+\.\d\dx over 2 alternating runs", text), text
    # one warm-up each, then two passes: baseline first in every pass
    assert [call["method"] for call in pipeline_calls] == ["none", "lantern"] * 3
    stored = ARImagePipeline.from_pretrained(ZOO).method_config("lantern", guidance_scale=3.0)
    assert stored.argmax_drafts and stored.lam == 10.0
    sampling = {"do_sample", "temperature", "top_k", "top_p", "guidance_scale", "num_images_per_prompt",
                "output_type", "generator", "method"}
    assert all(set(call) == sampling for call in pipeline_calls)  # the method's settings travel in its config


def test_generate_method_kwargs_replace_config_fields(tmp_path, pipeline_calls):
    """``--method-kwargs`` is JSON of config fields over the stored settings of the run's mode and batch."""
    pipe = ARImagePipeline.from_pretrained(ZOO)
    assert cli_main(["generate", "a red circle", "--pipeline", ZOO, "--outdir", str(tmp_path / "a"), "--greedy",
                     "--no-baseline", "--scale", "1", "--method-kwargs", '{"draft_confidence_threshold": 0.2}']) == 0
    stored = pipe.method_config("eagle", do_sample=False, batch_size=1, guidance_scale=3.0)
    assert pipeline_calls[-1]["method"] == stored.replace(draft_confidence_threshold=0.2)
    assert stored.lookup_tail == 16  # the rest stays the stored greedy single-image settings
    assert cli_main(["generate", "a red circle", "a blue square", "--pipeline", ZOO, "--outdir", str(tmp_path / "b"),
                     "--method", "gsd", "--no-baseline", "--scale", "1", "--method-kwargs",
                     '{"window": 4, "group_size": 3}']) == 0
    assert pipeline_calls[-1]["method"] == GSDConfig(window=4, init="left", group_size=3, prob_threshold=1.0)


def test_benchmark_cases_run_the_stored_settings_beside_the_reference(folder):
    """bench_ar_image: a case named after a method passes ``method=`` alone; "M (reference)" passes the former
    fast settings as an explicit config; config fields of a case replace the stored (or reference) ones; a key
    that is no field of the method's config is a command-line error naming it."""
    pipe = ARImagePipeline.from_pretrained(folder)
    cases = bench_ar_image.default_cases()
    greedy, sampled = {"do_sample": False}, {"do_sample": True, "temperature": 1.0}
    assert bench_ar_image.case_method(pipe, "eagle", cases["eagle"], greedy, 1) == ("eagle", {})
    assert bench_ar_image.case_method(pipe, "none", cases["none"], greedy, 4) == ("none", {})
    reference, _ = bench_ar_image.case_method(pipe, "lantern (reference)", cases["lantern (reference)"], sampled, 4)
    assert reference == bench_ar_image.reference_config("lantern", False, 4) == LanternConfig(
        argmax_drafts=True, num_draft_tokens=4, draft_confidence_threshold=0.5, k=512, lam=10.0)
    tv, _ = bench_ar_image.case_method(pipe, "lantern, TV budget", cases["lantern, TV budget"], sampled, 1)
    assert tv == pipe.method_config("lantern").replace(k=64, delta=0.2, lam=None)
    exact, extra = bench_ar_image.case_method(pipe, "mulo, reverify, exact", cases["mulo, reverify, exact"], sampled, 1)
    assert exact == MuLoConfig(resample="reverify") and extra == {"rule": "exact"}
    tree, _ = bench_ar_image.case_method(pipe, "eagle", {"tree": {"depth": 3, "top_k": 2, "total_tokens": 6}},
                                         greedy, 1)
    assert tree == EagleConfig(tree=TreeConfig(depth=3, top_k=2, total_tokens=6))
    with pytest.raises(SystemExit, match=r"case 'eagle' sets 'lantern_k', which is neither a field of EagleConfig"):
        bench_ar_image.case_method(pipe, "eagle", {"lantern_k": 5}, greedy, 1)
    with pytest.raises(SystemExit, match=r"sets 'lantern_k'.*lantern_k is now the config field 'k'"):
        bench_ar_image.case_method(pipe, "lantern", {"lantern_k": 5}, greedy, 1)
    with pytest.raises(SystemExit, match=r"LanternConfig.delta must be a number"):
        bench_ar_image.case_method(pipe, "lantern", {"delta": 2.0}, greedy, 1)
    configs = bench_ar_image.resolved_configs(pipe, {"none": {}, "sjd": {}}, ["greedy"], [1])
    assert configs == {"greedy": {"1": {"none": None, "sjd": {"config": "SJDConfig", **SJDConfig().to_dict()}}}}


@pytest.mark.parametrize("args,match", [
    (["--method", "medusa"], "invalid choice"),
    (["--method-kwargs", "{oops"], "not valid JSON"),
    (["--pipeline", "mmspec/no-such-entry"], "cannot load"),
    (["--method-kwargs", '{"lantern_delta": -1}', "--method", "lantern"],
     "LanternConfig (method 'lantern') has no field 'lantern_delta'; its fields are num_draft_tokens"),
    (["--method-kwargs", '{"lantern_k": 5}', "--method", "lantern"], "lantern_k is now the field 'k'"),
    (["--method-kwargs", '{"delta": -1}', "--method", "lantern"], "LanternConfig.delta must be a number in"),
    (["--method-kwargs", '{"window": 4}', "--method", "none"], "method 'none' (target only) has no settings"),
    (["--dtype", "float16"], "must be one of float32, bfloat16"),
])
def test_generate_rejects_bad_arguments(folder, tmp_path, capsys, args, match):
    argv = ["generate", "a red circle", "--outdir", str(tmp_path / "o")]
    if "--pipeline" not in args:
        argv += ["--pipeline", str(folder)]
    with pytest.raises(SystemExit) as info:
        cli_main(argv + args)
    assert match in str(info.value) + capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_benchmark_writes_one_table_with_every_method(folder, tmp_path):
    out = tmp_path / "bench.md"
    code = bench_ar_image.main(["--pipeline", str(folder), "--methods", "none", "eagle", "mulo, parallel",
                                "mulo, sequential", "mulo, reverify, exact", "eagle, its own head", "--modes", "greedy",
                                "--method-kwargs", json.dumps({"eagle, its own head": {
                                    "like": "eagle", "eagle_head": str(folder / "eagle_head")}}),
                                "--batch-sizes", "1", "2", "--speed-prompts", "1", "--quality-prompts", "1",
                                "--quality-seeds", "2", "--repeats", "1", "--threads", "1", "--out", str(out)])
    assert code == 0
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 12  # 6 cases x 2 batch sizes
    assert "Chance level" in table and "Command: `python -m mmspec.evaluation.bench_ar_image" in table
    data = json.loads(out.with_suffix(".json").read_text())
    speed = data["modes"]["greedy"]["speed"]["2"]["cases"]
    assert speed["none"]["speedup"] == pytest.approx(1.0)
    quality = data["modes"]["greedy"]["quality"]
    assert set(quality) == {"none", "eagle", "mulo, parallel", "mulo, sequential", "mulo, reverify, exact",
                            "eagle, its own head", "none, seed 2"}
    assert quality["mulo, reverify, exact"] == quality["none"]  # lossless: the same images, the same scores
    # a case drafting with a head loaded from a folder (here the pipeline's own): the same rounds
    assert speed["eagle, its own head"]["stats"]["target_calls"] == speed["eagle"]["stats"]["target_calls"]
    for name in ("none", "eagle"):  # two generation seeds, averaged, with their spread
        per_seed = quality[name]["per_seed"]
        assert len(per_seed) == 2 and quality[name]["seeds"] == 2
        assert quality[name]["geneval"] == pytest.approx(sum(s["geneval"] for s in per_seed) / 2)
    assert " ± " in rows[0] and "over 2 generation seeds" in table
    # greedy decoding is deterministic: two seeds give the same images, a seed distance of 0 in every row
    assert "seed distance |" in table and all(quality[name]["seed_distance"] == 0.0 for name in ("none", "eagle"))
    # what each case ran as, per batch: the stored settings (this tiny folder stores none: the class defaults)
    assert data["configs"]["greedy"]["1"]["eagle"] == {"config": "EagleConfig", **EagleConfig().to_dict()}
    assert data["configs"]["greedy"]["2"]["mulo, parallel"]["resample"] == "parallel"
    assert data["cases"]["eagle"] == {} and data["configs"]["greedy"]["1"]["none"] is None
    mulo_calls = speed["mulo, parallel"]["stats"]["target_calls"]
    assert mulo_calls == 3 * (1 + 8 // 2)  # 6 prompts in 3 calls: prefill + one pass per block of 2 rows
    assert speed["mulo, sequential"]["stats"]["target_calls"] > mulo_calls  # redrawn columns cost calls


def test_benchmark_case_heads_replace_the_head_that_drafts(folder, tmp_path):
    """A case's ``eagle_head`` folder: a plain head replaces the eagle_head (and no block head drafts), a
    head with K futures replaces the eagle_block_head; both are restored afterwards."""
    from mmspec.models.eagle import EagleHead
    from mmspec.pipelines import ARImagePipeline

    pipe = ARImagePipeline.from_pretrained(folder)
    plain = pipe.eagle_head
    EagleHead(**{**plain.config, "num_future": 3}).save_pretrained(tmp_path / "blocks")
    with bench_ar_image.drafting_with_head(pipe, str(folder / "eagle_head")):
        assert pipe.eagle_head is not plain and pipe.eagle_block_head is None
    with bench_ar_image.drafting_with_head(pipe, str(tmp_path / "blocks")):
        assert pipe.eagle_head is plain and pipe.eagle_block_head.config.num_future == 3
    assert pipe.eagle_head is plain and pipe.eagle_block_head is None
    with pytest.raises(SystemExit, match="no EAGLE head"):
        with bench_ar_image.drafting_with_head(pipe, str(tmp_path / "missing")):
            pass



def test_benchmark_case_mulo_models_replace_the_drafter_and_up_sampler(folder, tmp_path):
    """A case's ``mulo_models`` pipeline folder: its MuLo drafter and up-sampler draft while the case runs (the
    pipeline's own pair is restored afterwards), and a case run with the pipeline's own pair saved elsewhere
    gives the same images as the pipeline's; a folder without the pair, or with a pair that does not fit the target, is a clear error."""
    from mmspec.pipelines import ARImagePipeline

    pipe = ARImagePipeline.from_pretrained(folder)
    own = (pipe.mulo_drafter, pipe.mulo_upsampler)
    pipe.mulo_drafter.save_pretrained(tmp_path / "pair" / "mulo_drafter")
    pipe.mulo_upsampler.save_pretrained(tmp_path / "pair" / "mulo_upsampler")
    with bench_ar_image.drafting_with_mulo(pipe, str(tmp_path / "pair")):
        assert pipe.mulo_drafter is not own[0] and pipe.mulo_upsampler is not own[1]
        assert pipe.mulo_drafter.dtype == pipe.transformer.dtype
    assert (pipe.mulo_drafter, pipe.mulo_upsampler) == own
    mode = {"do_sample": True, "temperature": 1.0}
    theirs, _ = bench_ar_image.generate(pipe, ["a red circle"], "mulo", {"mulo_models": str(tmp_path / "pair")},
                                        mode, 1, 0)
    mine, _ = bench_ar_image.generate(pipe, ["a red circle"], "mulo", {}, mode, 1, 0)
    np.testing.assert_array_equal(theirs[0], mine[0])
    with pytest.raises(SystemExit, match="no MuLo drafter and up-sampler"):
        with bench_ar_image.drafting_with_mulo(pipe, str(tmp_path / "missing")):
            pass
    upsampler = pipe.mulo_upsampler
    pipe.mulo_drafter.save_pretrained(tmp_path / "misfit" / "mulo_drafter")
    type(upsampler)(**{**upsampler.config, "vocab_size": upsampler.config.vocab_size + 1}).save_pretrained(
        tmp_path / "misfit" / "mulo_upsampler")
    with pytest.raises(SystemExit, match="does not fit the pipeline's target: .*vocab_size"):
        with bench_ar_image.drafting_with_mulo(pipe, str(tmp_path / "misfit")):
            pass
    assert (pipe.mulo_drafter, pipe.mulo_upsampler) == own


@pytest.mark.parametrize("layout", ["file", "under_a_file", "read_only"])
def test_generate_checks_the_outdir_before_loading_anything(tmp_path, capsys, monkeypatch, layout):
    """A bad ``--outdir`` ends the command before the pipeline loads (no run is wasted), naming the folder."""
    import os

    from mmspec.pipelines import generate_cli

    loads = []
    monkeypatch.setattr(generate_cli, "load_pipeline", lambda *args, **kwargs: loads.append(args))
    target, expected = {"file": (tmp_path / "taken", "is a file, not a folder"),
                        "under_a_file": (tmp_path / "taken" / "sub", "cannot be created"),
                        "read_only": (tmp_path / "locked" / "sub", "is not writable")}[layout]
    (tmp_path / "taken").write_text("x")
    (tmp_path / "locked").mkdir(mode=0o500)
    if layout == "read_only" and os.access(tmp_path / "locked", os.W_OK):
        pytest.skip("this user writes into read-only folders (root)")
    with pytest.raises(SystemExit) as info:
        cli_main(["generate", "a red circle", "--outdir", str(target)])
    assert f"--outdir {target}" in str(info.value) and expected in str(info.value)
    assert loads == []
    assert (tmp_path / "taken").read_text() == "x" and not (tmp_path / "locked" / "sub").exists()


def test_generate_help_gives_every_option_help_and_its_default_and_the_lossless_methods(capsys):
    from mmspec.cli import build_parser
    from mmspec.pipelines.generate_cli import lossless_methods

    with pytest.raises(SystemExit):
        cli_main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert set(lossless_methods()) == {"none", "eagle", "sjd", "scd", "sjd_pac"}
    assert "lossless (exactly the target's distribution): none, eagle, scd, sjd" in text
    sub = next(action for action in build_parser("generate")._actions if action.dest == "command").choices["generate"]
    for action in sub._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings or action.dest} has no help"
        if action.option_strings and action.nargs != 0:  # a value option states its default
            assert "default" in action.help, f"{action.option_strings} does not state its default"


def test_generate_without_accelerate_prints_no_low_memory_warning(tmp_path, folder):
    """Without accelerate the pipelines load with ``low_cpu_mem_usage=False`` by default, so diffusers does not
    warn once per model that it falls back."""
    import subprocess
    import sys

    script = (
        "import importlib.machinery, sys\n"
        "find = importlib.machinery.PathFinder.find_spec\n"
        "def hide(*args, **kwargs):\n"
        "    args = [a for a in args if not isinstance(a, importlib.machinery.PathFinder)]\n"
        "    return None if args[0].split('.')[0] == 'accelerate' else find(*args, **kwargs)\n"
        "importlib.machinery.PathFinder.find_spec = hide\n"
        "from mmspec.cli import main\n"
        "from mmspec.pipelines.hub import LoadOptions\n"
        "assert 'accelerate' not in sys.modules and LoadOptions().low_cpu_mem_usage is False\n"
        "sys.exit(main(sys.argv[1:]))\n")
    result = subprocess.run([sys.executable, "-c", script, "generate", "a red circle", "--pipeline", str(folder),
                             "--outdir", str(tmp_path / "out"), "--repeats", "1", "--no-baseline", "--greedy"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "accelerate" not in result.stderr and "wrote 1 images" in result.stdout
