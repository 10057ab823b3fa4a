"""The shapes-vlm zoo assembly (models/recipes/build_zoo_vlm.py) and the VLM benchmark (evaluation/bench_vlm.py)
on tiny random parts: the assembled folder loads as a VLMPipeline whose chat template formats plain prompts
exactly like the captioner's training prompts, and the benchmark writes one table in which every lossless
method matches target-only decoding at temperature 0, its stored-settings rows running the settings the
assembly wrote into the folder."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec.models import shapes_vlm as sv
from mmspec.models.recipes import build_zoo_vlm
from mmspec.models.vlm_drafters import EagleVLMHead, FlashHead, SpecVLMHead, ViSpecHead

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def zoo_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoo") / "shapes-vlm"
    target = sv.build_model("tiny", seed=0)
    target.to(torch.float16).save_pretrained(folder / "target")
    sv.build_processor().save_pretrained(folder / "target")
    sv.build_model("tiny", seed=1, text_layers=1).to(torch.float16).save_pretrained(folder / "draft")
    sv.build_processor().save_pretrained(folder / "draft")  # as train_vlm writes it
    width, vocab = target.config.text_config.hidden_size, target.get_output_embeddings().weight.shape[0]
    torch.manual_seed(0)
    for name, head in {"eagle_head": EagleVLMHead(width, vocab), "flash_head": FlashHead(width, vocab, num_latents=8),
                       "vispec_head": ViSpecHead(width, vocab), "specvlm_head": SpecVLMHead(width, vocab)}.items():
        head.to(torch.float16).save_pretrained(folder / name)
    build_zoo_vlm.main(["--folder", str(folder)])
    return folder


def test_zoo_folder_loads_with_the_training_prompt_format(zoo_folder):
    from mmspec.pipelines import VLMPipeline

    pipe = VLMPipeline.from_pretrained(zoo_folder)
    assert pipe.target.dtype == torch.float32  # fp16 on disk, fp32 compute
    assert all(getattr(pipe, n) is not None for n in ("eagle_head", "flash_head", "vispec_head", "specvlm_head",
                                                      "draft_model"))
    assert pipe.format_prompt("describe the image in detail.", 1) == sv.task_prompt("describe")
    assert pipe.format_prompt("narrate the video.", 4) == sv.task_prompt("narrate", num_frames=4)
    stored = json.loads((zoo_folder / "speculation_config.json").read_text())
    assert stored == build_zoo_vlm.SPECULATION_SETTINGS == pipe.speculation_settings.to_dict()
    assert pipe.method_config("flash").num_draft_tokens == 15 and pipe.method_config("draft_vlm").num_draft_tokens == 10
    assert pipe.method_config("flash", batch_size=4).num_draft_tokens == 10


def test_rebuilding_an_assembled_folder_keeps_every_part(zoo_folder, tmp_path):
    """Retrained heads go into an assembled folder and build_zoo_vlm runs again (scripts/build_zoo_vlm.sh,
    docs): the draft then comes from draft_model/, whose processor files must survive the rebuild."""
    import shutil

    folder = tmp_path / "shapes-vlm"
    shutil.copytree(zoo_folder, folder)
    for name in ("target", "draft_model"):
        assert sv.load_processor(folder / name).tokenizer.padding_side == "left"
    build_zoo_vlm.main(["--folder", str(folder)])
    for name in ("target", "draft_model"):
        assert sv.load_processor(folder / name).tokenizer.padding_side == "left"
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in zoo_folder.iterdir())
    # every part stays fp16 on disk (the heads too: they load in fp32 unless asked otherwise)
    from safetensors import safe_open

    for weights in folder.glob("*/*.safetensors"):
        with safe_open(weights, "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}, weights
    # diffusers records where a component was loaded from; the zoo keeps no such build-local paths
    for config in folder.glob("*/config.json"):
        assert "_name_or_path" not in json.loads(config.read_text()), config


@pytest.mark.slow
def test_benchmark_table(zoo_folder, tmp_path):
    from mmspec.evaluation import bench_vlm

    out = tmp_path / "vlm.md"
    bench_vlm.main(["--pipeline", str(zoo_folder), "--examples", "2", "--max-new-tokens", "8", "--repeats", "1",
                    "--batch-sizes", "1", "2", "--modes", "temperature_0", "--tasks", "image", "video",
                    "--threads", "1", "--out", str(out)])
    table = out.read_text()
    for name in ("none", "eagle", "flash", "vispec", "specvlm", "draft_vlm", "hf_generate", "hf_assisted",
                 "hf_prompt_lookup", "eagle (reference)", "draft_vlm (reference)"):
        assert f"| {name} |" in table
    assert "| time spread |" in table and "| 0 % |" in table  # one repeat: no spread
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert set(results) == {f"{t} / temperature_0 / batch {b}" for t in ("image", "video") for b in (1, 2)}
    for key, report in results.items():
        cases = report["cases"]
        assert cases["none"]["speedup"] == pytest.approx(1.0)
        for name, case in cases.items():  # greedy: every method is exactly target-only (accuracy equal)
            assert case["quality"]["accuracy"] == cases["none"]["quality"]["accuracy"], name
        assert cases["eagle"]["mean_accepted_length"] >= 1.0
        configs = report["configs"]  # the stored rows ran the folder's settings, the reference rows the constants
        assert configs["none"] is None
        one = key.endswith("batch 1")
        assert configs["flash (reference)"] == {"config": "FlashConfig", "num_draft_tokens": 10, "tree": None,
                                                "draft_confidence_threshold": 0.0}
        assert configs["flash"]["num_draft_tokens"] == (15 if one else 10)  # batch 1 has its own stored K
        assert configs["draft_vlm"]["num_draft_tokens"] == (10 if one else 8)


def test_bad_arguments(zoo_folder):
    from mmspec.evaluation import bench_vlm

    with pytest.raises(SystemExit, match="must start with none"):
        bench_vlm.main(["--pipeline", str(zoo_folder), "--methods", "eagle"])
    with pytest.raises(SystemExit, match="unknown methods"):
        bench_vlm.main(["--pipeline", str(zoo_folder), "--methods", "none", "medusa"])
    variant = '{"eagle, K=6": {"like": "eagle", "num_draft_tokens": 6, "lantern_k": 3}}'
    with pytest.raises(SystemExit, match=r"case 'eagle, K=6' sets 'lantern_k', which is neither a field of "
                                         r"VLMEagleConfig"):
        bench_vlm.main(["--pipeline", str(zoo_folder), "--methods", "none", "eagle, K=6", "--method-kwargs", variant])
    with pytest.raises(SystemExit, match="FlashConfig.tree must be None"):
        bench_vlm.main(["--pipeline", str(zoo_folder), "--methods", "none", "flash", "--method-kwargs",
                        '{"flash": {"tree": {"depth": 4, "top_k": 2, "total_tokens": 8}}}'])


def test_benchmark_cases_are_lossless_at_temperature_0(zoo_folder):
    from mmspec.evaluation import bench_vlm
    from mmspec.pipelines import VLMPipeline

    pipe = VLMPipeline.from_pretrained(zoo_folder)
    pipe.set_progress_bar_config(disable=True)
    examples = bench_vlm.task_examples("image", 3, seed=0)
    mode = bench_vlm.MODES["temperature_0"]
    outputs = {case: bench_vlm.pipeline_case(pipe, examples, bench_vlm.case_method(pipe, case, spec, mode, 2), mode, 2,
                                             12, 0)().output for case, spec in bench_vlm.default_cases().items()}
    assert len(outputs) == 11
    assert len({len(t.split()) for t in outputs["none"]} | {0}) > 1  # real text, not empty rows
    for method, texts in outputs.items():
        assert texts == outputs["none"], method


def test_cases_resolve_to_the_stored_settings_or_explicit_configs(zoo_folder):
    """A case without fields passes the method's name (the stored settings, as a user's call); a reference
    case the former constants; config fields (a tree as JSON) apply over the stored settings."""
    from mmspec.drafters import TreeConfig
    from mmspec.evaluation import bench_vlm
    from mmspec.methods.vlm_heads import ViSpecConfig
    from mmspec.pipelines import VLMPipeline

    pipe = VLMPipeline.from_pretrained(zoo_folder)
    mode = bench_vlm.MODES["temperature_1"]
    assert bench_vlm.case_method(pipe, "vispec", {}, mode, 4) == "vispec"
    reference = bench_vlm.case_method(pipe, "vispec (reference)", {"method": "vispec", "reference": True}, mode, 4)
    assert reference == bench_vlm.REFERENCE_CONFIGS["vispec"] == ViSpecConfig(num_draft_tokens=10)
    tree = bench_vlm.case_method(pipe, "vispec, tree", {"method": "vispec", "tree": {"depth": 4, "top_k": 2,
                                                                                     "total_tokens": 8}}, mode, 1)
    assert tree == ViSpecConfig(num_draft_tokens=10, tree=TreeConfig(depth=4, top_k=2, total_tokens=8))
    with pytest.raises(SystemExit, match="runs target-only decoding, which has no settings"):
        bench_vlm.case_method(pipe, "none", {"num_draft_tokens": 4}, mode, 1)


def test_tree_keywords_from_the_command_line():
    from mmspec.drafters import TreeConfig
    from mmspec.evaluation.bench_cli import call_kwargs

    kwargs = {"num_draft_tokens": 6, "tree": {"depth": 4, "top_k": 2, "total_tokens": 8}}
    converted = call_kwargs(kwargs)
    assert converted["tree"] == TreeConfig(depth=4, top_k=2, total_tokens=8) and kwargs["tree"]["depth"] == 4
    with pytest.raises(SystemExit, match="bad tree"):
        call_kwargs({"tree": {"depht": 4}})


def test_exact_rule_keyword_from_the_command_line():
    from mmspec.evaluation.bench_cli import call_kwargs
    from mmspec.rules import ExactRule, GreedyRule

    assert isinstance(call_kwargs({"rule": "exact"})["rule"], ExactRule)
    assert isinstance(call_kwargs({"rule": "exact"}, greedy=True)["rule"], GreedyRule)
    with pytest.raises(SystemExit, match="rule must be"):
        call_kwargs({"rule": "pooled"})
