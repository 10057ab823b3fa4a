"""The README's results table: every figure is the one `python -m mmspec.evaluation.readme_results` measured
and stored in docs/benchmarks/readme_results.json, on a quiet machine."""

from __future__ import annotations

import json

import pytest

from mmspec.evaluation import readme_results
from mmspec.evaluation.readme_results import (
    BEGIN,
    END,
    README,
    RESULTS_JSON,
    SECTIONS,
    render_table,
    replace_block,
    section_rows,
)
from mmspec.evaluation.speed import MachineLoad


def _case(speedup: float, compression: float, efficiency: float) -> dict:
    return {"speedup": speedup, "paired_speedup_range": [speedup - 0.1, speedup + 0.1],
            "ideal_speedup": compression, "breakdown": {"efficiency": efficiency}}


def test_every_readme_figure_is_the_json_s():
    results = json.loads(RESULTS_JSON.read_text())
    text = README.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")
    assert block == render_table(results)  # the README's table is exactly the JSON's rows
    assert [row["method"] for row in results["rows"]] == [label for s in SECTIONS.values() for label, _ in s.rows]


def test_published_results_come_from_quiet_runs():
    results = json.loads(RESULTS_JSON.read_text())
    assert set(results["sections"]) == set(SECTIONS)
    for name, section in results["sections"].items():
        load = MachineLoad(**section["load"])
        assert load.contended is False, f"section {name} was measured on a busy machine: {load.describe()}"
        assert load.threads == 1


def test_rows_are_read_from_the_benchmark_json():
    data = {"results": {"image / temperature_0 / batch 1": {"cases": {
        "flash": _case(3.0, 8.0, 0.95), "vispec": _case(2.5, 9.0, 0.9), "eagle": _case(2.4, 8.5, 0.92),
        "specvlm": _case(2.3, 8.0, 0.91), "draft_vlm": _case(2.0, 7.0, 0.97)}}}}
    rows = section_rows("vlm", data)
    assert [r["method"] for r in rows] == ["FLASH", "ViSpec", "EAGLE", "SpecVLM", "standalone draft VLM"]
    assert rows[0] | {"quality": None} == {"section": "vlm", "pipeline": SECTIONS["vlm"].pipeline, "method": "FLASH",
                                           "speedup": 3.0, "range": [2.9, 3.1], "compression": 8.0,
                                           "efficiency": 0.95, "quality": None}
    assert rows[0]["quality"] == {"text": "lossless"}
    video = section_rows("video", {"benchmark": {"cases": {"sdvg": _case(1.5, 3.0, 0.8)}}})
    assert video[0]["compression"] is None and video[0]["efficiency"] is None  # block routing: no round bound
    assert "per-frame score" in video[0]["quality"]["text"] and video[0]["quality"]["source"].endswith(".json")
    with pytest.raises(KeyError, match="no 'vispec'"):
        section_rows("vlm", {"results": {"image / temperature_0 / batch 1": {"cases": {"flash": _case(3, 8, 1)}}}})


def test_render_and_replace_the_readme_block():
    load = {"seconds": 60.0, "other_cores": 0.02, "load_average": 1.0, "cores": 2, "threads": 1}
    rows = [{"pipeline": "P", "method": "A", "speedup": 2.0, "range": [1.9, 2.1], "compression": 4.0,
             "efficiency": 0.93, "quality": {"text": "lossless"}},
            {"pipeline": "P", "method": "B", "speedup": 1.5, "range": None, "compression": None,
             "efficiency": None, "quality": {"text": "score 0.8 (target 0.8)"}}]
    table = render_table({"date": "2026-12-08", "command": "python -m x", "rows": rows,
                          "sections": {"vlm": {"load": load}}})
    assert "| P | A | 2.00x (1.90-2.10) | 4.00 | 0.93 | lossless |" in table
    assert "|  | B | 1.50x | - | - | score 0.8 (target 0.8) |" in table  # one pipeline cell per group
    assert "vlm: quiet: other processes used 0.02 cores" in table
    text = f"intro\n{BEGIN}\nold\n{END}\noutro\n"
    assert replace_block(text, "new") == f"intro\n{BEGIN}\nnew\n{END}\noutro\n"
    with pytest.raises(ValueError, match="no results markers"):
        replace_block("no markers here", "new")


def test_a_section_runs_its_benchmark_with_its_arguments(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results, "SECTION_FOLDER", tmp_path)
    seen = []

    def runner(module, argv):
        seen.append((module, argv))
        (tmp_path / "continuous.json").write_text(json.dumps({"load": {}, "speed": {}}))
        return 0

    data = readme_results.run_section("continuous", force=True, runner=runner)
    assert data == {"load": {}, "speed": {}}
    module, argv = seen[0]
    assert module == "bench_continuous" and argv[-3:] == ["--out", str(tmp_path / "continuous.md"), "--force-contended"]
    assert list(SECTIONS["continuous"].arguments) == argv[:-3]


def test_the_spread_table_gives_each_row_s_runs_and_their_spread():
    from mmspec.evaluation.readme_results import spread_table

    def rows(a, b):
        return [{"pipeline": "P", "method": "A", "speedup": a}, {"pipeline": "P", "method": "B", "speedup": b}]

    table = spread_table([rows(2.0, 1.5), rows(2.2, 1.5), rows(2.1, 1.5)])
    assert "| P | A | 2.00x | 2.20x | 2.10x | 10% |" in table and "| P | B | 1.50x | 1.50x | 1.50x | 0% |" in table
