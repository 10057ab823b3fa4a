"""The bundled zoo entry mmspec/shapes-t2i: loads offline with its stored method settings, a call with only
``method=`` runs them, and speculative decoding on it is lossless."""

from __future__ import annotations

import pytest
import torch
from pipeline_utils import quiet_pipeline
from tiny_shapes_pipeline import save_tiny_shapes_pipeline

from mmspec import TreeConfig
from mmspec.evaluation.bench_ar_image import REFERENCE_CONFIGS, reference_config
from mmspec.methods.eagle import EagleConfig
from mmspec.methods.mulo import MuLoConfig
from mmspec.models.recipes import build_zoo_t2i
from mmspec.models.recipes.build_zoo_t2i import SPECULATION_SETTINGS
from mmspec.pipelines import ARImagePipeline

PROMPTS = ["a red circle", "a blue square above a green triangle"]


@pytest.fixture(scope="module")
def pipe() -> ARImagePipeline:
    return quiet_pipeline(ARImagePipeline, "mmspec/shapes-t2i")


def test_zoo_entry_loads_offline_with_every_component(pipe):
    assert pipe.transformer.dtype == torch.float32  # fp16 on disk, computed in fp32
    assert pipe.eagle_head is not None and pipe.mulo_drafter is not None and pipe.mulo_upsampler is not None
    assert pipe.transformer.config.condition_rope == "identity" and pipe.grid_size == 8
    assert pipe.text_tokenizer.encode("a red circle")


def test_greedy_eagle_reproduces_target_only_decoding_on_the_zoo(pipe):
    kwargs = dict(do_sample=False, output_type="tokens")
    baseline = pipe(PROMPTS, method="none", **kwargs)
    chain = pipe(PROMPTS, method=EagleConfig(num_draft_tokens=8), **kwargs)
    tree = pipe(PROMPTS, method=EagleConfig(tree=TreeConfig(depth=6, top_k=4, total_tokens=24)), **kwargs)
    assert torch.equal(chain.tokens, baseline.tokens) and torch.equal(tree.tokens, baseline.tokens)
    assert chain.stats.mean_accepted_length > 2.0  # the trained head is accepted, so equality means something
    assert chain.stats.target_calls < baseline.stats.target_calls / 2


def test_greedy_sjd_pac_reproduces_target_only_decoding_on_the_zoo(pipe):
    """The stored sjd_pac and the paper's defaults (window 16, random slots) on twelve zoo prompts, with CFG,
    two images per call: the target's own tokens, in fewer target calls."""
    from mmspec.world.prompts import make_prompt_set

    prompts = [p.text for p in make_prompt_set(n_per_category=2, seed=7)]
    kwargs = dict(do_sample=False, output_type="tokens")
    for start in range(0, len(prompts), 2):
        batch = prompts[start:start + 2]
        baseline = pipe(batch, method="none", **kwargs)
        for method in ("sjd_pac", pipe.method_config("sjd_pac").replace(window=16, init="random")):
            out = pipe(batch, method=method, **kwargs)
            assert torch.equal(out.tokens, baseline.tokens), (batch, method)
            assert out.stats.target_calls < baseline.stats.target_calls


def test_lookup_tail_adds_accepted_tokens_on_the_zoo_and_stays_lossless(pipe):
    """Copies of the row above after each greedy EAGLE chain: the same tokens as target-only decoding, more
    tokens per target call than the same chain without the tail (the zoo's backgrounds are runs of one
    code), and every accepted tail token shows in the drafted map."""
    kwargs = dict(do_sample=False, output_type="tokens")
    chain = EagleConfig(num_draft_tokens=4, draft_confidence_threshold=0.3)
    baseline = pipe(PROMPTS[:1], method="none", **kwargs)
    plain = pipe(PROMPTS[:1], method=chain, **kwargs)
    tail = pipe(PROMPTS[:1], method=chain.replace(lookup_tail=16), **kwargs)
    assert torch.equal(tail.tokens, baseline.tokens) and torch.equal(plain.tokens, baseline.tokens)
    assert tail.stats.mean_accepted_length > plain.stats.mean_accepted_length + 0.5
    assert tail.stats.target_calls < plain.stats.target_calls
    assert tail.drafted.sum() > plain.drafted.sum()
    # rounds that start in a long run of one code verify the tail alone: fewer head forwards, the same tokens,
    # and no more target calls (the head reads the skipped rounds' pairs with the next round's)
    lookup_only = pipe(PROMPTS[:1], method=chain.replace(lookup_tail=16, lookup_only_from=4), **kwargs)
    assert torch.equal(lookup_only.tokens, baseline.tokens)
    assert lookup_only.stats.draft_calls < tail.stats.draft_calls
    assert lookup_only.stats.target_calls <= tail.stats.target_calls
    # several images per call: the head drafts every round (rows would commit different numbers of pairs)
    two = pipe(PROMPTS, method=chain.replace(lookup_tail=16, lookup_only_from=4), **kwargs)
    assert torch.equal(two.tokens, pipe(PROMPTS, method="none", **kwargs).tokens)
    assert two.stats.draft_calls >= two.stats.target_calls - 1


def test_mulo_on_the_zoo_takes_one_target_pass_per_block(pipe):
    """The paper's parallel resampling (never a default: it costs the zoo most of its quality) takes one
    target pass per block of rows; the stored "reverify" takes more."""
    parallel = MuLoConfig(resample="parallel")
    out = pipe(PROMPTS[:1], method=parallel, generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.stats.target_calls == 1 + 8 // 2
    assert out.images.shape == (1, 32, 32, 3) and out.drafted.any()
    assert pipe.method_config("mulo").resample == "reverify" != MuLoConfig(resample="parallel").resample
    stored = pipe(PROMPTS[:1], method="mulo", generator=torch.Generator().manual_seed(0), output_type="tokens")
    assert stored.stats.target_calls > out.stats.target_calls


# -- stored settings ------------------------------------------------------------------------------------------


def test_the_zoo_stores_the_recipes_settings_which_are_the_benchmarks_reference(pipe):
    """``speculation_config.json`` holds the build recipe's table, and for every method, decoding mode and
    batch it resolves to the benchmark's reference configs (the settings the benchmark measured fastest, which
    ``mmspec generate``, the demo and the benchmark applied by hand before they were stored)."""
    assert pipe.speculation_settings.to_dict() == SPECULATION_SETTINGS
    assert set(REFERENCE_CONFIGS) == {"eagle", "lantern", "sjd", "gsd", "mulo"}
    for method in REFERENCE_CONFIGS:
        for greedy in (True, False):
            for batch in (1, 2, 4):
                assert pipe.method_config(method, do_sample=not greedy, batch_size=batch) == \
                    reference_config(method, greedy, batch), (method, greedy, batch)


def test_the_build_recipe_writes_the_settings_file(tmp_path):
    """``build_zoo_t2i`` stores its table with the pipeline (``--settings-only``: into an assembled folder)."""
    folder = save_tiny_shapes_pipeline(tmp_path / "pipe")
    assert not (folder / "speculation_config.json").exists()
    build_zoo_t2i.main(["--folder", str(folder), "--settings-only"])
    assert ARImagePipeline.from_pretrained(folder).speculation_settings.to_dict() == SPECULATION_SETTINGS


def test_the_build_recipe_reads_the_vocabulary_of_an_assembled_or_a_freshly_trained_folder(tmp_path):
    """A rebuild of an assembled folder reads its ``text_tokenizer/`` component; a folder the training recipe
    has just written holds only ``transformer/text_vocab.json``."""
    folder = save_tiny_shapes_pipeline(tmp_path / "pipe")
    words = ARImagePipeline.from_pretrained(folder).text_tokenizer
    assert build_zoo_t2i._word_vocabulary(folder).get_vocab() == words.get_vocab()
    trained = tmp_path / "trained"
    (trained / "transformer").mkdir(parents=True)
    words.save(trained / "transformer" / "text_vocab.json")
    assert build_zoo_t2i._word_vocabulary(trained).get_vocab() == words.get_vocab()
    with pytest.raises(FileNotFoundError, match="no word vocabulary"):
        build_zoo_t2i._word_vocabulary(tmp_path / "empty")


@pytest.mark.parametrize("method", ["eagle", "lantern", "sjd", "gsd", "mulo", "sjd_pac"])
def test_a_call_with_only_the_method_runs_the_stored_settings(pipe, method):
    """``method="lantern"`` gives exactly the tokens (and the same rounds) of ``method=pipe.method_config(
    "lantern", ...)`` given explicitly: greedy with one image per call, sampled (fixed generator) with two."""
    for do_sample, prompts in ((False, PROMPTS[:1]), (True, PROMPTS)):
        kwargs = dict(do_sample=do_sample, output_type="tokens")
        plain = pipe(prompts, method=method, generator=torch.Generator().manual_seed(3), **kwargs)
        stored = pipe.method_config(method, do_sample=do_sample, batch_size=len(prompts), guidance_scale=3.0)
        explicit = pipe(prompts, method=stored, generator=torch.Generator().manual_seed(3), **kwargs)
        assert torch.equal(plain.tokens, explicit.tokens), (method, do_sample, len(prompts))
        assert (plain.stats.target_calls, plain.stats.draft_calls) == \
            (explicit.stats.target_calls, explicit.stats.draft_calls)
    assert method == "mulo" or stored != type(stored)()  # the zoo stores its own settings (MuLo: the defaults)
