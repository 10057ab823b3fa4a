"""`mmspec generate` and the AR image benchmark script, end to end on a tiny saved pipeline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_shapes_pipeline import save_tiny_shapes_pipeline

from mmspec.cli import main as cli_main
from mmspec.evaluation import bench_ar_image

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


def test_generate_uses_the_fast_chain_and_the_baseline_ignores_drafting_options(folder, tmp_path, capsys,
                                                                               pipeline_calls):
    """eagle runs with the fast chain of its decoding mode and batch (FAST_EAGLE_GREEDY_CHAIN for one greedy
    image, FAST_EAGLE_CHAIN for one sampled image, the FAST_EAGLE_BATCHED_* chains for several) unless
    overridden; the target-only comparison run gets the same
    keywords and ignores the drafting ones (a threshold once made the baseline raise)."""
    assert cli_main(["generate", "a red circle", "--pipeline", str(folder), "--outdir", str(tmp_path / "a"),
                     "--greedy"]) == 0
    assert cli_main(["generate", "a red circle", "--pipeline", str(folder), "--outdir", str(tmp_path / "b"),
                     "--greedy", "--method-kwargs", '{"draft_confidence_threshold": 0.2}']) == 0
    calls = pipeline_calls
    eagle = [c for c in calls if c["method"] == "eagle"]
    assert eagle[0]["num_draft_tokens"] == 12 and eagle[0]["draft_confidence_threshold"] == 0.5
    assert eagle[-1]["draft_confidence_threshold"] == 0.2 and eagle[-1]["num_draft_tokens"] == 12
    assert any(c["method"] == "none" and c.get("draft_confidence_threshold") == 0.2 for c in calls)
    assert capsys.readouterr().out.count("speedup:") == 2
    assert cli_main(["generate", "a red circle", "--pipeline", str(folder), "--outdir", str(tmp_path / "c"),
                     "--no-baseline"]) == 0
    assert pipeline_calls[-1]["num_draft_tokens"] == 8 and pipeline_calls[-1]["do_sample"]
    assert cli_main(["generate", "a red circle", "a blue square", "--pipeline", str(folder), "--outdir",
                     str(tmp_path / "d"), "--greedy", "--no-baseline"]) == 0
    assert pipeline_calls[-1]["num_draft_tokens"] == 5  # two greedy images per call: the batched chain
    # sampled LANTERN: the measured LANTERN++ rule (lam 10 over 512 codes) unless the command line says otherwise
    assert cli_main(["generate", "a red circle", "--pipeline", str(folder), "--outdir", str(tmp_path / "e"),
                     "--method", "lantern", "--no-baseline"]) == 0
    assert pipeline_calls[-1]["lantern_lam"] == 10.0 and pipeline_calls[-1]["lantern_k"] == 512
    assert cli_main(["generate", "a red circle", "--pipeline", str(folder), "--outdir", str(tmp_path / "f"),
                     "--method", "lantern", "--no-baseline", "--method-kwargs", '{"lantern_lam": 3.0}']) == 0
    assert pipeline_calls[-1]["lantern_lam"] == 3.0


def test_fast_settings_depend_on_the_decoding_mode():
    from mmspec.pipelines.ar_image import (
        FAST_EAGLE_BATCHED_CHAIN,
        FAST_EAGLE_BATCHED_GREEDY_CHAIN,
        FAST_EAGLE_BLOCK_GREEDY_CHAIN,
        FAST_EAGLE_CHAIN,
        FAST_EAGLE_GREEDY_CHAIN,
        FAST_LANTERN_ARGMAX_BLOCK_CHAIN,
        FAST_LANTERN_BATCHED_CHAIN,
        FAST_LANTERN_RULE,
        fast_method_kwargs,
    )

    # sampling with a block head: EAGLE drafts sampled tokens one by one, LANTERN argmax blocks
    assert fast_method_kwargs("eagle", greedy=False, num_future=4) == FAST_EAGLE_CHAIN
    assert fast_method_kwargs("lantern", greedy=False, num_future=4) == {**FAST_LANTERN_ARGMAX_BLOCK_CHAIN,
                                                                           **FAST_LANTERN_RULE}
    assert FAST_LANTERN_ARGMAX_BLOCK_CHAIN == {"argmax_drafts": True, **FAST_EAGLE_BLOCK_GREEDY_CHAIN}
    # no block head: sampled drafts; LANTERN samples with the wide LANTERN++ rule, capped by a small codebook
    assert fast_method_kwargs("lantern", greedy=False, num_future=1) == {**FAST_EAGLE_CHAIN, **FAST_LANTERN_RULE}
    assert FAST_LANTERN_RULE == {"lantern_k": 512, "lantern_lam": 10.0}
    assert fast_method_kwargs("lantern", greedy=False, vocab_size=64)["lantern_k"] == 63
    assert fast_method_kwargs("lantern", greedy=False, vocab_size=4096)["lantern_k"] == 512
    for num_future in (1, 4):  # several images: argmax drafts token by token, longer chains than EAGLE's
        assert fast_method_kwargs("lantern", greedy=False, batch_size=4, num_future=num_future) == \
            {**FAST_LANTERN_BATCHED_CHAIN, **FAST_LANTERN_RULE}
    assert FAST_LANTERN_BATCHED_CHAIN["argmax_drafts"] is True
    assert FAST_LANTERN_BATCHED_CHAIN["num_draft_tokens"] > FAST_EAGLE_BATCHED_CHAIN["num_draft_tokens"]
    for method in ("eagle", "lantern"):  # greedy LANTERN keeps the pipeline's rule (its relaxed greedy is lossy)
        assert fast_method_kwargs(method, greedy=True, num_future=4) == FAST_EAGLE_BLOCK_GREEDY_CHAIN
        assert fast_method_kwargs(method, greedy=True) == FAST_EAGLE_GREEDY_CHAIN
        assert fast_method_kwargs(method, greedy=True, batch_size=4) == FAST_EAGLE_BATCHED_GREEDY_CHAIN
    assert fast_method_kwargs("eagle", greedy=False) == FAST_EAGLE_CHAIN
    assert fast_method_kwargs("eagle", greedy=False, batch_size=2) == FAST_EAGLE_BATCHED_CHAIN
    # the chains get shorter as the forward gets compute-bound: greedy single image > sampling > batches;
    # a block's later drafts are less sure, so block chains stop at a lower confidence
    assert (FAST_EAGLE_BLOCK_GREEDY_CHAIN["draft_confidence_threshold"]
            < FAST_EAGLE_GREEDY_CHAIN["draft_confidence_threshold"])
    assert (FAST_EAGLE_GREEDY_CHAIN["num_draft_tokens"] > FAST_EAGLE_CHAIN["num_draft_tokens"]
            > FAST_EAGLE_BATCHED_GREEDY_CHAIN["num_draft_tokens"] > FAST_EAGLE_BATCHED_CHAIN["num_draft_tokens"])
    # one greedy image with a block head: one block, then a lookup tail (free copies); not with several images
    assert FAST_EAGLE_BLOCK_GREEDY_CHAIN["lookup_tail"] > 0 and FAST_EAGLE_BLOCK_GREEDY_CHAIN["num_draft_tokens"] == 4
    assert all("lookup_tail" not in chain for chain in (FAST_EAGLE_BATCHED_GREEDY_CHAIN, FAST_EAGLE_BATCHED_CHAIN,
                                                         FAST_EAGLE_CHAIN, FAST_EAGLE_GREEDY_CHAIN))
    assert fast_method_kwargs("sjd", greedy=True) == fast_method_kwargs("sjd") == {"sjd_window": 8, "sjd_init": "left"}
    assert fast_method_kwargs("none", greedy=True) == {}
    fast_method_kwargs("eagle")["num_draft_tokens"] = 99  # a fresh dict: the table is not changed
    assert FAST_EAGLE_CHAIN["num_draft_tokens"] == 8
    greedy, sampling = bench_ar_image.default_kwargs(greedy=True), bench_ar_image.default_kwargs(greedy=False)
    assert greedy["lantern"]["num_draft_tokens"] == 12 and sampling["lantern"]["num_draft_tokens"] == 8
    assert greedy["lantern"]["lantern_delta"] == sampling["lantern"]["lantern_delta"] == 0.2
    # LANTERN++ is the same drafter and chain with the multiplicative bound instead of the TV budget, over a
    # wider neighbourhood (the fastest bound whose quality and seed diversity held on the zoo)
    assert sampling["lantern++"]["method"] == "lantern" and sampling["lantern++"]["lantern_lam"] == 10.0
    assert sampling["lantern++"]["lantern_k"] == 512 and sampling["lantern"]["lantern_k"] == 64
    assert sampling["lantern++"]["num_draft_tokens"] == sampling["lantern"]["num_draft_tokens"]
    sampled_blocks = bench_ar_image.default_kwargs(greedy=False, num_future=4)
    assert sampled_blocks["eagle"] == FAST_EAGLE_CHAIN and "argmax_drafts" not in sampled_blocks["eagle"]
    for case in ("lantern", "lantern++"):
        assert sampled_blocks[case]["argmax_drafts"] is True
        assert bench_ar_image.default_kwargs(greedy=False, batch_size=4, num_future=4)[case]["num_draft_tokens"] == 4
    blocks = bench_ar_image.default_kwargs(greedy=True, num_future=4)
    assert blocks["eagle"] == FAST_EAGLE_BLOCK_GREEDY_CHAIN
    assert blocks["lantern"]["num_draft_tokens"] == FAST_EAGLE_BLOCK_GREEDY_CHAIN["num_draft_tokens"]


def test_generate_runs_jacobi_methods_with_their_fast_window(folder, tmp_path, pipeline_calls):
    """sjd and gsd get FAST_METHOD_KWARGS (window 8, left-neighbour initialisation; GSD's group) unless
    --method-kwargs overrides a key."""
    for method in ("sjd", "gsd"):
        assert cli_main(["generate", "a red circle", "--pipeline", str(folder), "--outdir", str(tmp_path / method),
                         "--method", method, "--no-baseline", "--method-kwargs", '{"sjd_window": 4}']) == 0
    sjd, gsd = ([c for c in pipeline_calls if c["method"] == m][-1] for m in ("sjd", "gsd"))
    assert sjd["sjd_init"] == "left" and sjd["sjd_window"] == 4 and "gsd_group_size" not in sjd
    assert gsd["sjd_init"] == "left" and gsd["gsd_group_size"] == 6 and gsd["gsd_prob_threshold"] == 1.0


@pytest.mark.parametrize("args,match", [
    (["--method", "medusa"], "invalid choice"),
    (["--method-kwargs", "{oops"], "not valid JSON"),
    (["--pipeline", "mmspec/no-such-entry"], "cannot load"),
    (["--method-kwargs", '{"lantern_delta": -1}', "--method", "lantern"], "error:"),
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
    code = bench_ar_image.main(["--pipeline", str(folder), "--methods", "none", "eagle", "mulo", "mulo, sequential",
                                "mulo, reverify, exact", "eagle, its own head", "--modes", "greedy",
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
    assert set(quality) == {"none", "eagle", "mulo", "mulo, sequential", "mulo, reverify, exact",
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
    # the fast chain of the mode and batch: longer for greedy decoding of one image at a time
    assert data["kwargs"]["greedy"]["1"]["eagle"]["num_draft_tokens"] == 12
    assert data["kwargs"]["greedy"]["2"]["eagle"]["num_draft_tokens"] == 5
    mulo_calls = speed["mulo"]["stats"]["target_calls"]
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
