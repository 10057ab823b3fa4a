"""The four pipelines follow diffusers' conventions: ``diffusers.DiffusionPipeline.from_pretrained`` loads their
folders, every component resolves with diffusers' own loader, hub ids load from the Hugging Face cache, the
word vocabulary is a tokenizer component, loading keywords, per-output generators, model CPU offload and
``callback_on_step_end`` work as in diffusers.

Every call is tiny (greedy EAGLE for the t2i model, a few MAR iterations, one video block, four VLM tokens);
the zoo pipelines are loaded once per module.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.pipelines.pipeline_loading_utils import ALL_IMPORTABLE_CLASSES, get_class_obj_and_candidates
from transformers import PreTrainedTokenizerFast

import mmspec.pipelines
from mmspec.models.text import WordTokenizer
from mmspec.pipelines import hub
from mmspec.pipelines.hub import ComponentLoadError, LoadOptions
from mmspec.pipelines.pretrained import component_library
from mmspec.world import render_scene, sample_scene, split_words, vocabulary

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ZOO = {"ARImagePipeline": "shapes-t2i", "ContinuousARImagePipeline": "shapes-t2i-continuous",
       "ARVideoPipeline": "shapes-video", "VLMPipeline": "shapes-vlm"}
PROMPT = {"ARImagePipeline": "a red circle", "ContinuousARImagePipeline": "a red circle",
          "ARVideoPipeline": "a red circle moving right", "VLMPipeline": "describe the image in detail."}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _seed(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def short_call(pipe, prompt=None, **extra):
    """One tiny call of ``pipe`` returning its generated tensor(s) (tokens, latents or answer ids)."""
    name = type(pipe).__name__
    prompt = PROMPT[name] if prompt is None else prompt
    if name == "ARImagePipeline":  # greedy EAGLE is lossless: the target's tokens in a few target calls
        return pipe(prompt, method="eagle", do_sample=False, guidance_scale=1.0, output_type="tokens", **extra).tokens
    if name == "ContinuousARImagePipeline":
        extra.setdefault("generator", _seed())
        return pipe(prompt, num_iter=4, num_diffusion_steps=2, output_type="latent", **extra).tokens
    if name == "ARVideoPipeline":
        extra.setdefault("generator", _seed())
        return pipe(prompt, num_blocks=1, num_inference_steps=1, output_type="latent", **extra).latents
    images = [_image_for(text) for text in prompt] if isinstance(prompt, list) else _image_for(prompt)
    return torch.cat(pipe(images, prompt, max_new_tokens=4, **extra).tokens)


def _image_for(prompt: str):
    """The scene a VLM prompt is asked about (one per prompt, whatever the batch)."""
    return render_scene(sample_scene(len(prompt)), image_size=64)


def assert_same_output(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Token ids bit for bit; float latents of two model instances up to float32 reduction order (BLAS may
    pick another order for differently aligned weights: ``tests/pipeline_utils.py``'s ACROSS_INSTANCES)."""
    if actual.is_floating_point():
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(actual, expected)


def _quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def zoo():
    """name -> the zoo pipeline loaded with its own from_pretrained (loaded on first use)."""
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = _quiet(getattr(mmspec.pipelines, name).from_pretrained(f"mmspec/{ZOO[name]}"))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def reference(zoo):
    """name -> the zoo pipeline's output of :func:`short_call` (computed on first use)."""
    cache: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in cache:
            cache[name] = short_call(zoo(name))
        return cache[name]

    return get


# -- diffusers' own from_pretrained ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ZOO))
def test_diffusers_loads_a_folder_written_by_save_pretrained(name, zoo, reference, tmp_path):
    zoo(name).save_pretrained(tmp_path / "pipe")
    loaded = _quiet(DiffusionPipeline.from_pretrained(tmp_path / "pipe"))
    assert type(loaded) is type(zoo(name))
    assert loaded.speculation_settings.to_dict() == zoo(name).speculation_settings.to_dict()  # read on first use
    assert_same_output(short_call(loaded), reference(name))


@pytest.mark.parametrize("name", list(ZOO))
def test_diffusers_loads_the_bundled_zoo_folder(name, reference):
    folder = hub.zoo_dir() / ZOO[name]
    loaded = _quiet(DiffusionPipeline.from_pretrained(folder, dtype=torch.float32))
    assert type(loaded).__name__ == name and loaded.config._name_or_path == folder
    assert_same_output(short_call(loaded), reference(name))


def test_a_fresh_interpreter_needs_only_the_pipeline_import():
    """The class is found on the diffusers module and the component libraries (here the tokenizers package,
    which the video pipeline's module does not import) are imported by the pipeline's hook, not by the user."""
    script = ("import sys, diffusers, mmspec.pipelines.ar_video\n"
              "assert 'mmspec.models.tokenizers' not in sys.modules\n"
              f"pipe = diffusers.DiffusionPipeline.from_pretrained({str(hub.zoo_dir() / 'shapes-video')!r})\n"
              "print(type(pipe).__name__, type(pipe.vae).__name__, type(pipe.text_tokenizer).__name__)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ARVideoPipeline", "ContinuousTokenizer", "WordTokenizer"]


@pytest.mark.parametrize("order", ["import mmspec\nimport diffusers", "import diffusers\nimport mmspec"])
def test_a_fresh_interpreter_needs_only_import_mmspec(order):
    """After ``import mmspec`` alone (before or after diffusers), ``DiffusionPipeline.from_pretrained`` resolves
    the folder's ``_class_name`` on diffusers, importing only the pipeline module it names; diffusers' own names
    and its error for an unknown name are untouched."""
    script = (f"import sys\n{order}\n"
              "assert 'mmspec.pipelines.ar_image' not in sys.modules\n"
              f"pipe = diffusers.DiffusionPipeline.from_pretrained({str(hub.zoo_dir() / 'shapes-t2i')!r})\n"
              "print(type(pipe).__name__, 'mmspec.pipelines.ar_video' in sys.modules)\n"
              "print(diffusers.ARImagePipeline is type(pipe), diffusers.UNet2DModel.__module__.split('.')[0])\n"
              "try:\n    diffusers.NoSuchPipeline\nexcept AttributeError as error:\n    print('NoSuchPipeline' in str(error))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ARImagePipeline", "False", "True", "diffusers", "True"]


def test_pipeline_classes_are_exposed_on_diffusers_without_replacing_its_names():
    import diffusers

    for name in ZOO:
        assert getattr(diffusers, name) is getattr(mmspec.pipelines, name)
    assert diffusers.DiffusionPipeline.__module__.startswith("diffusers")


# -- components: what model_index.json records ----------------------------------------------------------------


def _diffusers_finds(library: str, class_name: str) -> bool:
    """diffusers' own rule: the class on the library, and a loadable base class of it there too."""
    from diffusers import pipelines

    class_obj, candidates = get_class_obj_and_candidates(library, class_name, ALL_IMPORTABLE_CLASSES, pipelines,
                                                         False)
    return any(base is not None and issubclass(class_obj, base) for base in candidates.values())


@pytest.mark.parametrize("name", list(ZOO))
def test_every_zoo_component_resolves_with_diffusers_own_lookup(name):
    import importlib

    index = json.loads((hub.zoo_dir() / ZOO[name] / "model_index.json").read_text())
    entries = {key: value for key, value in index.items() if isinstance(value, list) and value[0] is not None}
    assert entries
    for key, (library, class_name) in entries.items():
        importlib.import_module(library)
        assert _diffusers_finds(library, class_name), (key, library, class_name)


def test_components_are_recorded_under_the_package_that_serves_them():
    from mmspec.models.eagle import EagleHead
    from mmspec.models.mar import MARModel
    from mmspec.models.tokenizers import ContinuousTokenizer, VQTokenizer
    from mmspec.models.vlm_drafters import FlashHead, SpecVLMHead

    assert component_library(VQTokenizer) == component_library(ContinuousTokenizer) == "mmspec.models.tokenizers"
    assert component_library(FlashHead) == component_library(SpecVLMHead) == "mmspec.models.vlm_drafters"
    assert component_library(WordTokenizer) == "mmspec.models.text"
    assert component_library(MARModel) == "mmspec.models.mar" and component_library(EagleHead) == "mmspec.models.eagle"
    # the defining module diffusers would record does not serve: its loader found no ModelMixin there
    assert not _diffusers_finds("mmspec.models.tokenizers.continuous", "ContinuousTokenizer")


# -- hub ids: the Hugging Face cache ----------------------------------------------------------------------------


def _cache_snapshot(cache: Path, repo: str) -> Path:
    """An empty snapshot folder of ``repo`` in a hub cache laid out as huggingface_hub writes it."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    return root / "snapshots" / COMMIT


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A temporary HF_HUB_CACHE (offline: the tests' conftest sets HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("name", ["ContinuousARImagePipeline", "ARVideoPipeline"])
def test_hub_ids_load_from_the_local_cache(name, zoo, reference, hub_cache):
    cls = getattr(mmspec.pipelines, name)
    zoo(name).save_pretrained(_cache_snapshot(hub_cache, f"someone/{ZOO[name]}"))
    loaded = _quiet(cls.from_pretrained(f"someone/{ZOO[name]}"))
    assert loaded.config._name_or_path == f"someone/{ZOO[name]}"
    assert loaded.text_tokenizer.words == zoo(name).text_tokenizer.words  # the vocabulary came with the snapshot
    assert loaded.speculation_settings.to_dict() == zoo(name).speculation_settings.to_dict()
    assert_same_output(short_call(loaded), reference(name))
    pinned = cls.from_pretrained(f"someone/{ZOO[name]}", revision=COMMIT, local_files_only=True)
    assert pinned.text_tokenizer is not None
    with pytest.raises(FileNotFoundError, match="cannot load 'someone/absent'.*local Hugging Face cache"):
        cls.from_pretrained("someone/absent")


def test_a_hub_snapshot_of_the_older_layout_keeps_its_vocabulary(zoo, hub_cache):
    snapshot = _cache_snapshot(hub_cache, "someone/old-video")
    pipe = zoo("ARVideoPipeline")
    pipe.save_pretrained(snapshot)
    _to_older_layout(snapshot, pipe.text_tokenizer)
    loaded = mmspec.pipelines.ARVideoPipeline.from_pretrained("someone/old-video")
    assert isinstance(loaded.text_tokenizer, WordTokenizer) and loaded.text_tokenizer.words == pipe.text_tokenizer.words


# -- the word vocabulary ------------------------------------------------------------------------------------------


def _to_older_layout(folder: Path, words: WordTokenizer) -> None:
    """Rewrite a saved folder as it was before the vocabulary was a component: transformer/text_vocab.json."""
    shutil.rmtree(folder / "text_tokenizer")
    index = json.loads((folder / "model_index.json").read_text())
    del index["text_tokenizer"]
    (folder / "model_index.json").write_text(json.dumps(index))
    words.save(folder / "transformer" / "text_vocab.json")


def test_the_word_vocabulary_is_a_lowercasing_fast_tokenizer(tmp_path):
    words = WordTokenizer(vocabulary())
    assert isinstance(words, PreTrainedTokenizerFast) and len(words) == len(vocabulary())
    assert words.backend_tokenizer.normalizer.normalize_str("A Red CIRCLE") == "a red circle"
    for text in ["A Red Circle", "two  blue squares, left of a red circle?", "A red-circle!! moving RIGHT.", "  "]:
        assert words.split(text) == split_words(text)
    assert words("Two Blue Squares")["input_ids"] == words.encode("two blue squares") == words.encode("TWO blue squares")
    with pytest.raises(ValueError, match=r"outside the model's vocabulary: \['zebra'\]"):
        words.encode("a Zebra")
    words.save_pretrained(tmp_path / "tok")
    again = WordTokenizer.from_pretrained(tmp_path / "tok")
    assert again.words == words.words and again.encode("A red circle") == words.encode("a red circle")
    with pytest.raises(ValueError, match="duplicates"):
        WordTokenizer(["a", "a"])


@pytest.mark.parametrize("name", ["ARImagePipeline", "ContinuousARImagePipeline", "ARVideoPipeline"])
def test_the_vocabulary_is_a_component_and_older_folders_still_load(name, zoo, tmp_path):
    pipe = zoo(name)
    pipe.save_pretrained(tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["text_tokenizer"] == ["mmspec.models.text", "WordTokenizer"]
    assert not (tmp_path / "pipe" / "transformer" / "text_vocab.json").exists()
    _to_older_layout(tmp_path / "pipe", pipe.text_tokenizer)
    older = getattr(mmspec.pipelines, name).from_pretrained(tmp_path / "pipe")
    assert older.text_tokenizer.words == pipe.text_tokenizer.words
    older.save_pretrained(tmp_path / "again")  # saving converts it for good
    assert (tmp_path / "again" / "text_tokenizer" / "tokenizer.json").is_file()


# -- loading keywords -------------------------------------------------------------------------------------------


def test_dtype_and_torch_dtype(zoo):
    cls = mmspec.pipelines.ContinuousARImagePipeline
    assert cls.from_pretrained("mmspec/shapes-t2i-continuous", dtype=torch.float64).transformer.dtype == torch.float64
    old_name = cls.from_pretrained("mmspec/shapes-t2i-continuous", torch_dtype=torch.float64)
    assert old_name.transformer.dtype == torch.float64
    mixed = cls.from_pretrained("mmspec/shapes-t2i-continuous", dtype={"transformer": torch.float64})
    assert mixed.transformer.dtype == torch.float64 and mixed.vae.dtype == torch.float32  # the class default
    with pytest.raises(ValueError, match="dtype=torch.float64 and torch_dtype=torch.float16 disagree"):
        cls.from_pretrained("mmspec/shapes-t2i-continuous", dtype=torch.float64, torch_dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype must be a torch.dtype"):
        cls.from_pretrained("mmspec/shapes-t2i-continuous", dtype="float64")


@pytest.mark.parametrize("name", list(ZOO))
def test_variant_round_trip(name, zoo, reference, tmp_path):
    pipe = zoo(name)
    pipe.save_pretrained(tmp_path / "pipe", variant="fp16")
    weights = sorted(p.name for p in (tmp_path / "pipe").glob("*/*.safetensors"))
    assert weights and all(".fp16." in file for file in weights)
    loaded = _quiet(type(pipe).from_pretrained(tmp_path / "pipe", variant="fp16"))
    assert_same_output(short_call(loaded), reference(name))
    with pytest.raises(ValueError, match="variant='bf16': no component"):
        type(pipe).from_pretrained(tmp_path / "pipe", variant="bf16")
    if name == "ARVideoPipeline":  # the same folder through diffusers' loader, and without the variant
        assert_same_output(short_call(_quiet(DiffusionPipeline.from_pretrained(tmp_path / "pipe", variant="fp16"))),
                           reference(name))
        with pytest.raises(ComponentLoadError, match="'transformer'"):
            type(pipe).from_pretrained(tmp_path / "pipe")


def test_device_map_and_the_other_loading_keywords(reference):
    cls = mmspec.pipelines.ARVideoPipeline
    on_cpu = _quiet(cls.from_pretrained("mmspec/shapes-video", device_map="cpu", use_safetensors=True,
                                        local_files_only=True))
    assert on_cpu.hf_device_map == "cpu" and on_cpu.transformer.device.type == "cpu"
    assert_same_output(short_call(on_cpu), reference("ARVideoPipeline"))
    eager = _quiet(cls.from_pretrained("mmspec/shapes-video", low_cpu_mem_usage=False))
    assert_same_output(short_call(eager), reference("ARVideoPipeline"))
    with pytest.raises(ValueError, match="device_map='balanced' is not supported"):
        cls.from_pretrained("mmspec/shapes-video", device_map="balanced")
    with pytest.raises(ValueError, match="device_map=.* is not supported"):
        cls.from_pretrained("mmspec/shapes-video", device_map={"": "cpu"})
    with pytest.raises(ValueError, match="needs low_cpu_mem_usage=True"):
        cls.from_pretrained("mmspec/shapes-video", device_map="cpu", low_cpu_mem_usage=False)
    with pytest.raises(ValueError, match=r"unexpected keyword arguments .*\['quantization_config'\]"):
        cls.from_pretrained("mmspec/shapes-video", quantization_config=object())
    with pytest.raises(ValueError, match="use_safetensors must be True, False or None"):
        LoadOptions(use_safetensors="yes")


# -- generators --------------------------------------------------------------------------------------------------

TWO_PROMPTS = {"ContinuousARImagePipeline": ["a red circle", "two blue squares"],
               "ARVideoPipeline": ["a red circle moving right", "a blue square moving left"],
               "VLMPipeline": ["describe the image in detail.", "how many shapes are there?"]}


@pytest.mark.parametrize("name", list(TWO_PROMPTS))
def test_a_list_of_generators_gives_each_row_its_own_stream(name, zoo):
    pipe, prompts = zoo(name), TWO_PROMPTS[name]
    extra = {"do_sample": True} if name == "VLMPipeline" else {}
    batch = short_call(pipe, prompts, generator=[_seed(3), _seed(4)], **extra)
    alone = [short_call(pipe, [prompt] if name == "VLMPipeline" else prompt, generator=_seed(seed), **extra)
             for prompt, seed in zip(prompts, (3, 4))]
    assert torch.equal(batch, torch.cat(alone))
    swapped = short_call(pipe, prompts[::-1], generator=[_seed(4), _seed(3)], **extra)
    assert torch.equal(swapped, torch.cat(alone[::-1]))  # a row depends on its prompt and generator only
    with pytest.raises(ValueError, match="generator is a list of 3 generators, but the call makes 2"):
        short_call(pipe, prompts, generator=[_seed(), _seed(), _seed()], **extra)
    with pytest.raises(ValueError, match=r"generator\[1\] is a int"):
        short_call(pipe, prompts, generator=[_seed(), 5], **extra)


def test_per_row_calls_hand_the_callback_the_whole_batch(zoo):
    pipe, seen = zoo("ContinuousARImagePipeline"), []

    def record(pipeline, step, timestep, kwargs):
        seen.append(kwargs["num_generated"].clone())
        return kwargs

    short_call(pipe, TWO_PROMPTS["ContinuousARImagePipeline"], generator=[_seed(1), _seed(2)],
               callback_on_step_end=record, callback_on_step_end_tensor_inputs=["num_generated"])
    assert seen and all(counts.shape == (2,) for counts in seen)
    first, second = seen[: len(seen) // 2], seen[len(seen) // 2:]  # row 0's passes, then row 1's
    assert all(c[1] == 0 for c in first) and all(c[0] == 0 for c in second) and first[-1][0] == second[-1][1] > 0


def test_streaming_with_a_list_of_generators_keeps_the_rows(zoo):
    pipe = zoo("VLMPipeline")
    prompts = TWO_PROMPTS["VLMPipeline"]
    images = [_image_for(prompt) for prompt in prompts]
    chunks = list(pipe.stream(images, prompts, do_sample=True, max_new_tokens=4, generator=[_seed(3), _seed(4)]))
    final = chunks[-1]
    for row in (0, 1):
        ids = [token for chunk in chunks[:-1] if chunk.row == row for token in chunk.tokens]
        assert ids == final.tokens[row].tolist()


# -- model CPU offload --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ZOO))
def test_model_cpu_offload_names_existing_components(name):
    cls = getattr(mmspec.pipelines, name)
    modules, _ = cls._get_signature_keys(cls)
    assert cls.model_cpu_offload_seq and set(cls.model_cpu_offload_seq.split("->")) <= set(modules)
    assert set(cls._exclude_from_cpu_offload) <= set(modules)
    assert not set(cls._exclude_from_cpu_offload) & set(cls.model_cpu_offload_seq.split("->"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error diffusers raises without an accelerator")
def test_model_cpu_offload_without_an_accelerator_raises_diffusers_error(zoo, reference):
    pipe = zoo("ARVideoPipeline")
    with pytest.raises(RuntimeError, match="`enable_model_cpu_offload` requires accelerator"):
        pipe.enable_model_cpu_offload()
    assert_same_output(short_call(pipe), reference("ARVideoPipeline"))  # still usable


# -- callback_on_step_end -----------------------------------------------------------------------------------------


class Recorder(PipelineCallback):
    """A diffusers callback class: records the tensors it is given."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names, self.calls = names, []

    @property
    def tensor_inputs(self) -> list[str]:
        return self.names

    def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
        self.calls.append((step_index, sorted(callback_kwargs)))
        return callback_kwargs


def _interrupt_at(step_to_stop: int, seen: list):
    """A callback that sets ``pipeline._interrupt`` (diffusers' way to stop a call) at ``step_to_stop``."""

    def callback(pipeline, step, timestep, callback_kwargs):
        seen.append(step)
        if step == step_to_stop:
            pipeline._interrupt = True
        return callback_kwargs

    return callback


@pytest.mark.parametrize("name, stop", [("ARImagePipeline", 1), ("VLMPipeline", 0)])
def test_interrupt_set_in_a_callback_stops_the_call_with_the_output_so_far(name, stop, zoo, reference):
    """As in diffusers: the call ends after the step whose callback set ``_interrupt`` and returns what it has
    generated (a prefix of the uninterrupted greedy output; an image's other positions hold token 0); the next
    call starts uninterrupted."""
    pipe, seen, full = zoo(name), [], reference(name).flatten()
    partial = short_call(pipe, callback_on_step_end=_interrupt_at(stop, seen)).flatten()
    assert seen == list(range(stop + 1)) and pipe._interrupt
    if name == "ARImagePipeline":
        generated = int((partial != 0).nonzero().max()) + 1  # token 0 past what was generated
        assert 1 < generated < full.numel() and torch.equal(partial[generated:], torch.zeros_like(partial[generated:]))
    else:
        generated = partial.numel()
        assert 1 <= generated < full.numel()
    assert torch.equal(partial[:generated], full[:generated])
    assert_same_output(short_call(pipe), reference(name))  # the flag is reset by the next call


def test_partial_tokens_join_the_steps_rows_without_their_padding():
    """An interrupted token call's output: each row's committed tokens in order (the -1 padding of every step
    left out, at most max_new_tokens), the drafted flags beside them, the rest padded."""
    from mmspec.pipelines.callbacks import PartialTokens

    partial = PartialTokens(batch=2, max_new_tokens=4, pad_token_id=9)
    partial.add(torch.tensor([[5], [6]]), torch.tensor([[False], [False]]))
    partial.add(torch.tensor([[7, 8, -1], [1, -1, -1]]), torch.tensor([[True, False, False], [False] * 3]))
    partial.add(torch.tensor([[2, 3], [4, -1]]), torch.tensor([[True, True], [True, False]]))
    out = partial.output(stats="stats")
    assert out.sequences.tolist() == [[5, 7, 8, 2], [6, 1, 4, 9]] and out.lengths.tolist() == [4, 3]
    assert out.drafted.tolist() == [[False, True, False, True], [False, False, True, False]]
    assert out.stats == "stats"


def test_interrupt_ends_a_continuous_image_after_the_pass_whose_callback_set_it(zoo):
    """MAR's step is a target pass: the tokens generated so far are the uninterrupted call's (same seed), the
    others zero, and the statistics count what was generated."""
    pipe, prompt, seen = zoo("ContinuousARImagePipeline"), PROMPT["ContinuousARImagePipeline"], []
    kwargs = dict(num_iter=4, num_diffusion_steps=2, output_type="latent")
    full = pipe(prompt, generator=_seed(), **kwargs)
    out = pipe(prompt, generator=_seed(), callback_on_step_end=_interrupt_at(1, seen), **kwargs)
    assert seen == [0, 1]
    made = out.tokens.flatten(1, 2).abs().sum(-1) > 0  # [1, L]: the grid positions generated
    assert 0 < int(made.sum()) < made.numel() and out.stats.tokens == int(made.sum())
    assert_same_output(out.tokens.flatten(1, 2)[made], full.tokens.flatten(1, 2)[made])


def test_interrupt_ends_a_video_after_the_block_whose_callback_set_it(zoo):
    """The video pipeline's step is a block: the call returns the blocks so far (the uninterrupted call's first
    blocks, same seed) with their statistics; with a list of generators every video has that many blocks."""
    pipe, prompt = zoo("ARVideoPipeline"), PROMPT["ARVideoPipeline"]
    fb, seen = pipe.frames_per_block, []
    kwargs = dict(num_blocks=3, num_inference_steps=1, output_type="latent")
    full = pipe(prompt, generator=_seed(), **kwargs).latents
    out = pipe(prompt, generator=_seed(), callback_on_step_end=_interrupt_at(1, seen), **kwargs)
    assert seen == [0, 1] and out.latents.shape[1] == 2 * fb and out.stats.tokens == 2 * fb
    assert_same_output(out.latents, full[:, :2 * fb])
    assert out.stats.accepted.shape == (1, 2)
    seen = []
    both = pipe([prompt, prompt], generator=[_seed(1), _seed(2)], callback_on_step_end=_interrupt_at(0, seen),
                **kwargs)
    assert seen == [0] and both.latents.shape[:2] == (2, fb) and pipe._interrupt


def test_interrupt_with_a_list_of_generators_ends_the_images_not_started_yet():
    """With a list of generators each image is its own call: the interrupt ends the current one, and the images
    not started yet stop after their first token."""
    pipe, seen = _quiet(mmspec.pipelines.ARImagePipeline.from_pretrained("mmspec/shapes-t2i")), []
    out = pipe(["a red circle", "a blue square"], method="eagle", do_sample=False, guidance_scale=1.0,
               output_type="tokens", generator=[_seed(1), _seed(2)], callback_on_step_end=_interrupt_at(1, seen))
    flat = out.tokens.flatten(1)
    assert seen == [0, 1, 0]  # the first image's rounds 0 and 1, the second image's first token
    assert int((flat[1] != 0).sum()) <= 1 and int((flat[0] != 0).sum()) > 1
    assert not out.drafted.flatten(1)[1].any()


@pytest.mark.parametrize("name", list(ZOO))
def test_callbacks_in_diffusers_signature(name, zoo, reference):
    pipe = zoo(name)
    offered = type(pipe)._callback_tensor_inputs
    seen = []

    def plain(pipeline, step, timestep, callback_kwargs):
        assert pipeline is pipe
        seen.append(sorted(callback_kwargs))
        return callback_kwargs

    assert_same_output(short_call(pipe, callback_on_step_end=plain, callback_on_step_end_tensor_inputs=offered[:1]),
                       reference(name))
    assert seen and all(keys == offered[:1] for keys in seen)
    first, last = Recorder(offered[:1]), Recorder(offered[-1:])
    assert_same_output(short_call(pipe, callback_on_step_end=MultiPipelineCallbacks([first, last])), reference(name))
    assert len(first.calls) == len(last.calls) == len(seen)
    assert [index for index, _ in first.calls] == list(range(len(seen)))
    # a MultiPipelineCallbacks asks for the union of its callbacks' tensor_inputs and hands each the previous result
    assert all(keys == sorted(set(offered[:1] + offered[-1:])) for _, keys in first.calls + last.calls)
    with pytest.raises(ValueError, match="does not offer"):
        short_call(pipe, callback_on_step_end=plain, callback_on_step_end_tensor_inputs=["prompt_embeds"])
