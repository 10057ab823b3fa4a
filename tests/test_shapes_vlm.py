"""The shapes VLM (models/shapes_vlm.py, models/recipes/train_vlm.py): word-level tokenizer, LLaVA processor,
configs that save and reload offline, the training recipe (deterministic), the core's VLMRunner and transformers'
assisted generation on tiny random shapes VLMs, and (slow) the trained zoo entry on held-out scenes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mmspec import speculative_generate
from mmspec.models import shapes_vlm as sv
from mmspec.models.recipes import train_vlm
from mmspec.models.recipes.common import grown_layer_sources
from mmspec.models.recipes.vlm_answer_loss import answer_loss, training_batch
from mmspec.models.vlm_targets import VLMRunner
from mmspec.world import caption_scene, caption_video, describe_scene, qa_pairs, sample_scene, split_words
from mmspec.world.captions import article, reading_order

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def processor():
    return sv.build_processor()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(target, draft, processor): tiny random shapes VLMs (fp32), saved with save_pretrained and reloaded
    offline; the LM heads are sharpened so that greedy outputs are not near-ties."""
    models = []
    for seed, layers in ((0, 2), (1, 1)):
        model = sv.build_model("tiny", seed=seed, text_layers=layers)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
            model.lm_head.weight[sv.SPECIAL_TOKENS.index(sv.EOS)] = 0.0  # keep tiny random models from stopping
        folder = tmp_path_factory.mktemp(f"tiny{seed}")
        model.save_pretrained(folder)
        sv.build_processor().save_pretrained(folder)
        models.append(sv.load_model(folder))
    return models[0], models[1], sv.load_processor(folder)


def _batch(processor):
    """Two rows: an image with a detailed-description prompt and a 4-frame video with the narration prompt."""
    image = sv.image_example("test", 0, 0, "describe")["frames"][0]
    video = sv.video_example("test", 0, 0, "narrate")["frames"]
    return sv.vlm_inputs(processor, [image, video], ["describe", "narrate"])


# -- tokenizer and processor --------------------------------------------------------------------------------
def test_tokenizer_round_trips_every_world_text(processor):
    tok = processor.tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in sv.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert len(tok) == len(sv.SPECIAL_TOKENS) + len(sv.tokenizer_words())
    texts = []
    for i in range(30):
        scene = sample_scene(i)
        texts += [describe_scene(scene), caption_scene(scene)] + [t for qa in qa_pairs(scene)[::7] for t in qa]
        texts.append(sv.video_example("train", 0, i, "narrate")["answer"])
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert len(ids) == len(split_words(text))  # one token per word or punctuation mark
        assert tok.decode(ids) == text
    assert tok("a red circle.")["input_ids"][0] == tok.bos_token_id
    with pytest.raises(ValueError, match="outside the shapes vocabulary"):
        sv.encode_example(tok, sv.task_prompt("describe"), "a red zebra.")


def test_processor_expands_image_tokens_and_matches_the_fast_path(processor):
    inputs = _batch(processor)
    assert inputs["pixel_values"].shape == (1 + sv.VIDEO_FRAMES, 3, 64, 64)
    counts = (inputs["input_ids"] == processor.image_token_id).sum(1)
    assert counts.tolist() == [sv.IMAGE_TOKENS, sv.VIDEO_FRAMES * sv.IMAGE_TOKENS] and sv.IMAGE_TOKENS == 64
    assert inputs["attention_mask"][0, 0] == 0 and inputs["attention_mask"][:, -1].all()  # left padding
    assert processor.tokenizer.decode(inputs["input_ids"][0, -8:]) == "describe the image in detail. assistant :"
    frames = np.concatenate([sv.image_example("test", 0, 0, "describe")["frames"],
                             sv.video_example("test", 0, 0, "narrate")["frames"]])
    assert torch.equal(sv.pixel_values_from_uint8(torch.from_numpy(frames)), inputs["pixel_values"])
    # a training example encodes the same prompt tokens as the processor
    ex = sv.image_example("test", 0, 0, "describe")
    ids, start = sv.encode_example(processor.tokenizer, ex["prompt"], ex["answer"])
    prompt = inputs["input_ids"][0][inputs["attention_mask"][0].bool()].tolist()
    assert ids[:start] == prompt and ids[-1] == processor.tokenizer.eos_token_id


def test_chat_template_writes_the_training_layout(processor, tmp_path):
    from mmspec.models.vlm_prompts import format_vlm_prompt

    processor.save_pretrained(tmp_path)
    reloaded = sv.load_processor(tmp_path)
    for proc in (processor, reloaded):
        assert format_vlm_prompt(proc, "describe the image in detail.", 1) == sv.task_prompt("describe")
        assert format_vlm_prompt(proc, "narrate the video.", 4) == sv.task_prompt("narrate", num_frames=4)
        question = "what color is the circle?"
        assert format_vlm_prompt(proc, question, 1) == sv.task_prompt("qa", question)


def test_prompts_and_bad_inputs(processor):
    assert sv.task_prompt("describe") == "user: <image> describe the image in detail. assistant:"
    assert sv.task_prompt("narrate", num_frames=3).count(sv.IMAGE) == 3
    assert sv.task_prompt("qa", "how many shapes are there?").endswith("how many shapes are there? assistant:")
    with pytest.raises(ValueError, match="task must be one of"):
        sv.task_prompt("translate")
    with pytest.raises(ValueError, match="needs a question"):
        sv.task_prompt("qa")
    image = np.zeros((64, 64, 3), np.uint8)
    with pytest.raises(ValueError, match="same length"):
        sv.vlm_inputs(processor, [image], ["describe", "caption"])
    with pytest.raises(ValueError, match="takes one image"):
        sv.vlm_inputs(processor, [np.zeros((4, 64, 64, 3), np.uint8)], ["describe"])
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        sv.vlm_inputs(processor, [np.zeros((64, 64), np.uint8)], ["describe"])
    with pytest.raises(ValueError, match="size must be one of"):
        sv.shapes_vlm_config("huge")
    with pytest.raises(ValueError, match="unknown size overrides"):
        sv.shapes_vlm_config("tiny", depth=3)
    with pytest.raises(FileNotFoundError):
        sv.load_model("/nonexistent/shapes-vlm")
    with pytest.raises(FileNotFoundError):
        sv.load_processor("/nonexistent/shapes-vlm")


def test_clear_scenes_keep_their_description_under_small_shifts():
    from dataclasses import replace

    from mmspec.world.scene import Scene

    for i in range(40):
        scene = sv.image_example("train", 0, i, "describe")["scene"]
        assert sv.scene_clearance(scene) >= sv.CLEARANCE
        shift = 0.9 * sv.CLEARANCE
        rng = np.random.default_rng(i)
        moved = Scene(tuple(replace(o, x=o.x + rng.uniform(-shift, shift), y=o.y + rng.uniform(-shift, shift))
                            for o in scene.objects), scene.background, scene.seed)
        assert describe_scene(moved) == describe_scene(scene)
    # and unrestricted scenes do not always have that margin
    assert min(sv.scene_clearance(sv.image_example("test", 1, i, "describe", clearance=0)["scene"])
               for i in range(40)) < sv.CLEARANCE


def test_clear_clips_name_their_objects_in_the_first_frame_reading_order():
    """sample_video lists a clip's objects in random order; the captioner's clips list them in the order
    the first frame shows (so the reference caption's order is readable), with the same pixels."""
    from mmspec.world import clip_in_reading_order, render_video, sample_video

    two_object_clips = 0
    for i in range(30):
        clip = sv.video_example("train", 0, i, "video_caption")["clip"]
        assert [o for o in clip.objects] == reading_order(clip.scene_at(0))
        two_object_clips += len(clip.objects) == 2
    assert two_object_clips >= 5
    # the reordering is a permutation of (object, direction, speed) triples that leaves the frames alone
    flipped = 0
    for seed in range(40):
        clip = sample_video(seed, num_objects=3, num_frames=4)
        ordered = clip_in_reading_order(clip)
        assert list(ordered.objects) == reading_order(clip.scene_at(0))
        assert sorted(zip(ordered.objects, ordered.directions, ordered.speeds), key=str) == \
            sorted(zip(clip.objects, clip.directions, clip.speeds), key=str)
        assert np.array_equal(render_video(ordered, 32), render_video(clip, 32))
        assert caption_video(ordered).startswith(f"{article(ordered.objects[0].color)} {ordered.objects[0].phrase()}")
        flipped += ordered.objects != clip.objects
    assert flipped > 10  # sample_video's own order is not already the reading order
    with pytest.raises(ValueError, match="VideoClip"):
        clip_in_reading_order("not a clip")


def test_scene_clearance_covers_the_listing_order():
    """Two objects in one region row are listed by x: a pair whose x differ by less than 2 x clearance
    could swap places in the listing under a clearance shift, so it has less clearance."""
    from mmspec.world.scene import Scene, WorldObject

    def scene(x2: float) -> Scene:
        return Scene((WorldObject("circle", "red", "small", 0.2, 0.45), WorldObject("square", "blue", "small", x2, 0.6)))

    close, apart = scene(0.205), scene(0.02 + 0.2)  # same middle row, 0.005 vs 0.02 apart in x
    assert sv.scene_clearance(close) == pytest.approx(0.0025)
    assert sv.scene_clearance(apart) == pytest.approx(0.01)


def test_patch_labels_follow_the_scene():
    scene = sv.image_example("train", 0, 3, "describe")["scene"]
    classes, offsets = sv.patch_labels(scene)
    assert classes.shape == (64, len(sv.PATCH_FIELDS)) and offsets.shape == (64, 2)
    centres = (np.arange(8) + 0.5) / 8
    from mmspec.world.scene import COLORS
    for o in scene.objects:
        c, r = int(np.argmin(abs(centres - o.x))), int(np.argmin(abs(centres - o.y)))  # patch nearest the centre
        label = classes[r * 8 + c]
        assert label[0] == 1 + list(COLORS).index(o.color) and label[3] == 1 + min(int(o.x * 3), 2)
        assert np.allclose(offsets[r * 8 + c], ((o.x - centres[c]) * 8, (o.y - centres[r]) * 8), atol=1e-5)
    assert (classes[:, 0] > 0).sum() < 64 and (offsets[classes[:, 0] == 0] == 0).all()


def test_position_table_initialises_the_tower():
    table = sv.sincos_positions(32)
    assert table.shape == (65, 32) and (table[0] == 0).all()
    assert len({tuple(row.tolist()) for row in table[1:]}) == 64  # every patch has its own position
    model = sv.build_model("tiny")
    assert torch.equal(model.model.vision_tower.embeddings.position_embedding.weight.detach(), table)


# -- configs and checkpoints ----------------------------------------------------------------------------------
def test_configs_build_save_and_reload_offline(tmp_path, processor):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    target, draft = sv.shapes_vlm_config("target"), sv.shapes_vlm_config("draft")
    assert target.text_config.num_hidden_layers == 8 and draft.text_config.num_hidden_layers == 2
    assert target.text_config.vocab_size == draft.text_config.vocab_size == len(processor.tokenizer)
    assert target.image_token_id == processor.image_token_id
    model = sv.build_model("tiny", seed=3)
    model.eval().save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = LlavaForConditionalGeneration.from_pretrained(tmp_path, local_files_only=True).eval()
    proc = AutoProcessor.from_pretrained(tmp_path, local_files_only=True)
    inputs = sv.vlm_inputs(proc, [sv.image_example("test", 0, 1, "caption")["frames"][0]], ["caption"])
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
    assert loaded.generation_config.eos_token_id == processor.tokenizer.eos_token_id


# -- the recipe -----------------------------------------------------------------------------------------------
def _run_recipe(root: Path, steps: int, *extra: str) -> dict[str, torch.Tensor]:
    train_vlm.main(["--size", "tiny", "--out", str(root / "out"), "--work", str(root / "work"), "--steps", str(steps),
                    "--batch", "4", "--train-images", "12", "--train-videos", "3", "--threads", "1",
                    "--save-every", "10", *extra])
    return load_file(root / "out" / "model.safetensors")


def test_recipe_step_is_deterministic_and_resumes(tmp_path):
    first = _run_recipe(tmp_path / "a", 2)
    second = _run_recipe(tmp_path / "b", 2)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert all(v.dtype == torch.float16 for v in first.values() if v.is_floating_point())
    sv.build_model("tiny", seed=0).half().save_pretrained(tmp_path / "init")
    start = load_file(tmp_path / "init" / "model.safetensors")
    assert start.keys() == first.keys() and any(not torch.equal(first[k], start[k]) for k in first)  # it trained
    assert (tmp_path / "a" / "work" / "log.jsonl").is_file() and (tmp_path / "a" / "work" / "data.pt").is_file()
    # resuming to step 3 equals an unbroken 3-step run
    resumed = _run_recipe(tmp_path / "a", 3)
    straight = _run_recipe(tmp_path / "c", 3)
    assert all(torch.equal(resumed[k], straight[k]) for k in resumed)
    assert (tmp_path / "a" / "out" / "processor_config.json").is_file()


def test_recipe_stop_at_repeats_a_time_limited_run_and_resumes(tmp_path):
    """``--stop-at S`` ends the run at step S (saved, although not a save step) on the --steps schedule, as a
    --time-limit run logs ``stopped_at``; rerun without it, the rest of the schedule equals an unbroken run."""
    _run_recipe(tmp_path / "a", 3, "--stop-at", "2")
    assert torch.load(tmp_path / "a" / "work" / "checkpoint.pt", weights_only=False)["step"] == 2
    assert (tmp_path / "a" / "out" / "model.safetensors").is_file()
    pieces = _run_recipe(tmp_path / "a", 3)
    straight = _run_recipe(tmp_path / "b", 3)
    assert all(torch.equal(pieces[k], straight[k]) for k in straight)


def test_recipe_device_option(tmp_path):
    """``--device`` moves model and batches there; the deliverable is always a CPU fp16 checkpoint. Without a
    GPU, ``--device cuda`` fails at once with the recipes' common message (on a GPU machine it trains)."""
    args = ["--size", "tiny", "--steps", "1", "--batch", "4", "--train-images", "12", "--train-videos", "3",
            "--threads", "1", "--vision-steps", "1"]
    train_vlm.main(args + ["--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa"), "--device", "cpu"])
    train_vlm.main(args + ["--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb")])
    on_cpu, default = (load_file(tmp_path / name / "model.safetensors") for name in ("a", "b"))
    assert all(torch.equal(on_cpu[k], default[k]) for k in default)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="--device cuda: torch sees no CUDA GPU"):
            train_vlm.main(args + ["--out", str(tmp_path / "c"), "--work", str(tmp_path / "wc"), "--device", "cuda"])
        return
    train_vlm.main(args + ["--out", str(tmp_path / "c"), "--work", str(tmp_path / "wc"), "--device", "cuda"])
    on_gpu = load_file(tmp_path / "c" / "model.safetensors")
    assert on_gpu.keys() == default.keys() and all(v.device.type == "cpu" for v in on_gpu.values())


def test_recipe_later_stage_starts_from_a_trained_model(tmp_path):
    _run_recipe(tmp_path / "a", 2)
    folder = tmp_path / "a" / "out"
    trained = {k: v.float() for k, v in sv.load_model(folder).state_dict().items()}
    trainee = train_vlm.Trainee(sv.build_model("tiny", seed=5))
    train_vlm.init_from(trainee, folder)
    assert all(torch.equal(v, trained[k]) for k, v in trainee.vlm.state_dict().items())
    stage = ["--size", "tiny", "--steps", "1", "--batch", "4", "--train-images", "12", "--train-videos", "3",
             "--threads", "1", "--aux-weight", "0", "--duplicate-fraction", "0.5"]
    train_vlm.main(stage + ["--init", str(folder), "--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb")])
    train_vlm.main(stage + ["--out", str(tmp_path / "c"), "--work", str(tmp_path / "wc"), "--vision-steps", "0",
                          "--seed", "1"])
    later, fresh = (sv.load_model(tmp_path / name).state_dict() for name in ("b", "c"))
    # one small step from the trained weights stays near them; a fresh start (other seed) does not
    def distance(a):
        return sum(float((a[k].float() - trained[k]).abs().sum()) for k in trained)

    assert 0 < distance(later) < distance(fresh) / 5
    assert not (tmp_path / "wb" / "vision").exists()  # no vision stage on top of a trained tower
    sv.build_model("tiny", seed=0, text_layers=1).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="another architecture"):
        train_vlm.init_from(trainee, tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="no trained model"):
        train_vlm.init_from(trainee, tmp_path / "missing")


def test_grown_layer_sources_spread_the_new_layers():
    assert grown_layer_sources(8, 12) == [0, 1, None, 2, 3, None, 4, 5, None, 6, 7, None]
    assert grown_layer_sources(8, 10) == [0, 1, 2, 3, None, 4, 5, 6, 7, None]
    assert grown_layer_sources(3, 3) == [0, 1, 2]
    assert grown_layer_sources(2, 7) == [0, None, None, 1, None, None, None]
    with pytest.raises(ValueError, match="grow"):
        grown_layer_sources(4, 3)


def test_recipe_grows_a_trained_captioner_deeper_with_the_same_outputs(tmp_path, processor):
    trained = sv.build_model("tiny", seed=2)
    with torch.no_grad():
        for parameter in trained.parameters():  # a non-trivial stack: every layer writes into the residual
            parameter.add_(0.05 * torch.randn_like(parameter))
    trained.save_pretrained(tmp_path / "trained")
    trained = sv.load_model(tmp_path / "trained")
    trainee = train_vlm.Trainee(sv.build_model("tiny", seed=5, text_layers=5))
    with pytest.raises(ValueError, match="another architecture"):  # growing is asked for explicitly
        train_vlm.init_from(trainee, tmp_path / "trained")
    train_vlm.init_from(trainee, tmp_path / "trained", grow=True)
    grown = trainee.vlm.eval()
    weights = grown.state_dict()
    prefix = train_vlm.TEXT_LAYERS_PREFIX
    assert torch.equal(weights[f"{prefix}2.mlp.up_proj.weight"], trained.state_dict()[f"{prefix}1.mlp.up_proj.weight"])
    assert not weights[f"{prefix}3.self_attn.o_proj.weight"].any() and not weights[f"{prefix}3.mlp.down_proj.weight"].any()
    assert weights[f"{prefix}3.self_attn.q_proj.weight"].any()  # the rest of an inserted layer is a fresh start
    image = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    inputs = sv.vlm_inputs(processor, [image], ["describe"])
    with torch.no_grad():
        expected, actual = trained(**inputs).logits, grown(**inputs).logits
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    shallow = train_vlm.Trainee(sv.build_model("tiny", seed=5, text_layers=1))
    with pytest.raises(ValueError, match="more than"):
        train_vlm.init_from(shallow, tmp_path / "trained", grow=True)
    with pytest.raises(ValueError, match="--init"):
        train_vlm.main(["--size", "tiny", "--out", str(tmp_path / "x"), "--override", "text_layers=3",
                        "--grow-text-layers"])


def test_recipe_widens_a_trained_captioner_with_the_same_outputs(tmp_path, processor):
    trained = sv.build_model("tiny", seed=2)  # text: 32 channels, 4 heads of 8, 64 MLP units
    with torch.no_grad():
        for parameter in trained.parameters():  # a non-trivial model: every weight and gain away from its init
            parameter.add_(0.05 * torch.randn_like(parameter))
    trained.save_pretrained(tmp_path / "trained")
    trained = sv.load_model(tmp_path / "trained")
    wider = dict(text_dim=48, text_heads=6, text_ffn=96)
    trainee = train_vlm.Trainee(sv.build_model("tiny", seed=5, **wider))
    with pytest.raises(ValueError, match="another architecture"):  # widening is asked for explicitly
        train_vlm.init_from(trainee, tmp_path / "trained")
    train_vlm.init_from(trainee, tmp_path / "trained", widen=True)
    widened = trainee.vlm.eval()
    weights, old = widened.state_dict(), trained.state_dict()
    layer = train_vlm.TEXT_LAYERS_PREFIX + "1."
    assert torch.equal(weights[layer + "mlp.up_proj.weight"][:64, :32], old[layer + "mlp.up_proj.weight"].float())
    assert not weights[layer + "self_attn.o_proj.weight"][32:].any()  # the new channels start at zero ...
    assert not weights[layer + "self_attn.o_proj.weight"][:, 32:].any()  # ... the new heads add nothing ...
    assert not weights[layer + "mlp.down_proj.weight"][:, 64:].any()  # ... nor the new MLP units
    assert not weights["model.language_model.embed_tokens.weight"][:, 32:].any()
    assert weights[layer + "self_attn.q_proj.weight"][:, 32:].any()  # readers keep fresh columns
    assert widened.config.text_config.rms_norm_eps == pytest.approx(trained.config.text_config.rms_norm_eps * 32 / 48)
    image = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    inputs = sv.vlm_inputs(processor, [image], ["describe"])
    with torch.no_grad():
        expected = trained.float()(**inputs).logits
    widened.zero_grad()
    actual = widened(**inputs).logits
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    actual.logsumexp(-1).sum().backward()  # the silent parts get gradient, so training can use them
    assert widened.get_parameter(layer + "self_attn.o_proj.weight").grad[32:].abs().sum() > 0
    assert widened.get_parameter(layer + "mlp.down_proj.weight").grad[:, 64:].abs().sum() > 0
    widened.save_pretrained(tmp_path / "widened")  # the epsilon travels with the saved model
    with torch.no_grad():
        torch.testing.assert_close(sv.load_model(tmp_path / "widened").float()(**inputs).logits, expected,
                                   rtol=0, atol=1e-5)
    bad = {"head width": dict(text_dim=48, text_heads=4, text_ffn=96),
           "narrower": dict(text_dim=48, text_heads=6, text_ffn=32),
           "separate stages": dict(text_layers=3, **wider)}
    for message, sizes in bad.items():
        with pytest.raises(ValueError, match=message):
            train_vlm.init_from(train_vlm.Trainee(sv.build_model("tiny", **sizes)), tmp_path / "trained", widen=True)
    with pytest.raises(ValueError, match="separate stages"):
        train_vlm.init_from(trainee, tmp_path / "trained", grow=True, widen=True)
    with pytest.raises(ValueError, match="--init"):
        train_vlm.main(["--size", "tiny", "--out", str(tmp_path / "x"), "--override", "text_dim=48", "--grow-text-width"])
    with pytest.raises(FileNotFoundError, match="no trained model"):
        train_vlm.main(["--size", "tiny", "--out", str(tmp_path / "x"), "--init", str(tmp_path / "missing"),
                        "--override", "text_dim=48", "text_heads=6", "--grow-text-width"])
    train_vlm.main(["--size", "tiny", "--steps", "1", "--batch", "4", "--train-images", "12", "--train-videos", "3",
                    "--threads", "1", "--aux-weight", "0", "--init", str(tmp_path / "trained"), "--override",
                    "text_dim=48", "text_heads=6", "text_ffn=96", "--grow-text-width", "--out", str(tmp_path / "stage"),
                    "--work", str(tmp_path / "work")])  # the recipe trains the widened model one step
    stage = sv.load_model(tmp_path / "stage")
    assert stage.config.text_config.hidden_size == 48
    assert stage.config.text_config.rms_norm_eps == pytest.approx(widened.config.text_config.rms_norm_eps)
    moved = stage.state_dict()[layer + "self_attn.o_proj.weight"].float()
    assert torch.allclose(moved[:32, :32], weights[layer + "self_attn.o_proj.weight"][:32, :32], atol=0.05)


def test_report_train_split_scores_the_training_streams_examples(processor):
    from mmspec.models.recipes.report_vlm import held_out_examples

    data = sv.build_training_set(4, 2, seed=10, tokenizer=processor.tokenizer)
    trained = {(e["task"], e["ref"]): processor.tokenizer.decode(e["ids"][e["start"]:], skip_special_tokens=True)
               for e in data["examples"]}
    for task, num in (("describe", 4), ("narrate", 2)):
        examples = held_out_examples(task, num, seed=10, split="train")
        assert [e["answer"] for e in examples] == [trained[(task, i)] for i in range(num)]
        frames = data["videos"] if task == "narrate" else data["images"][:, None]
        assert all(np.array_equal(e["frames"], frames[i].numpy()) for i, e in enumerate(examples))
    held_out = held_out_examples("describe", 4, seed=10)
    assert [e["answer"] for e in held_out] != [trained[("describe", i)] for i in range(4)]
    with pytest.raises(ValueError, match="split"):
        held_out_examples("describe", 1, split="validation")


def test_duplicate_fraction_enriches_comparison_scenes(processor):
    rng = np.random.default_rng(0)
    for twins in (False, True):
        for _ in range(10):
            scene = sv.sample_duplicate_scene(rng, twins=twins)
            assert sv.has_shared_colour(scene) and (sv.has_twins(scene) or not twins)

    def shared_colour_share(data) -> float:
        texts = [processor.tokenizer.decode(e["ids"][e["start"]:]) for e in data["examples"] if e["task"] == "describe"]
        return sum("of the shapes are" in t for t in texts) / len(texts)

    plain = sv.build_training_set(60, 0, seed=3)
    same = sv.build_training_set(60, 0, seed=3, duplicate_fraction=0.0)
    assert torch.equal(plain["images"], same["images"]) and plain["examples"] == same["examples"]
    rich = sv.build_training_set(60, 0, seed=3, duplicate_fraction=1.0)
    assert shared_colour_share(rich) == 1.0 > 0.5 > shared_colour_share(plain)
    for bad in (-0.1, 1.5, "half"):
        with pytest.raises(ValueError, match="duplicate_fraction"):
            sv.build_training_set(2, 0, duplicate_fraction=bad)


def test_task_weights_option_parses_and_rejects_bad_entries():
    assert train_vlm.parse_task_weights(["qa=15", "narrate=2"]) == {"qa": 15.0, "narrate": 2.0}
    assert train_vlm.parse_task_weights([]) == {}
    for bad, message in ((["bogus=2"], "unknown task"), (["qa=x"], "TASK=NUMBER"), (["qa=0"], "finite positive"),
                         (["qa=nan"], "finite positive"), (["qa"], "TASK=NUMBER")):
        with pytest.raises(ValueError, match=message):
            train_vlm.parse_task_weights(bad)


def test_name_token_weights_mark_the_token_after_each_cue(processor):
    tokenizer = processor.tokenizer
    cue = tokenizer.convert_tokens_to_ids(train_vlm.NAME_CUE)
    assert cue != tokenizer.unk_token_id
    words = "the small pink square is to the left of the pink diamond ."
    ids = torch.tensor([tokenizer(words, add_special_tokens=False)["input_ids"]] * 2)
    weights = train_vlm.name_token_weights(ids, torch.tensor([True, False]), cue, 4.0)
    weighted = [w for w, wt in zip(words.split(), weights[0].tolist()) if wt == 4.0]
    assert weighted == ["small", "left", "pink"]  # the words after each "the"
    assert set(weights[0].tolist()) == {1.0, 4.0} and torch.equal(weights[1], torch.ones(ids.shape[1]))


def test_name_weight_raises_the_loss_on_description_names(processor):
    """make_loss_fn(name_weight=W) counts the description tokens after "the" W times: on an untrained model
    (every token about equally hard) the mean stays near the plain one, and W needs the cue's id."""
    data = sv.build_training_set(4, 1, seed=0, tokenizer=processor.tokenizer)
    cue = processor.tokenizer.convert_tokens_to_ids(train_vlm.NAME_CUE)
    trainee = train_vlm.Trainee(sv.build_model("tiny", seed=0))
    index = torch.arange(len(data["examples"]))
    plain = train_vlm.make_loss_fn(trainee, data, aux_weight=0.0)(index)
    weighted = train_vlm.make_loss_fn(trainee, data, aux_weight=0.0, name_weight=5.0, name_cue_id=cue)(index)
    assert torch.isfinite(weighted) and not torch.allclose(plain, weighted)
    assert torch.allclose(train_vlm.make_loss_fn(trainee, data, aux_weight=0.0, name_weight=1.0,
                                                 name_cue_id=cue)(index), plain)
    with pytest.raises(ValueError, match="name_cue_id"):
        train_vlm.make_loss_fn(trainee, data, name_weight=5.0)
    with pytest.raises(ValueError, match="name_weight"):
        train_vlm.make_loss_fn(trainee, data, name_weight=0.0, name_cue_id=cue)


def test_referent_targets_label_each_name_with_its_object(processor):
    """At each answer "the" that starts a name ("the [size] colour shape") the labels are that object's colour
    and shape classes; other "the"s, prompt tokens and rows not selected stay unlabelled (-100)."""
    from mmspec.world.scene import COLORS, SHAPES

    tokenizer = processor.tokenizer
    vocab = train_vlm.NameVocab(tokenizer)
    words = "the image shows two shapes . the small pink square is to the left of the cyan diamond ."
    ids = torch.tensor([tokenizer(words, add_special_tokens=False)["input_ids"]] * 2)
    answer = torch.ones(ids.shape, dtype=torch.bool)
    answer[:, :6] = False  # "the image shows two shapes ." is the prompt here
    colours, shapes = train_vlm.referent_targets(ids, answer, torch.tensor([True, False]), vocab)
    labelled = [(i, w) for i, w in enumerate(words.split()) if colours[0, i] >= 0]
    assert labelled == [(6, "the"), (15, "the")]  # not "the image" (prompt, no name), nor "the left"
    assert colours[0, 6] == list(COLORS).index("pink") and shapes[0, 6] == SHAPES.index("square")
    assert colours[0, 15] == list(COLORS).index("cyan") and shapes[0, 15] == SHAPES.index("diamond")
    assert (colours[1] == -100).all() and (shapes[1] == -100).all() and ((colours >= 0) == (shapes >= 0)).all()
    with pytest.raises(ValueError, match="outside the tokenizer"):
        train_vlm.referent_targets(ids + len(tokenizer), answer, torch.tensor([True, True]), vocab)


def test_lookalike_targets_compare_each_listed_object_with_the_earlier_ones(processor):
    """At the shape word of each listed object ("there is a small red circle ...") the labels say whether an
    earlier listed object has its colour, its shape, both; relation names and other rows stay unlabelled."""
    from mmspec.world.scene import Scene, WorldObject

    scene = Scene((WorldObject("circle", "red", "small", 0.2, 0.2), WorldObject("square", "red", "large", 0.8, 0.2),
                   WorldObject("circle", "blue", "large", 0.2, 0.8), WorldObject("circle", "red", "large", 0.8, 0.8)))
    text = describe_scene(scene)
    tokenizer = processor.tokenizer
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]] * 2)
    labels = train_vlm.lookalike_targets(ids, torch.ones(ids.shape, dtype=torch.bool), torch.tensor([True, False]),
                                         train_vlm.NameVocab(tokenizer))
    words = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    labelled = [(words[p - 1], words[p], labels[0, p].tolist()) for p in range(len(words)) if labels[0, p, 0] >= 0]
    assert labelled == [("red", "circle", [0, 0, 0]), ("red", "square", [1, 0, 0]), ("blue", "circle", [0, 1, 0]),
                        ("red", "circle", [1, 1, 1])]  # the listing order is top row first, left to right
    assert (labels[1] == -100).all()


def test_lookalike_probe_adds_its_loss(processor):
    data = sv.build_training_set(6, 1, seed=0, tokenizer=processor.tokenizer)
    vocab = train_vlm.NameVocab(processor.tokenizer)
    index = torch.tensor([i for i, e in enumerate(data["examples"]) if e["task"] == "describe"])
    vlm = sv.build_model("tiny", seed=0, text_layers=2)
    trainee = train_vlm.Trainee(vlm, referent_layer=0, lookalike_layer=1)
    base = train_vlm.make_loss_fn(trainee, data, aux_weight=0.0)(index)
    both = train_vlm.make_loss_fn(trainee, data, aux_weight=0.0, referent_weight=1.0, name_vocab=vocab,
                                  lookalike_weight=1.0)(index)
    referent = train_vlm.make_loss_fn(trainee, data, aux_weight=0.0, referent_weight=1.0, name_vocab=vocab)(index)
    assert base.item() < referent.item() < both.item()  # each probe adds its untrained loss
    both.backward()
    assert trainee.lookalike.proj.weight.grad.abs().sum() > 0 and trainee.referent.proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="lookalike_layer"):
        train_vlm.make_loss_fn(train_vlm.Trainee(vlm, referent_layer=0), data, lookalike_weight=1.0,
                               name_vocab=vocab)
    with pytest.raises(ValueError, match=r"lookalike_layer must be a text layer index"):
        train_vlm.Trainee(vlm, lookalike_layer=-1)


def test_referent_probe_reads_its_layer_and_trains_only_below_it(processor):
    """make_loss_fn(referent_weight=W) adds the probe's loss on description names, read at the trainee's
    referent layer: its gradient reaches that layer and the ones below, not the layers above (they get only
    the language-model loss, which is the same with the probe or without)."""
    data = sv.build_training_set(6, 1, seed=0, tokenizer=processor.tokenizer)
    vocab = train_vlm.NameVocab(processor.tokenizer)
    index = torch.tensor([i for i, e in enumerate(data["examples"]) if e["task"] == "describe"])
    assert len(index) > 0
    vlm = sv.build_model("tiny", seed=0, text_layers=2)
    plain = train_vlm.Trainee(vlm)
    probed = train_vlm.Trainee(vlm, referent_layer=0)
    base = train_vlm.make_loss_fn(plain, data, aux_weight=0.0)(index)
    with_probe = train_vlm.make_loss_fn(probed, data, aux_weight=0.0, referent_weight=2.0, name_vocab=vocab)
    total = with_probe(index)
    assert torch.isfinite(total) and total.item() > base.item()  # the untrained probe's cross-entropy is added
    total.backward()
    layers = vlm.model.language_model.layers
    above = [p.grad.clone() for p in layers[1].parameters()]
    below = [p.grad.clone() for p in layers[0].parameters()]
    assert probed.referent.proj.weight.grad.abs().sum() > 0
    vlm.zero_grad()
    base = train_vlm.make_loss_fn(plain, data, aux_weight=0.0)(index)
    base.backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(above, layers[1].parameters()))
    assert any(not torch.allclose(b, p.grad, atol=1e-6) for b, p in zip(below, layers[0].parameters()))
    with pytest.raises(ValueError, match="referent_layer"):
        train_vlm.make_loss_fn(plain, data, referent_weight=1.0, name_vocab=vocab)
    with pytest.raises(ValueError, match="referent_weight"):
        train_vlm.make_loss_fn(probed, data, referent_weight=float("nan"), name_vocab=vocab)
    with pytest.raises(ValueError, match=r"text layer index in \[0, 2\)"):
        train_vlm.Trainee(vlm, referent_layer=2)


def test_recipe_referent_options(tmp_path):
    """--referent-weight trains the probe in the recipe (a plain LLaVA is saved, no probe weights); a layer
    without a weight, or a bad weight, is refused before any data is built."""
    args = ["--size", "tiny", "--steps", "1", "--batch", "4", "--train-images", "12", "--train-videos", "3",
            "--threads", "1", "--vision-steps", "0"]
    train_vlm.main(args + ["--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa"), "--referent-weight", "1",
                           "--lookalike-weight", "1", "--lookalike-layer", "0"])
    saved = load_file(tmp_path / "a" / "model.safetensors")
    assert not any("referent" in key or "probe" in key for key in saved)
    checkpoint = torch.load(tmp_path / "wa" / "checkpoint.pt", map_location="cpu")["model"]
    assert "referent.proj.weight" in checkpoint and "lookalike.proj.weight" in checkpoint
    for extra, message in ((["--referent-layer", "1"], "needs --referent-weight"),
                           (["--lookalike-layer", "1"], "needs --lookalike-weight"),
                           (["--lookalike-weight", "nan"], "finite positive"),
                           (["--referent-weight", "-1"], "finite positive")):
        with pytest.raises(ValueError, match=message):
            train_vlm.main(args + ["--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb")] + extra)
        assert not (tmp_path / "wb").exists()


def test_training_batch_masks_answers_only(processor):
    data = sv.build_training_set(5, 2, seed=0)
    tasks = [e["task"] for e in data["examples"]]
    assert tasks.count("describe") == 5 and tasks.count("narrate") == 2 and "qa" in tasks
    rows = [tasks.index("describe"), tasks.index("narrate"), tasks.index("qa")]
    batch = training_batch(data, rows)
    assert batch["pixel_values"].shape[0] == 1 + sv.VIDEO_FRAMES + 1
    for b, r in enumerate(rows):
        e = data["examples"][r]
        answer = batch["input_ids"][b][batch["loss_mask"][b]].tolist()
        assert answer == e["ids"][e["start"]:] and answer[-1] == processor.tokenizer.eos_token_id
        assert processor.image_token_id not in answer
    assert batch["patch_classes"].shape == (batch["pixel_values"].shape[0], 64, len(sv.PATCH_FIELDS))
    assert torch.equal(batch["patch_classes"][1:1 + sv.VIDEO_FRAMES], data["patch_classes"][5:5 + sv.VIDEO_FRAMES].long())
    model = sv.build_model("tiny")
    seeing, n = answer_loss(model, batch)
    blind, m = answer_loss(model, {k: v for k, v in batch.items() if k != "pixel_values"})
    assert n == m == int(batch["loss_mask"][:, 1:].sum()) and torch.isfinite(blind) and blind != seeing
    # row weights: all ones is the plain loss; weight w on a row counts its answer tokens w times
    ones, k = answer_loss(model, batch, torch.ones(3))
    assert k == n and torch.allclose(ones, seeing)
    per_row = [answer_loss(model, training_batch(data, [r]))[0] for r in rows]
    weighted, w = answer_loss(model, batch, torch.tensor([1.0, 1.0, 15.0]))
    qa_tokens = int(batch["loss_mask"][2, 1:].sum())
    assert w == pytest.approx(n + 14 * qa_tokens)
    assert torch.allclose(weighted, per_row[0] + per_row[1] + 15 * per_row[2], rtol=1e-4)
    with pytest.raises(ValueError, match="row_weights"):
        answer_loss(model, batch, torch.ones(2))
    # token weights: weight w on one answer token counts it w times; both kinds multiply
    token_weights = torch.ones(batch["input_ids"].shape)
    position = int(batch["loss_mask"][0].nonzero()[3])  # the fourth answer token of the description
    token_weights[0, position] = 5.0
    one_token, c = answer_loss(model, batch, token_weights=token_weights)
    assert c == pytest.approx(n + 4)
    logits = model(input_ids=batch["input_ids"][:1], attention_mask=batch["attention_mask"][:1],
                   pixel_values=batch["pixel_values"][:1]).logits
    single = torch.nn.functional.cross_entropy(logits[0, position - 1], batch["input_ids"][0, position])
    assert torch.allclose(one_token, seeing + 4 * single, rtol=1e-4)
    both, d = answer_loss(model, batch, torch.tensor([2.0, 1.0, 1.0]), token_weights)
    assert d == pytest.approx(n + int(batch["loss_mask"][0, 1:].sum()) + 8)  # row 0 twice, its token 10 times
    with pytest.raises(ValueError, match="token_weights"):
        answer_loss(model, batch, token_weights=torch.ones(3, 2))
    chunks = train_vlm.chunks_by_length(data, list(range(len(tasks))), max_tokens=400)
    assert sorted(r for c in chunks for r in c) == list(range(len(tasks)))
    assert all(len(c) * max(len(data["examples"][r]["ids"]) for r in c) <= 400 or len(c) == 1 for c in chunks)


# -- decoding paths -------------------------------------------------------------------------------------------
def test_vlm_runner_equals_generate(tiny_pair):
    target, _, processor = tiny_pair
    inputs = _batch(processor)
    n = 24
    reference = target.generate(**inputs, do_sample=False, max_new_tokens=n, min_new_tokens=n)
    reference = reference[:, inputs["input_ids"].shape[1]:]
    out = speculative_generate(VLMRunner(target), None, max_new_tokens=n, **inputs)
    assert torch.equal(out.sequences, reference)
    assert max(len(set(row.tolist())) for row in reference) > 3


def test_assisted_generation_with_the_draft_vlm_is_lossless(tiny_pair):
    target, draft, processor = tiny_pair
    image = sv.image_example("test", 0, 2, "describe")["frames"][0]
    inputs = sv.vlm_inputs(processor, [image], ["describe"])
    # Random models may emit <image>; a drafted <image> would make the target's first verification forward see
    # more placeholders than images (a trained model never emits it). Both models suppress the special tokens.
    specials = [processor.tokenizer.convert_tokens_to_ids(t) for t in (sv.PAD, sv.BOS, sv.UNK, sv.IMAGE)]
    draft.generation_config.suppress_tokens = specials
    n, kwargs = 24, dict(do_sample=False, max_new_tokens=24, min_new_tokens=24, suppress_tokens=specials)
    try:
        greedy = target.generate(**inputs, **kwargs)
        assisted = target.generate(**inputs, **kwargs, assistant_model=draft)
        lookup = target.generate(**inputs, **kwargs, prompt_lookup_num_tokens=3)
    finally:
        draft.generation_config.suppress_tokens = None
    assert torch.equal(assisted, greedy) and torch.equal(lookup, greedy)
    assert greedy.shape[1] == inputs["input_ids"].shape[1] + n
    assert sv.decode_answers(processor, assisted, inputs["input_ids"].shape[1]) == \
        sv.decode_answers(processor, greedy, inputs["input_ids"].shape[1])


def test_report_sentence_errors_are_order_free_and_by_kind():
    from mmspec.models.recipes.report_vlm import relation_parts, sentence_errors, sentence_kind
    from mmspec.world.captions import describe_scene
    from mmspec.world.scene import Scene, WorldObject

    scene = Scene((WorldObject("circle", "pink", "small", 0.2, 0.5), WorldObject("circle", "pink", "small", 0.5, 0.5),
                   WorldObject("square", "blue", "large", 0.2, 0.85)))
    reference = describe_scene(scene)
    sentences = [s.strip() for s in reference.split(".") if s.strip()]
    kinds = [sentence_kind(s) for s in sentences]
    assert kinds[:5] == ["count", "object", "object", "object", "shape totals"]
    assert kinds[5] == "shared colour" and set(kinds[6:]) == {"relation"}
    # the output drops the shared-colour sentence and swaps one relation: only those two count as missed,
    # although every later sentence has moved up by one place
    wrong = sentences[6].replace("to the left of", "above")
    output = ". ".join(sentences[:5] + [wrong] + sentences[7:]) + "."
    errors = sentence_errors([(reference, output), (reference, reference)])
    assert errors["shared colour"] == {"n": 2, "missed": 1, "extra": 0}
    assert errors["relation"] == {"n": 6, "missed": 1, "extra": 1}
    assert errors["relation direction"]["missed"] == 1 and "relation names" not in errors
    assert errors["object"] == {"n": 6, "missed": 0, "extra": 0} and errors["count"] == {"n": 2, "missed": 0, "extra": 0}
    # a needlessly qualified name is a naming miss, not a direction one; a shared-colour sentence for a
    # colour seen once is extra
    renamed = sentences[8].replace("the blue square", "the large blue square")
    assert renamed != sentences[8]
    output = ". ".join(sentences[:6] + ["two of the shapes are blue"] + sentences[6:8] + [renamed]) + "."
    errors = sentence_errors([(reference, output)])
    assert errors["relation names"]["missed"] == 1 and "relation direction" not in errors
    assert errors["shared colour"] == {"n": 1, "missed": 0, "extra": 1}
    assert relation_parts(sentences[6]) == ("small pink circle on the left", "to the left of",
                                            "small pink circle in the center")
    assert relation_parts(sentences[0]) is None
    single = describe_scene(Scene((WorldObject("circle", "red", "small", 0.5, 0.5),)))
    assert sentence_kind(single.split(".")[-2].strip()) == "single-object summary"


def test_report_breaks_question_accuracy_down_by_template():
    from mmspec.models.recipes.report_vlm import exact_by_question_kind

    questions = ["how many circles are there?", "how many red shapes are there?", "what color is the square?",
                 "what color is the circle?", "is the red circle above the blue square?"]
    out = exact_by_question_kind([True, False, True, False, True], questions)
    assert out["exact_by_kind"] == {"color": 0.5, "count (shape)": 1.0, "count (color)": 0.0, "relation": 1.0}
    assert out["n_by_kind"] == {"color": 2, "count (shape)": 1, "count (color)": 1, "relation": 1}


def test_report_tells_colour_binding_errors_from_misread_colours():
    from mmspec.models.recipes.report_vlm import wrong_color_answers
    from mmspec.world.scene import Scene, WorldObject

    scene = Scene((WorldObject("circle", "blue", "small", 0.2, 0.2), WorldObject("diamond", "purple", "large", 0.7, 0.7)))
    colour = {"question": "what color is the circle?", "answer": "blue", "scene": scene}
    count = {"question": "how many circles are there?", "answer": "one", "scene": scene}
    caption = {"question": None, "answer": "a small blue circle", "scene": scene}
    examples = [colour, colour, colour, count, caption]
    assert wrong_color_answers(examples, ["blue", "purple", "green", "two", "x"]) == {"n": 2, "another_objects_color": 1}
    assert wrong_color_answers(examples[:1], ["blue"]) == {"n": 0, "another_objects_color": 0}


def test_report_object_parts_ignore_only_the_order_of_objects():
    from mmspec.models.recipes.report_vlm import object_parts
    from mmspec.world import narrate_video, sample_video

    swapped_clips = 0
    for seed in range(30):
        clip = sample_video(seed, num_objects=2, num_frames=4)
        swapped = with_objects_reversed(clip)
        for task, text in (("video_caption", caption_video), ("narrate", narrate_video)):
            a, b = text(clip), text(swapped)
            assert object_parts(task, a) == object_parts(task, b)
            assert len(object_parts(task, a)) >= 2
            swapped_clips += a != b
        # a wrong direction ("down and to the left" for "down") is not an order difference
        caption = caption_video(clip)
        for phrase in ("moving down and to the left", "moving up and to the right"):
            if phrase in caption:
                changed = caption.replace(phrase, phrase.split(" and")[0], 1)
                assert object_parts("video_caption", changed) != object_parts("video_caption", caption)
    assert swapped_clips == 60
    with pytest.raises(ValueError, match="video tasks"):
        object_parts("describe", "a red circle")


def with_objects_reversed(clip):
    """The clip with its two objects' list order reversed (same frames)."""
    from dataclasses import replace

    return replace(clip, objects=clip.objects[::-1], directions=clip.directions[::-1], speeds=clip.speeds[::-1])


def test_report_name_errors_tell_added_from_dropped_qualifiers():
    from mmspec.models.recipes.report_vlm import (
        look_alike_group,
        name_errors,
        name_errors_by_look_alikes,
        relation_names,
    )
    from mmspec.world.captions import describe_scene
    from mmspec.world.scene import Scene, WorldObject

    # two green diamonds (twins: named by region) and a white circle beside a white triangle (a shared
    # colour only: plain names)
    scene = Scene((WorldObject("diamond", "green", "small", 0.2, 0.2), WorldObject("diamond", "green", "small", 0.8, 0.5),
                   WorldObject("circle", "white", "large", 0.2, 0.8), WorldObject("triangle", "white", "medium", 0.55, 0.85)))
    reference = describe_scene(scene)
    names = relation_names(reference)
    assert names == {"small green diamond in the top left", "small green diamond on the right", "white circle",
                     "white triangle"}
    assert name_errors([(reference, reference)]) == {"names": 4, "over_qualified": 0, "under_qualified": 0, "other": 0}
    output = (reference.replace("the white circle", "the large white circle")
              .replace("the small green diamond in the top left", "the green diamond")
              .replace("the white triangle", "the white square"))
    assert name_errors([(reference, output), (reference, reference)]) == \
        {"names": 8, "over_qualified": 1, "under_qualified": 1, "other": 1}
    groups = name_errors_by_look_alikes([(scene, reference, output), (scene, reference, reference)])
    assert groups["look-alike (same colour and shape)"] == {"names": 4, "wrong": 1}
    assert groups["colour shared"] == {"names": 4, "wrong": 2}
    assert all(groups[g] == {"names": 0, "wrong": 0} for g in ("nothing shared", "shape shared",
                                                                 "colour and shape, by different objects"))
    # a red circle beside a red square and a blue circle: colour and shape are both shared, by different objects
    mixed = Scene((WorldObject("circle", "red", "small", 0.2, 0.2), WorldObject("square", "red", "large", 0.8, 0.2),
                   WorldObject("circle", "blue", "large", 0.5, 0.8)))
    assert look_alike_group(mixed, "red", "circle") == "colour and shape, by different objects"
    assert look_alike_group(mixed, "red", "square") == "colour shared"
    assert look_alike_group(mixed, "blue", "circle") == "shape shared"
