"""The image benchmarks' shared quality helpers (``mmspec.evaluation.bench_images``)."""

from __future__ import annotations

import numpy as np
import pytest

from mmspec.evaluation import bench_ar_image, bench_continuous
from mmspec.evaluation.bench_images import (
    mean_quality,
    score_cell,
    seed_distance,
    seed_distance_cell,
    seed_distance_columns,
    spread_note,
)


def test_mean_quality_averages_seeds_and_states_their_spread():
    out = mean_quality([{"geneval": 0.80, "fid": 300.0}, {"geneval": 0.86, "fid": 320.0},
                        {"geneval": 0.83, "fid": 310.0}])
    assert out["geneval"] == pytest.approx(0.83) and out["fid"] == pytest.approx(310.0)
    assert out["geneval_sd"] == pytest.approx(0.03) and out["fid_sd"] == pytest.approx(10.0)  # sample sd
    assert out["seeds"] == 3 and [s["fid"] for s in out["per_seed"]] == [300.0, 320.0, 310.0]


def test_mean_quality_of_one_seed_has_no_spread():
    out = mean_quality([{"geneval": 0.5, "fid": 12.0}])
    assert out["geneval"] == 0.5 and out["geneval_sd"] == 0.0 and out["seeds"] == 1


def test_mean_quality_needs_a_seed():
    with pytest.raises(ValueError, match="at least one seed"):
        mean_quality([])


def test_seed_distance_is_zero_for_identical_seeds_and_the_mean_pixel_gap_otherwise():
    rng = np.random.default_rng(0)
    images = rng.random((5, 4, 4, 3)).astype(np.float32)
    assert seed_distance([images, images.copy()]) == 0.0  # a deterministic sampler: no diversity
    shifted = np.clip(images + 0.25, 0.0, 1.0)
    expected = np.abs(shifted - images).mean()
    # three seeds: the mean over the pairs (0,1), (0,2), (1,2); seeds 0 and 2 are the same images
    assert seed_distance([images, shifted, images]) == pytest.approx(2 * expected / 3, rel=1e-6)


def test_seed_distance_column_only_for_runs_with_several_seeds():
    several = [{"geneval": 0.8, "seed_distance": 0.11}, {"geneval": 0.7}]  # a chance row has one seed
    assert seed_distance_columns(several) == (" seed distance |", "---|")
    assert seed_distance_columns([{"geneval": 0.8}]) == ("", "")
    assert seed_distance_cell(several[0], shown=True) == " 0.1100 |"
    assert seed_distance_cell(several[1], shown=True) == " - |" and seed_distance_cell(several[0], shown=False) == ""


def test_seed_distance_refuses_one_seed_or_different_prompt_sets():
    images = np.zeros((3, 4, 4, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="at least two seeds"):
        seed_distance([images])
    with pytest.raises(ValueError, match="same prompts and image size"):
        seed_distance([images, images[:2]])


@pytest.mark.parametrize("bench", [bench_ar_image, bench_continuous])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_benchmarks_reject_non_positive_quality_seeds(bench, value, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quality-seeds", value])
    assert "--quality-seeds: must be >= 1" in capsys.readouterr().err


def test_quality_cells_show_the_spread_only_for_several_seeds():
    one = {"geneval": 0.8333, "fid": 301.234, "seeds": 1, "geneval_sd": 0.0, "fid_sd": 0.0}
    three = {**one, "seeds": 3, "geneval_sd": 0.0123}
    assert score_cell(one, "geneval", 3) == "0.833"
    assert score_cell(three, "geneval", 3) == "0.833 ± 0.012"
    assert score_cell({"geneval": 0.5, "fid": 1.0}, "fid", 2) == "1.00"  # older results: no seeds key
    assert spread_note({"quality_seeds": 3}) == ", mean ± standard deviation over 3 generation seeds"
    assert spread_note({}) == ""


def test_derived_cases_run_variants_of_a_method_under_their_own_names():
    """bench_ar_image's ``{"like": CASE, ...}``: a case not in the defaults inherits CASE's keywords and
    pipeline method; elsewhere (and for unknown names) the method list stays closed."""
    from mmspec.evaluation.bench_cli import method_kwargs

    defaults = bench_ar_image.default_cases()
    overrides = ('{"eagle, K=6": {"like": "eagle", "num_draft_tokens": 6}, "lam 3": {"like": "lantern++", '
                 '"lam": 3.0}, "eagle": {"draft_confidence_threshold": 0.2}}')
    out = method_kwargs(["none", "eagle", "eagle, K=6", "lam 3"], defaults, overrides, derived_cases=True)
    assert out["eagle, K=6"] == {**defaults["eagle"], "method": "eagle", "num_draft_tokens": 6}
    assert out["lam 3"]["method"] == "lantern" and out["lam 3"]["lam"] == 3.0  # lantern++'s own method
    assert out["eagle"]["draft_confidence_threshold"] == 0.2 and "method" not in out["eagle"]
    # a variant of the baseline (here: target-only in float32 beside a bfloat16 run) is a case like any other
    variant = method_kwargs(["none", "none, float32"], defaults, '{"none, float32": {"like": "none", "dtype": "float32"}}',
                            derived_cases=True)
    assert variant["none, float32"] == {"method": "none", "dtype": "float32"} and variant["none"] == {}
    for methods, text, match in ((["none", "eagle, K=6"], "{}", "unknown methods"),
                                 (["none", "x"], '{"x": {"like": "medusa"}}', "unknown 'like' case 'medusa'")):
        with pytest.raises(SystemExit, match=match):
            method_kwargs(methods, defaults, text, derived_cases=True)
    with pytest.raises(SystemExit, match="unknown methods"):  # without derived cases 'like' is not read
        method_kwargs(["none", "x"], defaults, '{"x": {"like": "eagle"}}')
    with pytest.raises(SystemExit, match="must be a JSON object"):
        method_kwargs(["none"], defaults, '{"eagle": 3}', derived_cases=True)


def test_recorded_command_line_can_be_pasted_into_a_shell():
    """Case names with spaces and JSON keywords come back as the same argv when the shell splits the line."""
    import shlex

    from mmspec.evaluation.bench_cli import command_line

    argv = ["--methods", "none", "eagle, argmax drafts", "--method-kwargs",
            '{"eagle, argmax drafts": {"like": "eagle", "argmax_drafts": true}}']
    line = command_line("mmspec.evaluation.bench_ar_image", argv)
    assert shlex.split(line) == ["python", "-m", "mmspec.evaluation.bench_ar_image", *argv]
