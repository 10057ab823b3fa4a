"""The demo's tab functions (demos/, ``mmspec.demos``) without a browser, on tiny random pipelines saved to
a temp folder (``mmspec.demos.tiny``) and, for the AR image tab, the bundled zoo when it is built.

What is shown: each tab runs the speculative method and the target-only baseline with the same seed (a
greedy lossless run reproduces the baseline; SDVG with tau = +inf reproduces it pixel for pixel; the
shared comparison hands both runs identically seeded generators), reports wall time / speedup / mean
accepted length / target calls, draws acceptance maps that follow the drafted mask, streams VLM text
whose highlighted pieces are exactly the accepted draft tokens, and turns bad input (no image, unreadable
file, unknown checkpoint path, missing zoo entry, parameters out of range) into messages that name the
problem. The gradio page is built and its handlers return those messages instead of raising."""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch

from mmspec.demos import ar_image_tab, common, continuous_tab, timing, video_tab, vlm_tab
from mmspec.demos.common import DemoError, PipelineCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def requested_passes_only(monkeypatch):
    """These tests check the timing protocol, not the machine: no extra passes for short calls (the tiny
    pipelines' calls take milliseconds, and would each get MAX_REPEATS)."""
    monkeypatch.setattr(timing, "MIN_TIMED_SECONDS", 0.0)

HAS_GRADIO = importlib.util.find_spec("gradio") is not None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mmspec.demos.tiny import build_tiny_pipelines

    return build_tiny_pipelines(tmp_path_factory.mktemp("demo-tiny"))


@pytest.fixture(scope="module")
def cache():
    return PipelineCache()


# ---------------------------------------------------------------------------------------------------- shared parts


def test_input_checks_name_the_field():
    assert common.check_int("K", 4.0, 1, 8) == 4
    for bad in (0, 9, 2.5, None, "", "x", True, float("inf")):
        with pytest.raises(DemoError, match="K"):
            common.check_int("K", bad, 1, 8)
    assert common.check_float("delta", 0.0, 0.0, 1.0) == 0.0
    with pytest.raises(DemoError, match=r"temperature must be a number in \(0.0, 5.0\]"):
        common.check_float("temperature", 0.0, 0.0, 5.0, low_open=True)
    with pytest.raises(DemoError, match="NaN"):
        common.check_float("tau", float("nan"), -1, 1, allow_inf=True)
    assert common.check_float("tau", "-inf", -1, 1, allow_inf=True) == -math.inf
    assert common.parse_prompts(" a red circle \n\n two blue squares ") == ["a red circle", "two blue squares"]
    with pytest.raises(DemoError, match="prompt is empty"):
        common.parse_prompts("  \n ")
    with pytest.raises(DemoError, match="at most 16 images"):
        common.check_batch(3, 6)


def _fake_output(target_calls: int, tokens: int = 64) -> SimpleNamespace:
    return SimpleNamespace(stats=SimpleNamespace(mean_accepted_length=tokens / target_calls, target_calls=target_calls,
                                                 draft_calls=0, tokens=tokens))


def test_compare_is_the_cli_protocol_with_the_same_seed_and_reports_progress():
    """Warm-up of each side, then alternating timed calls (baseline first, as the CLI's run_benchmark), each
    with a fresh generator from the same seed; the speedup is the ratio of the medians, its range paired."""
    calls, reports = [], []

    def run(method, generator, progress):
        progress(0.5)
        draw = torch.rand(3, generator=generator)
        calls.append((method, draw))
        return SimpleNamespace(stats=SimpleNamespace(mean_accepted_length=2.0, target_calls=1, draft_calls=0,
                                                     tokens=3), draw=draw)

    comparison = timing.compare(run, "eagle", 7, repeats=2, report=lambda f, text: reports.append(f),
                                min_timed_seconds=0.0)
    assert [c[0] for c in calls] == ["none", "eagle"] * 3  # warm-up pair, then two timed pairs
    assert all(torch.equal(c[1], torch.rand(3, generator=torch.Generator().manual_seed(7))) for c in calls)
    assert reports == sorted(reports) and reports[-1] == 1.0 and len(comparison.spec_times) == 2
    assert comparison.speedup == pytest.approx(statistics.median(comparison.base_times)
                                               / statistics.median(comparison.spec_times))
    low, high = comparison.speedup_range
    assert low <= high and comparison.repeats == 2
    html = common.stats_html(comparison)
    for text in ("wall time", "median of 2", "speedup", "mean accepted length", "target calls", "baseline (target only)"):
        assert text in html
    with pytest.raises(ValueError, match=r"timed repeats must be an integer in \[1, 10\]"):
        timing.compare(run, "eagle", 7, repeats=0)


@pytest.mark.parametrize("seconds, timed", [(0.05, 3), (0.004, 10), (0.012, 5)])
def test_short_calls_get_more_timed_passes(monkeypatch, seconds, timed):
    """At least the requested passes; more while the faster side's passes would take under min_timed_seconds
    (0.06 s here), at most MAX_REPEATS; the progress bar still only moves forward and ends at 1. A call
    "takes" ``seconds`` on a fake clock (the baseline's; the method's 1.5 times as long)."""
    clock, reports = [0.0], []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def run(method, generator, progress):
        clock[0] += seconds if method == "none" else seconds * 1.5
        return SimpleNamespace(stats=SimpleNamespace(mean_accepted_length=2.0, target_calls=1, draft_calls=0,
                                                     tokens=3))

    comparison = timing.compare(run, "eagle", 0, repeats=3, report=lambda f, text: reports.append(f),
                                min_timed_seconds=0.06)
    assert comparison.repeats == timed and len(comparison.base_times) == timed
    assert comparison.speedup == pytest.approx(1 / 1.5)
    assert reports == sorted(reports) and reports[-1] == pytest.approx(1.0)


def test_a_speedup_the_call_counts_contradict_is_flagged_never_green():
    """21x with 2 against 2 target calls (the same tokens) cannot be real: the card warns instead of
    showing a green result; a speedup the counts explain is green, a slowdown is worded as one."""
    impossible = timing.Comparison("eagle", _fake_output(2), _fake_output(2), [0.1, 0.1, 0.1], [2.1, 2.2, 2.0])
    assert impossible.ideal_speedup == 1.0 and "not trusted" in impossible.warning
    card = common.headline_html(impossible)
    assert "mmspec-card-warn" in card and "mmspec-card-ok" not in card and "2 against 2" in card
    fine = timing.Comparison("eagle", _fake_output(16), _fake_output(64), [0.30, 0.32, 0.31], [0.9, 0.95, 0.93],
                             lossless=True)
    assert fine.warning is None and not fine.noisy
    card = common.headline_html(fine, identical=True)
    assert "mmspec-card-ok" in card and "faster than the baseline" in card and "identical to the baseline" in card
    assert "range 2.97-3.00x over 3 alternating timed runs" in card and "target calls: 16 against 64" in card
    slow = timing.Comparison("gsd", _fake_output(60), _fake_output(64), [1.0, 1.0, 1.0], [0.34, 0.34, 0.34],
                             quality=("images showing their prompt", "1 of 2", "2 of 2"))
    card = common.headline_html(slow)
    assert "2.94x slower than the baseline" in card and "0.34x" not in card.split("range")[0]
    assert "mmspec-card-slow" in card and "images showing their prompt 1 of 2 against the baseline&#x27;s 2 of 2" in card
    assert timing.speed_words(1.0) == "as fast as" and timing.speed_words(2.5) == "2.50x faster than"
    noisy = timing.Comparison("eagle", _fake_output(16), _fake_output(64), [0.3, 0.3], [0.6, 0.9])
    card = common.headline_html(noisy)
    assert noisy.noisy and "disagree by more than 25%" in card and "mmspec-card-warn" in card  # amber, not green


def test_a_contended_timing_gets_an_amber_card_naming_the_load():
    from mmspec.evaluation.speed import MachineLoad

    busy = timing.Comparison("eagle", _fake_output(16), _fake_output(64), [0.30, 0.31, 0.30], [0.9, 0.92, 0.91],
                             lossless=True, load=MachineLoad(3.0, 0.9, 1.7, 2, 1))
    card = common.headline_html(busy, identical=True)
    assert busy.contended and "mmspec-card-warn" in card and "mmspec-card-ok" not in card
    assert "contended machine: CONTENDED: other processes used 0.90 cores" in card
    assert "step compression 4.00x" in card and busy.summary()["contended"] is True
    quiet = timing.Comparison("eagle", _fake_output(16), _fake_output(64), [0.30, 0.31, 0.30], [0.9, 0.92, 0.91],
                              lossless=True, load=MachineLoad(3.0, 0.05, 1.0, 2, 1))
    assert not quiet.contended and "mmspec-card-ok" in common.headline_html(quiet, identical=True)


def test_one_run_at_a_time_and_the_slot_says_who_holds_it():
    slot, order = timing.RunSlot(), []
    assert slot.holder() is None

    def second():
        with slot.hold("VLM"):
            order.append("second")

    with slot.hold("AR image"):
        assert slot.holder() == "AR image"
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(0.2)
        assert thread.is_alive() and order == []  # waits for the first run
        order.append("first")
    thread.join(5)
    assert order == ["first", "second"] and slot.holder() is None


def test_messages_name_no_exception_class_and_use_the_right_article(tiny, cache):
    assert common.user_message(ValueError("words outside the model's vocabulary: ['zebra']")) == \
        "words outside the model's vocabulary: ['zebra']"
    assert common.user_message(KeyError("no such method")) == "no such method"
    assert "RuntimeError" not in common.user_message(RuntimeError("boom"))
    assert [common.with_article(w) for w in ("ARImagePipeline", "VLMPipeline", "ARVideoPipeline")] == [
        "an ARImagePipeline", "a VLMPipeline", "an ARVideoPipeline"]
    with pytest.raises(DemoError, match="holds an ARImagePipeline, not a VLMPipeline: use it in the AR image tab"):
        cache.get("vlm", tiny["ar_image"])


def test_acceptance_map_follows_the_drafted_mask_in_the_legend_colours():
    image = PIL.Image.new("RGB", (32, 32), (0, 0, 0))
    drafted = torch.zeros(8, 8, dtype=torch.bool)
    drafted[0, 0] = drafted[7, 3] = True
    overlay = np.asarray(common.acceptance_overlay(image, drafted, size=384))
    assert overlay.shape == (384, 384, 3)
    cell = 48  # 384 / 8 pixels per token
    assert tuple(overlay[cell // 2, cell // 2]) == common.DRAFT_COLOR  # exactly the legend's swatch
    assert tuple(overlay[cell // 2, cell + cell // 2]) == common.TARGET_COLOR
    assert tuple(overlay[7 * cell + 5, 3 * cell + 5]) == common.DRAFT_COLOR
    assert dict((text, color) for color, text in common.MAP_LEGEND) == {
        "drafted and accepted": common.DRAFT_COLOR, "produced by the target": common.TARGET_COLOR}
    with pytest.raises(ValueError, match=r"\[h, w\]"):
        common.acceptance_overlay(image, torch.zeros(8, dtype=torch.bool))
    # a labelled picture: the label band is drawn above the row (dark pixels in it), the tiles keep their size
    picture = common.panel([[image, image]], labels=["a red circle"])
    assert picture.size == (2 * 32 + 8, 32 + common.LABEL_SIZE + 10)
    assert np.asarray(picture)[: common.LABEL_SIZE + 10].min() < 100


def test_checkpoint_paths(tiny, tmp_path, monkeypatch, cache):
    with pytest.raises(DemoError, match="checkpoint path is empty"):
        common.resolve_checkpoint("vlm", "  ")
    with pytest.raises(DemoError, match="does not exist"):
        common.resolve_checkpoint("ar_image", str(tmp_path / "absent"))
    with pytest.raises(DemoError, match="no model_index.json"):
        common.resolve_checkpoint("ar_image", str(tmp_path))
    with pytest.raises(DemoError, match="unknown zoo id 'mmspec/no-such-entry'"):
        common.resolve_checkpoint("video", "mmspec/no-such-entry")
    # a zoo entry whose folder exists but is not built yet: the zoo's own FileNotFoundError message
    import mmspec.pipelines.hub as hub

    (tmp_path / "zoo" / "shapes-video").mkdir(parents=True)
    monkeypatch.setattr(hub, "zoo_dir", lambda: tmp_path / "zoo")
    with pytest.raises(DemoError, match="^the zoo entry 'mmspec/shapes-video' is not built yet"):
        cache.get("video", "mmspec/shapes-video")
    assert cache.get("ar_image", tiny["ar_image"]) is cache.get("ar_image", tiny["ar_image"] + "/")


# ---------------------------------------------------------------------------------------------------- AR image


def test_ar_image_greedy_eagle_reproduces_the_baseline(tiny, cache):
    pipe = cache.get("ar_image", tiny["ar_image"])
    result = ar_image_tab.run_ar_image(cache, path=tiny["ar_image"], prompt="a red circle\ntwo blue squares",
                                       method="eagle", greedy=True, num_draft_tokens=4, seed=3)
    comparison = result.comparison
    spec, base = comparison.speculative, comparison.baseline
    assert torch.equal(spec.tokens, base.tokens)  # lossless, same inputs and seed
    assert comparison.extra["same tokens as the baseline"][0] == "yes"
    assert base.stats.target_calls == pipe.transformer.config.block_size and base.stats.mean_accepted_length == 1.0
    summary = comparison.summary()
    assert summary["mean_accepted_length"] == spec.stats.mean_accepted_length >= 1.0
    assert summary["target_calls"] == spec.stats.target_calls and summary["speedup"] > 0
    # one picture: two rows (image | acceptance map | baseline image), 384-pixel tiles, 8-pixel gaps, each row
    # under its prompt, column headers on top
    band = common.LABEL_SIZE + 10
    assert result.gallery.size == (3 * 384 + 2 * 8, 3 * band + 2 * 384 + 8)
    for text in ("speculative (eagle)", "mean accepted length", "target calls", "drafted-and-accepted"):
        assert text in result.stats_html
    assert "identical to the baseline" in result.card_html and comparison.lossless


@pytest.mark.parametrize("method", ["lantern", "sjd", "gsd", "mulo"])
def test_ar_image_methods_and_knobs(tiny, cache, method):
    result = ar_image_tab.run_ar_image(cache, path=tiny["ar_image"], prompt="a red circle", method=method,
                                       use_tree=method == "lantern", tree_depth=3, tree_top_k=4, tree_total_tokens=12,
                                       lantern_k=8, gsd_group_size=4, sjd_window=8, mulo_radius=0, num_images=2)
    stats = result.comparison.speculative.stats
    assert result.comparison.method == method and stats.tokens == 2 * 64
    assert f"speculative ({method})" in result.stats_html


def test_ar_image_lantern_with_argmax_drafts_runs(tiny, cache):
    """LANTERN with a LANTERN++ bound and argmax drafts (a sampled chain) runs end to end on the page."""
    result = ar_image_tab.run_ar_image(cache, path=tiny["ar_image"], prompt="a red circle", method="lantern",
                                       lantern_k=8, lantern_lam=3.0, argmax_drafts=True, num_images=2)
    assert result.comparison.speculative.stats.tokens == 2 * 64 and "speculative (lantern)" in result.stats_html


def test_ar_image_page_settings_are_the_stored_ones_with_the_knobs_replaced(tiny):
    """The page's method settings: the checkpoint's stored ones for the mode and batch (with no knob set,
    exactly what a call with only ``method=`` runs), each knob the page shows replacing its config field;
    an empty knob (None) keeps the stored value and knobs of other methods are ignored."""
    from functools import partial

    from mmspec.methods.eagle import LanternConfig
    from mmspec.methods.jacobi import GSDConfig
    from mmspec.models.recipes.build_zoo_t2i import SPECULATION_SETTINGS
    from mmspec.pipelines import ARImagePipeline

    pipe = ARImagePipeline.from_pretrained(tiny["ar_image"], speculation_settings=SPECULATION_SETTINGS)
    config = partial(ar_image_tab.method_config, pipe, greedy=False, batch_size=1, guidance_scale=3.0)
    empty = dict.fromkeys(("num_draft_tokens", "lookup_tail", "lantern_k", "lantern_delta", "lantern_lam",
                           "sjd_window", "gsd_group_size", "mulo_tau", "mulo_radius"), "")  # the page's empty fields
    for method in ar_image_tab.METHODS:
        assert config(method) == pipe.method_config(method, batch_size=1, guidance_scale=3.0)
        assert config(method, **empty) == config(method)  # an empty field keeps the stored setting
    assert config("eagle", num_draft_tokens="3").num_draft_tokens == 3
    assert config("gsd", sjd_window=4, gsd_group_size=3) == GSDConfig(window=4, init="left", group_size=3,
                                                                       prob_threshold=1.0)
    assert config("gsd", lookup_tail=16, num_draft_tokens=3) == config("gsd")  # EAGLE knobs: not GSD's
    assert config("mulo").resample == "reverify" and config("mulo", mulo_resample="parallel").resample == "parallel"
    assert config("mulo", mulo_resample=ar_image_tab.STORED) == config("mulo")
    # LANTERN: stored argmax block chain and LANTERN++ bound (k 512, lam 10); lam 0 turns the bound off
    stored = config("lantern")
    assert stored.argmax_drafts and stored.lam == 10.0 and stored.k == 512 and stored.lookup_tail == 16
    assert config("lantern", lantern_lam=3.0, lantern_k=64) == stored.replace(lam=3.0, k=64)
    assert config("lantern", lantern_lam=0, lantern_delta=0.2) == stored.replace(lam=None, delta=0.2)
    assert config("lantern", argmax_drafts=False).argmax_drafts is False
    greedy = ar_image_tab.method_config(pipe, "lantern", greedy=True, batch_size=1, guidance_scale=3.0,
                                        argmax_drafts=True)
    assert greedy == pipe.method_config("lantern", do_sample=False, guidance_scale=3.0)  # greedy drafts argmax anyway
    tree = config("lantern", use_tree=True, tree_depth=3, tree_top_k=2, tree_total_tokens=8, argmax_drafts=True)
    assert tree.tree.depth == 3 and not tree.argmax_drafts and tree.lookup_tail == 0 and tree.lookup_only_from is None
    assert isinstance(tree, LanternConfig) and tree.lam == 10.0
    # lookup tails: EAGLE / LANTERN chains; 0 switches the stored tail (and its lookup-only rounds) off
    assert config("eagle", lookup_tail=8).lookup_tail == 8
    no_tail = config("lantern", lookup_tail=0)
    assert no_tail.lookup_tail == 0 and no_tail.lookup_only_from is None
    assert config("eagle", num_draft_tokens=5).num_draft_tokens == 5
    with pytest.raises(common.DemoError, match="lookup tail"):
        config("eagle", lookup_tail=-1)
    with pytest.raises(common.DemoError, match="MuLo resampling must be one of"):
        config("mulo", mulo_resample="bogus")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"method": "medusa"}, "method must be one of"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": "a purple zebra"}, "prompt 0"),
    ({"num_draft_tokens": 0}, r"K \(draft tokens\) must be an integer in \[1, 32\], got 0"),
    ({"method": "lantern", "lantern_delta": 1.5}, "LANTERN delta"),
    ({"method": "lantern", "lantern_lam": 0.5}, r"LANTERN\+\+ bound lam \(0: off\) must be 0 or at least 1"),
    ({"method": "gsd", "gsd_group_size": 0}, "GSD group size G"),
    ({"method": "mulo", "mulo_radius": -1}, "MuLo radius"),
    ({"temperature": 0}, "temperature"),
    ({"num_images": 9}, "images per prompt"),
    ({"path": "/no/such/folder"}, "does not exist"),
])
def test_ar_image_bad_input(tiny, cache, kwargs, message):
    kwargs = {"path": tiny["ar_image"], **kwargs}
    with pytest.raises((DemoError, ValueError), match=message) as error:
        ar_image_tab.run_ar_image(cache, **kwargs)
    assert str(error.value) in common.user_message(error.value)  # the page shows the whole message


def _zoo_or_skip(family: str, path: str) -> None:
    try:
        common.resolve_checkpoint(family, path)
    except DemoError as error:
        pytest.skip(f"the zoo entry is not built here: {error}")


def test_ar_image_on_the_zoo(cache):
    _zoo_or_skip("ar_image", ar_image_tab.DEFAULT_PATH)
    result = ar_image_tab.run_ar_image(cache, prompt="a red circle", method="eagle", greedy=True)
    summary = result.comparison.summary()
    assert result.comparison.extra["same tokens as the baseline"][0] == "yes"
    assert summary["mean_accepted_length"] > 2.0 and summary["target_calls"] < summary["base_target_calls"] / 2


# ---------------------------------------------------------------------------------------------------- VLM


def test_vlm_streams_highlighted_draft_tokens_then_the_baseline(tiny, cache):
    views = list(vlm_tab.run_vlm(cache, path=tiny["vlm"], example="shapes scene 0 (image)", prompt="",
                                 method="eagle", max_new_tokens=24, greedy=True, num_draft_tokens=3))
    final = views[-1]
    assert final.done and final.comparison is not None and len(views) >= 3
    assert not views[0].highlighted and "streaming" in views[0].status
    spec, base = final.comparison.speculative, final.comparison.baseline
    pipe = cache.get("vlm", tiny["vlm"])
    assert "".join(piece for piece, _ in final.highlighted) == pipe.tokenizer.decode(spec.tokens[0],
                                                                                     skip_special_tokens=True)
    labels = [label for _, label in final.highlighted]
    assert labels.count(vlm_tab.DRAFT_LABEL) == int(spec.drafted[0].sum())  # word tokens: one piece each
    assert final.baseline == base.text[0] == spec.text[0]  # greedy: lossless
    assert final.comparison.extra["same text as the baseline"][0] == "yes"
    for text in ("tokens / s", "mean accepted length", "target calls", "speedup"):
        assert text in final.stats_html


def test_vlm_pieces_mark_exactly_the_drafted_tokens(tiny, cache):
    pipe = cache.get("vlm", tiny["vlm"])
    ids = pipe.tokenizer("a red circle above a blue square", add_special_tokens=False)["input_ids"]
    pieces = vlm_tab.TokenPieces(pipe.tokenizer)
    drafted = [i % 2 == 1 for i in range(len(ids))]
    pieces.add(ids[:3], drafted[:3])
    pieces.add(ids[3:], drafted[3:])
    assert "".join(p for p, _ in pieces.pieces) == "a red circle above a blue square"
    assert [label == vlm_tab.DRAFT_LABEL for _, label in pieces.pieces] == drafted
    # the page's answer: flowing text, adjacent drafted pieces in one highlighted span
    html = vlm_tab.answer_html([("a", None), (" red", vlm_tab.DRAFT_LABEL), (" circle", vlm_tab.DRAFT_LABEL),
                                (" <b>", None)])
    assert html == "<div class='mmspec-answer'>a<mark class='mmspec-draft'> red circle</mark> &lt;b&gt;</div>"


def test_vlm_video_frames_and_uploads(tiny, cache, tmp_path):
    frames, kind = vlm_tab.visual_inputs(None, "shapes clip 0 (video, 4 frames)")
    assert kind == "video" and len(frames) == 4 and frames[0].size == (64, 64)
    for i, frame in enumerate(frames):
        frame.save(tmp_path / f"frame{i}.png")
    uploads = [str(tmp_path / f"frame{i}.png") for i in range(4)]
    assert [np.asarray(f).tolist() for f in vlm_tab.read_uploads(uploads)] == [np.asarray(f).tolist() for f in frames]
    views = list(vlm_tab.run_vlm(cache, path=tiny["vlm"], files=uploads, example=vlm_tab.NO_EXAMPLE,
                                 method="flash", max_new_tokens=8))
    assert "4 video frames" in views[-1].comparison.notes[0] and "narrate the video." in views[-1].comparison.notes[0]


def test_vlm_bad_input(tiny, cache, tmp_path):
    with pytest.raises(DemoError, match="no image"):
        list(vlm_tab.run_vlm(cache, path=tiny["vlm"], files=None, example=vlm_tab.NO_EXAMPLE))
    (tmp_path / "broken.png").write_bytes(b"not an image at all")
    with pytest.raises(DemoError, match="could not read 'broken.png' as an image") as error:
        list(vlm_tab.run_vlm(cache, path=tiny["vlm"], files=[str(tmp_path / "broken.png")]))
    assert str(tmp_path) not in str(error.value) and "Error" not in str(error.value)  # no temp path, no class
    with pytest.raises(DemoError, match="max new tokens"):
        list(vlm_tab.run_vlm(cache, path=tiny["vlm"], max_new_tokens=0))
    with pytest.raises(DemoError, match="method must be one of"):
        list(vlm_tab.run_vlm(cache, path=tiny["vlm"], method="none"))
    with pytest.raises(DemoError, match="example must be one of"):
        vlm_tab.example_inputs("a cat")


def test_vlm_on_the_zoo(cache):
    """The tab's defaults: the bundled captioner, a shapes example, greedy FLASH: lossless and accepted."""
    _zoo_or_skip("vlm", vlm_tab.DEFAULT_PATH)
    final = list(vlm_tab.run_vlm(cache, example="shapes scene 0 (image)", prompt="", method="flash",
                                 max_new_tokens=48, greedy=True, num_draft_tokens=5))[-1]
    assert final.done and final.comparison.extra["same text as the baseline"][0] == "yes"
    assert final.comparison.summary()["mean_accepted_length"] > 2.0


# ---------------------------------------------------------------------------------------------------- continuous


def test_continuous_cspd_against_the_baseline(tiny, cache):
    result = continuous_tab.run_continuous(cache, path=tiny["continuous"], prompt="a red circle\na blue square",
                                           num_images=2, draft_length=3, num_iter=16)
    comparison = result.comparison
    spec, base = comparison.speculative, comparison.baseline
    assert spec.drafted.shape == (4, 8, 8) and not base.drafted.any()
    assert spec.stats.drafted_tokens > 0 and base.stats.mean_accepted_length == pytest.approx(64 / 16)
    band = common.LABEL_SIZE + 10
    assert result.gallery.size == (3 * 384 + 2 * 8, 5 * band + 4 * 384 + 3 * 8)  # headers, 4 labelled rows
    assert "acceptance rate (alpha)" in result.stats_html and "speculative (cspd)" in result.stats_html


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"draft_length": 0}, r"CSpD gamma .* must be an integer in \[1, 64\], got 0"),
    ({"num_iter": 65}, r"MAR iterations must be an integer in \[1, 64\]"),
    ({"verify_order": "random"}, "verification order"),
    ({"prompt": "a purple zebra"}, "prompt 0"),
    ({"prompt": "3"}, "this checkpoint is text-conditioned: describe the image in words"),
])
def test_continuous_bad_input(tiny, cache, kwargs, message):
    with pytest.raises((DemoError, ValueError), match=message):
        continuous_tab.run_continuous(cache, path=tiny["continuous"], **kwargs)


def test_continuous_on_the_zoo(cache):
    _zoo_or_skip("continuous", continuous_tab.DEFAULT_PATH)
    result = continuous_tab.run_continuous(cache, prompt="a red circle", num_images=1, draft_length=8, num_iter=32)
    summary = result.comparison.summary()
    # the stored pre-fill (whole target iterations up to a quarter of the tokens), then one target pass per 8
    assert summary["target_calls"] < summary["base_target_calls"] * 0.6 and "speculative (cspd)" in result.stats_html


# ---------------------------------------------------------------------------------------------------- video


def _assert_animations(result, per_row: int = 1) -> None:
    """Both runs come as looping GIF files with one GIF frame per video frame, their videos side by side."""
    for path, output in ((result.spec_animation, result.comparison.speculative),
                         (result.base_animation, result.comparison.baseline)):
        assert path.endswith(".gif") and Path(path).is_file()
        num_frames = len(output.frames[0])
        with PIL.Image.open(path) as gif:
            assert gif.format == "GIF" and gif.n_frames == num_frames and gif.is_animated == (num_frames > 1)
            assert gif.info["loop"] == 0 and gif.info["duration"] == 1000 // video_tab.ANIMATION_FPS
            size, gap = video_tab.ANIMATION_SIZE, video_tab.GAP
            rows = len(output.frames) // per_row
            assert gif.size == (per_row * size + (per_row - 1) * gap,
                                rows * (size + video_tab.BAR) + rows * gap + video_tab.BAR)  # + the playhead


def test_video_sdvg_block_strip_and_exact_limits(tiny, cache):
    result = video_tab.run_video(cache, path=tiny["video"], tau=0.0, force_reject_first=True)
    stats = result.comparison.speculative.stats
    decisions = video_tab.block_decisions(stats)
    assert decisions[0][0]["kind"] == "target"  # first-block rule
    assert all(d["kind"] in ("accepted", "rejected") and d["reward"] is not None for d in decisions[0][1:])
    assert result.blocks_html.count("mmspec-block ") == 4 and "reward" in result.blocks_html
    assert "blocks from the drafter" in result.stats_html and "speculative (sdvg)" in result.stats_html
    assert result.spec_strip.size == result.base_strip.size
    _assert_animations(result)
    assert result.spec_animation != result.base_animation
    with PIL.Image.open(result.spec_animation) as gif:  # GIF frame 0 is video frame 0 (nearest-neighbour upscale)
        first = np.asarray(gif.convert("RGB"))[:video_tab.ANIMATION_SIZE, :video_tab.ANIMATION_SIZE]
        frame = result.comparison.speculative.frames[0][0].convert("RGB")
        expected = np.asarray(frame.resize((video_tab.ANIMATION_SIZE,) * 2, PIL.Image.NEAREST))
        assert np.abs(first.astype(int) - expected).mean() < 8  # GIF palettes quantize colours
    # tau = +inf: the target makes every block with the drafter's noise: exactly the baseline
    exact = video_tab.run_video(cache, path=tiny["video"], tau="inf")
    assert torch.equal(exact.comparison.speculative.latents, exact.comparison.baseline.latents)
    assert np.array_equal(np.asarray(exact.spec_strip), np.asarray(exact.base_strip))
    assert Path(exact.spec_animation).read_bytes() == Path(exact.base_animation).read_bytes()
    # refine_rejected_from only touches drafted blocks: with tau = +inf there are none
    refined = video_tab.run_video(cache, path=tiny["video"], tau="inf", refine_rejected_from=750)
    assert torch.equal(refined.comparison.speculative.latents, exact.comparison.speculative.latents)  # no drafts
    for bad in (600, 1000, -1, "x"):
        with pytest.raises(DemoError, match="refine rejected drafts from"):
            video_tab.run_video(cache, path=tiny["video"], refine_rejected_from=bad)
    draft = video_tab.run_video(cache, path=tiny["video"], method="draft", num_blocks=2, num_videos=2)
    assert [d["kind"] for d in video_tab.block_decisions(draft.comparison.speculative.stats)[0]] == ["draft"] * 2
    assert "drafter only" in draft.blocks_html and "SDVG routing" not in draft.blocks_html
    what, ours, theirs = draft.comparison.quality  # a lossy run's card carries the world's per-frame score
    assert "per frame" in what and f"{what} {ours} against" in draft.card_html.replace("&#x27;", "'")
    _assert_animations(draft, per_row=2)  # the two videos of the prompt side by side, 2 blocks' frames


def test_video_animation_folder_keeps_the_newest_files():
    frames = video_tab.animation_frames([[PIL.Image.new("RGB", (8, 8), (200, 0, 0))] * 4], None, 2, 1)
    assert len({frame.tobytes() for frame in frames}) == 4  # a still video: the playhead keeps frames distinct
    folder = video_tab.AnimationFolder(keep=3)
    paths = [folder.write(frames, "test") for _ in range(5)]
    assert [Path(p).exists() for p in paths] == [False, False, True, True, True]
    assert sorted(folder.folder.iterdir()) == sorted(Path(p) for p in paths[2:])
    with PIL.Image.open(paths[-1]) as gif:
        assert gif.n_frames == 4 and gif.is_animated


def test_video_block_decisions_text():
    stats = SimpleNamespace(accepted=torch.tensor([[False, True, False]]), routed=torch.tensor([[False, True, True]]),
                            block_scores=torch.tensor([[float("nan"), 0.9, 0.1]], dtype=torch.float64))
    html = video_tab.block_strip_html(stats, 0.5, ["a red circle moving right"])
    assert [d["decision"] for d in video_tab.block_decisions(stats)[0]] == [
        "target", "draft accepted", "draft rejected -> target"]
    assert "reward 0.900" in html and "reward 0.100" in html and "reward -" in html and "tau = 0.5" in html


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_blocks": 9}, r"blocks must be an integer in \[1, 4\], got 9"),
    ({"tau": float("nan")}, "tau"),
    ({"reward": "pickscore"}, "reward must be one of"),
    ({"reward": "imagereward"}, "the imagereward reward needs local weights: give a folder"),
    ({"reward": "imagereward", "reward_weights": "/no/such/folder"}, "lacks ImageReward.pt, med_config.json"),
    ({"reward": "clip", "reward_weights": "clip.bin"}, "must read MODEL:FILE"),
    ({"reward": "clip", "reward_weights": "ViT-B-32:/no/such/clip.bin"}, "no CLIP weights file at /no/such"),
    ({"reward_weights": "/models/ImageReward"}, "the shapes reward needs no weights"),
    ({"path": "mmspec/no-such-entry"}, "unknown zoo id"),
])
def test_video_bad_input(tiny, cache, kwargs, message):
    with pytest.raises(DemoError, match=message):
        video_tab.run_video(cache, **{"path": tiny["video"], **kwargs})


def test_video_clip_reward_from_the_weights_field(tiny, cache, tmp_path):
    """The page's reward-weights field reaches the pipeline: a CLIP reward from a local weights file
    (random weights of a tiny registered open_clip config) scores every drafted frame."""
    from mmspec.evaluation.clip_score import CLIPScorer, register_clip_config

    name = "mmspec-test-demo-clip"
    register_clip_config(name, {"embed_dim": 32, "vision_cfg": {"image_size": 224, "layers": 1, "width": 32,
                                                                "head_width": 16, "patch_size": 32},
                                "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 32, "heads": 2,
                                             "layers": 1}})
    torch.manual_seed(0)
    torch.save(CLIPScorer(name, None).model.state_dict(), tmp_path / "clip.pt")
    weights = f"{name}:{tmp_path / 'clip.pt'}"
    result = video_tab.run_video(cache, path=tiny["video"], reward="clip", reward_weights=weights, tau=-1.0,
                                 num_blocks=2)
    blocks = video_tab.block_decisions(result.comparison.speculative.stats)[0]
    assert [b["decision"] for b in blocks] == ["target", "draft accepted"]  # CLIP scores >= 0 > tau
    assert 0.0 <= blocks[1]["reward"] <= 100.0


def test_video_on_the_zoo(cache):
    _zoo_or_skip("video", video_tab.DEFAULT_PATH)
    exact = video_tab.run_video(cache, tau="inf", num_blocks=2)  # tau = +inf: exactly the baseline
    assert torch.equal(exact.comparison.speculative.latents, exact.comparison.baseline.latents)
    routed = video_tab.run_video(cache, tau=0.0, num_blocks=2)
    assert routed.blocks_html.count("mmspec-block ") == 2 and "reward" in routed.blocks_html
    _assert_animations(routed)


# ---------------------------------------------------------------------------------------------------- page and CLI


@pytest.mark.skipif(not HAS_GRADIO, reason="gradio (the demo extra) is not installed")
def test_page_builds_and_handlers_turn_errors_into_messages(tiny, cache):
    import gradio as gr

    from mmspec.demos import app

    demo = app.build_app(tiny, cache)
    assert isinstance(demo, gr.Blocks) and demo.mmspec_cache is cache
    with pytest.raises(ValueError, match="unknown families"):
        app.build_app({"audio": "x"})
    assert "mmspec-message-error" in app.checkpoint_status("video", "mmspec/no-such-entry")
    assert "press Run" in app.checkpoint_status("video", tiny["video"])

    def show(result):
        return [result.gallery, result.card_html, result.stats_html, "ok"]

    handle = app._handler(ar_image_tab.run_ar_image, ar_image_tab.INPUTS, cache, show, 4)
    values = dict(path="/no/such/folder", prompt="a red circle", method="eagle", num_images=1, seed=0, greedy=True,
                  temperature=1.0, guidance_scale=3.0, num_draft_tokens=4, use_tree=False, tree_depth=5, tree_top_k=8,
                  tree_total_tokens=48, lantern_k=64, lantern_delta=0.2, lantern_lam=3.0, argmax_drafts=True,
                  sjd_window=16, gsd_group_size=10, mulo_tau=0.3, mulo_radius=1, mulo_resample="reverify",
                  lookup_tail=8, repeats=1)
    outputs = handle(*[values[name] for name in ar_image_tab.INPUTS], progress=lambda *a, **k: None)
    assert outputs[:3] == [None, None, None] and "does not exist" in outputs[3] and "error" in outputs[3]
    values["path"] = tiny["ar_image"]
    outputs = handle(*[values[name] for name in ar_image_tab.INPUTS], progress=lambda *a, **k: None)
    assert outputs[3] == "ok" and "speedup" in outputs[2]


def test_demo_command(tiny, monkeypatch, capsys):
    from mmspec.cli import build_parser
    from mmspec.demos import launch

    args = build_parser("demo").parse_args(["demo", "--vlm", tiny["vlm"], "--port", "8001"])
    assert (args.host, args.port, args.vlm, args.ar_image) == ("127.0.0.1", 8001, tiny["vlm"], None)
    assert launch.paths_from_args(args) == {"vlm": tiny["vlm"]}
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: None)
    assert launch.run(argparse.Namespace(**vars(args))) == 1
    assert "needs gradio" in capsys.readouterr().err


def test_the_screenshot_script_reads_the_speedup_of_each_run_and_their_spread():
    from mmspec.demos.screenshot import message_speedup, spread_line
    from mmspec.demos.timing import speed_words

    for speedup in (2.31, 1.0, 0.25):  # the page's own wording, read back
        assert message_speedup(f"done: eagle ran {speed_words(speedup)} the baseline") == pytest.approx(speedup)
    assert message_speedup("done, but the timing is not trusted: 2 target calls against 2") is None
    assert spread_line([2.0, 2.2, 2.5]) == "speedups 2.00x, 2.20x, 2.50x: the highest is 25% above the lowest"
    assert spread_line([2.0, None, 2.1]).startswith("1 of 3 runs had an untrusted timing")
