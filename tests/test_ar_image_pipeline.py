"""ARImagePipeline: every method against the target-only baseline, CFG, batching, outputs, save/load, errors.

Tiny random components in float64: a LlamaGen t2i / c2i transformer (4x4 token grid, 32 image tokens),
a VQTokenizer whose codebook is k-means of random patches (2x2 patches, 8x8 images) and an EAGLE head.
The head is a "copy head" (fc passes the previous feature through, the decoder layer adds nothing), so
it drafts the distribution of the last token again: drafts are plausible and often accepted, which makes
the losslessness tests meaningful. Correctness never depends on the head.
"""

from __future__ import annotations

import json

import numpy as np
import PIL.Image
import pytest
import torch
from stats_utils import P_VALUE_FLOOR, chi_square_pvalue, empirical

from mmspec import GroupedRule, SamplingConfig, TreeConfig, apply_guidance, logits_to_probs, sample
from mmspec.models.eagle import EagleHead
from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import VQTokenizer
from mmspec.pipelines import ARImagePipeline, ARImagePipelineOutput, hub, resolve_pretrained
from mmspec.runner import CausalLMRunner, GuidedRunner

V, GRID, CLASSES, COND = 32, 4, 5, 6
N = GRID * GRID
WORDS = ["a", "and", "blue", "circle", "green", "red", "square", "triangle"]
PROMPTS = ["a red circle", "a blue square and a green triangle", "circle"]


def tiny_transformer(model_type: str = "t2i", sharpness: float = 30.0, seed: int = 0) -> LlamaGenTransformer:
    torch.manual_seed(seed)
    config = dict(dim=32, n_layer=2, n_head=4, multiple_of=16, vocab_size=V, block_size=N, model_type=model_type,
                  num_classes=CLASSES)
    if model_type == "t2i":
        config.update(cls_token_num=COND, caption_dim=24, text_vocab_size=len(WORDS))
    model = LlamaGenTransformer(**config).double().eval()
    with torch.no_grad():
        model.output.weight.mul_(sharpness)
        for layer in model.layers:
            layer.attention.wqkv.weight.mul_(10.0)
    return model


def tiny_vq() -> VQTokenizer:
    vq = VQTokenizer(codebook_size=V, patch_size=2, image_size=2 * GRID)
    return vq.fit_codebook(torch.rand(1500, 12, generator=torch.Generator().manual_seed(0)), iters=3)


def copy_head(hidden: int = 32, feature_guidance: float | None = None, num_future: int = 1) -> EagleHead:
    """An EAGLE head that predicts the previous feature (the last token's distribution) again (``num_future``
    K > 1: K times, the readout starting as the identity)."""
    torch.manual_seed(1)
    head = EagleHead(hidden_size=hidden, vocab_size=V, num_attention_heads=4, feature_guidance=feature_guidance,
                     num_future=num_future).double()
    if head.future is not None:
        head.future.start_as_identity()
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.fc.bias.zero_()
        head.decoder.layers[0].self_attn.o_proj.weight.zero_()
        head.decoder.layers[0].mlp.down_proj.weight.zero_()
    return head


def make_pipe(model_type: str = "t2i", sharpness: float = 30.0, head: bool = True,
              feature_guidance: float | None = None, num_future: int = 1) -> ARImagePipeline:
    words = WordTokenizer(WORDS) if model_type == "t2i" else None
    pipe = ARImagePipeline(tiny_transformer(model_type, sharpness), tiny_vq(),
                           copy_head(feature_guidance=feature_guidance, num_future=num_future) if head else None,
                           words)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe() -> ARImagePipeline:
    return make_pipe()


def _tokens(pipe, method, **kwargs):
    kwargs.setdefault("do_sample", False)
    return pipe(PROMPTS, method=method, output_type="tokens", **kwargs)


# -- greedy: every method reproduces the baseline exactly ---------------------------------------------------

GREEDY_CASES = {
    "eagle-chain": ("eagle", {}),
    "eagle-tree": ("eagle", {"tree": TreeConfig(depth=3, top_k=2, total_tokens=6)}),
    "eagle-dynamic-chain": ("eagle", {"num_draft_tokens": 6, "draft_confidence_threshold": 0.5}),
    "lantern-delta0": ("lantern", {"lantern_delta": 0.0, "lantern_k": 8}),
    "sjd": ("sjd", {"sjd_window": 5}),
    "gsd-G1": ("gsd", {"gsd_group_size": 1, "sjd_window": 5}),
    "gsd-rule-on-eagle": ("eagle", {"rule": GroupedRule(G=1, greedy=True)}),
    "eagle-lookup-tail": ("eagle", {"num_draft_tokens": 2, "lookup_tail": 6}),
    "eagle-lookup-only-rounds": ("eagle", {"num_draft_tokens": 2, "lookup_tail": 6, "lookup_only_from": 1}),
}


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_methods_reproduce_target_only_tokens(pipe, case, guidance_scale):
    method, kwargs = GREEDY_CASES[case]
    baseline = _tokens(pipe, "none", guidance_scale=guidance_scale)
    out = _tokens(pipe, method, guidance_scale=guidance_scale, **kwargs)
    assert torch.equal(out.tokens, baseline.tokens)
    assert out.stats.mean_accepted_length > 1.2  # drafts were accepted, so the comparison means something
    assert out.stats.target_calls < baseline.stats.target_calls
    assert out.drafted.any()


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("kwargs", [{}, {"num_draft_tokens": 6, "draft_confidence_threshold": 0.5},
                                    {"eagle_guided": True}], ids=["chain", "dynamic-chain", "guided-drafts"])
def test_block_drafting_head_reproduces_target_only_tokens(kwargs, guidance_scale):
    """A head with 3 futures drafts chains in blocks of 3 (one head forward each), same greedy output."""
    pipe = make_pipe(num_future=3)
    baseline = _tokens(pipe, "none", guidance_scale=guidance_scale)
    out = _tokens(pipe, "eagle", guidance_scale=guidance_scale, eagle_blocks=True, **kwargs)
    assert torch.equal(out.tokens, baseline.tokens)
    assert out.stats.mean_accepted_length > 1.2
    rounds = out.stats.target_calls - 1
    assert out.stats.draft_calls <= rounds * (1 + (kwargs.get("num_draft_tokens", 4) - 1) // 3) + 1


def test_block_head_drafts_token_by_token_when_asked_and_when_sampling():
    """eagle_blocks=False drafts a K-future head token by token (its own prediction, the readout skipped):
    the same greedy output with one head forward per draft, and trees work; sampling does so by default."""
    pipe = make_pipe(num_future=3)
    baseline = _tokens(pipe, "none")
    blocks = _tokens(pipe, "eagle", num_draft_tokens=6, eagle_blocks=True)
    tokens = _tokens(pipe, "eagle", num_draft_tokens=6)  # auto: several images per call draft token by token
    assert tokens.stats.draft_calls == _tokens(pipe, "eagle", num_draft_tokens=6, eagle_blocks=False).stats.draft_calls
    one = {flag: pipe(PROMPTS[1], method="eagle", do_sample=False, output_type="tokens", num_draft_tokens=6,
                      eagle_blocks=flag) for flag in (None, True, False)}  # auto: one greedy image drafts blocks
    assert one[None].stats.draft_calls == one[True].stats.draft_calls < one[False].stats.draft_calls
    tree = _tokens(pipe, "eagle", tree=TreeConfig(depth=3, top_k=2, total_tokens=6), eagle_blocks=False)
    for out in (blocks, tokens, tree):
        assert torch.equal(out.tokens, baseline.tokens)
    assert tokens.stats.draft_calls > blocks.stats.draft_calls
    plain = _tokens(make_pipe(), "eagle", num_draft_tokens=6)  # the same weights without a readout
    assert tokens.stats.draft_calls == plain.stats.draft_calls and tokens.stats.emitted == plain.stats.emitted
    sampled = {flag: pipe(PROMPTS, method="eagle", num_draft_tokens=6, generator=torch.Generator().manual_seed(0),
                          output_type="tokens", eagle_blocks=flag) for flag in (None, False, True)}
    assert torch.equal(sampled[None].tokens, sampled[False].tokens)
    assert sampled[None].stats.draft_calls == sampled[False].stats.draft_calls != sampled[True].stats.draft_calls
    with pytest.raises(ValueError, match="eagle_blocks must be"):
        _tokens(pipe, "eagle", eagle_blocks="yes")
    with pytest.raises(NotImplementedError, match="blocks=False"):
        _tokens(pipe, "eagle", tree=TreeConfig(depth=2, top_k=2, total_tokens=4), eagle_blocks=True)


def test_a_block_head_beside_the_plain_head_drafts_greedy_chains(tmp_path):
    """eagle_block_head: block chains draft with it, sampling and trees stay with the eagle_head; it
    is saved and loaded with the pipeline, and a plain head is refused there."""
    pipe = make_pipe()
    pipe.register_modules(eagle_block_head=copy_head(num_future=3).bind_target(
        pipe.transformer.get_input_embeddings(), pipe.transformer.get_output_embeddings()))
    baseline, plain = _tokens(pipe, "none"), _tokens(make_pipe(), "eagle", num_draft_tokens=6)
    blocks = _tokens(pipe, "eagle", num_draft_tokens=6, eagle_blocks=True)
    assert torch.equal(blocks.tokens, baseline.tokens) and blocks.stats.draft_calls < plain.stats.draft_calls
    tokens = _tokens(pipe, "eagle", num_draft_tokens=6, eagle_blocks=False)
    assert tokens.stats.draft_calls == plain.stats.draft_calls
    sampled = [p("a red circle", method="eagle", generator=torch.Generator().manual_seed(0), output_type="tokens")
               for p in (pipe, make_pipe())]
    assert torch.equal(sampled[0].tokens, sampled[1].tokens)  # sampling drafts with the eagle_head
    pipe.save_pretrained(tmp_path / "p")
    loaded = ARImagePipeline.from_pretrained(tmp_path / "p").to(torch.float64)
    assert loaded.eagle_block_head.config.num_future == 3
    assert torch.equal(_tokens(loaded, "eagle", num_draft_tokens=6, eagle_blocks=True).tokens, baseline.tokens)
    with pytest.raises(ValueError, match="num_future > 1"):
        ARImagePipeline(pipe.transformer, pipe.vqvae, copy_head(), pipe.text_tokenizer, eagle_block_head=copy_head())
    alone = ARImagePipeline(pipe.transformer, pipe.vqvae, None, pipe.text_tokenizer,
                            eagle_block_head=pipe.eagle_block_head)
    assert torch.equal(_tokens(alone, "eagle", eagle_blocks=True).tokens, baseline.tokens)
    with pytest.raises(ValueError, match="needs an eagle_head"):
        _tokens(alone, "eagle", eagle_blocks=False)


def test_dynamic_eagle_chains_stop_early_and_keep_the_output(pipe):
    fixed = _tokens(pipe, "eagle", num_draft_tokens=6)
    dynamic = _tokens(pipe, "eagle", num_draft_tokens=6, draft_confidence_threshold=0.9)
    assert torch.equal(dynamic.tokens, fixed.tokens)
    assert dynamic.stats.draft_calls < fixed.stats.draft_calls  # head forwards saved
    assert dynamic.stats.mean_accepted_length > 1.2


def test_class_conditioned_model_with_guidance():
    pipe = make_pipe("c2i")
    baseline = pipe(class_labels=[0, 3, 4], method="none", do_sample=False, output_type="tokens")
    for method in ("eagle", "sjd"):
        out = pipe(class_labels=[0, 3, 4], method=method, do_sample=False, output_type="tokens")
        assert torch.equal(out.tokens, baseline.tokens)
    assert not torch.equal(baseline.tokens, pipe(class_labels=[0, 3, 4], do_sample=False, output_type="tokens",
                                                 guidance_scale=1.0).tokens)  # guidance changes the images


def test_lossy_methods_run_and_codebook_neighbours_are_computed_once(pipe, monkeypatch):
    """LANTERN with a budget and GSD with G > 1 (not lossless: no equality to test) produce valid grids;
    the neighbour table is computed once for the largest k and reused."""
    calls = []
    original = pipe.vqvae.codebook_neighbors
    monkeypatch.setattr(pipe.vqvae, "codebook_neighbors", lambda k: calls.append(k) or original(k))
    pipe._neighbors = None
    for k in (12, 8, 12):
        out = _tokens(pipe, "lantern", lantern_delta=0.3, lantern_k=k)
        assert out.tokens.shape == (3, GRID, GRID) and 0 <= int(out.tokens.min()) and int(out.tokens.max()) < V
    assert calls == [12]
    assert torch.equal(pipe.codebook_neighbors(8), original(8))
    out = _tokens(pipe, "gsd", gsd_group_size=4, sjd_window=5)
    assert out.tokens.shape == (3, GRID, GRID) and out.stats.mean_accepted_length > 1.0


# -- sampling: the output follows the target distribution -------------------------------------------------


def _exact_first_two_marginals(model: LlamaGenTransformer, words: torch.Tensor, scale: float) -> list[torch.Tensor]:
    """Guided distributions of image tokens 0 and 1 for one prompt, by enumerating token 0."""
    cond = words.expand(V, -1)
    mask = (cond >= 0).long()
    image = torch.stack([torch.arange(V), torch.zeros(V, dtype=torch.long)], 1)  # [V, 2]: (token 0, unused)
    with torch.no_grad():
        halves = [model.forward_train(cond, image, torch.full((V,), drop), condition_mask=mask) for drop in (False, True)]
    probs = logits_to_probs(apply_guidance(torch.cat(halves), scale))  # [V, 2, V]
    first = probs[0, 0]
    return [first, (first.unsqueeze(1) * probs[:, 1]).sum(0)]


@pytest.mark.parametrize("method,kwargs", [("none", {}), ("eagle", {}),
                                           ("eagle", {"tree": TreeConfig(depth=2, top_k=2, total_tokens=4)}),
                                           ("eagle", {"num_draft_tokens": 3, "draft_confidence_threshold": 0.3}),
                                           ("eagle", {"eagle_guided": "features"}),
                                           ("eagle", {"argmax_drafts": True}),
                                           ("eagle", {"num_draft_tokens": 2, "lookup_tail": 3, "lookup_only_from": 1}),
                                           ("sjd", {"sjd_window": 4})],
                         ids=["none", "eagle", "eagle-tree", "eagle-dynamic-chain", "eagle-guided-features",
                              "eagle-argmax-drafts", "eagle-lookup-only-rounds", "sjd"])
def test_sampling_matches_the_exact_target_marginals(method, kwargs):
    """2000 rows of one prompt at temperature 1 with CFG: tokens 0 and 1 follow the exact guided marginals."""
    _check_sampled_marginals(make_pipe(sharpness=3.0, feature_guidance=3.0 if kwargs.get("eagle_guided") == "features"
                                       else None), method, kwargs)


def test_block_drafting_sampling_matches_the_exact_target_marginals():
    """The same test with a head drafting blocks of 3 (each draft drawn from its own distribution)."""
    _check_sampled_marginals(make_pipe(sharpness=3.0, num_future=3), "eagle", {"num_draft_tokens": 6})


def test_argmax_block_drafts_match_the_exact_target_marginals_and_are_the_default_blocks():
    """Argmax drafts are point-mass proposals: blocks of 3 of them keep sampling exact, and one image per
    call with argmax drafts drafts blocks by default (deterministic chains, like greedy decoding)."""
    pipe = make_pipe(sharpness=3.0, num_future=3)
    _check_sampled_marginals(pipe, "eagle", {"num_draft_tokens": 6, "argmax_drafts": True, "eagle_blocks": True})
    one = {flag: pipe(PROMPTS[1], method="eagle", num_draft_tokens=6, argmax_drafts=True, eagle_blocks=flag,
                      generator=torch.Generator().manual_seed(0), output_type="tokens") for flag in (None, True)}
    assert torch.equal(one[None].tokens, one[True].tokens)
    assert one[None].stats.draft_calls == one[True].stats.draft_calls


def test_argmax_drafts_are_the_heads_argmax_and_raise_lanterns_acceptance():
    """Under sampling, argmax_drafts proposes the head's most likely token (spied on the drafter), and a
    relaxed rule accepts such drafts with their relaxed mass: LANTERN++ accepts more per round than with the
    same drafts under the exact rule."""
    from mmspec.models import eagle as eagle_module

    pipe = make_pipe(sharpness=3.0)
    seen = []
    original = eagle_module.draft_chain

    def spy(logits, step, num_tokens, sampling, generator, confidence_threshold=0.0, argmax=False):
        chain = original(logits, step, num_tokens, sampling, generator, confidence_threshold, argmax=argmax)
        seen.append((logits.argmax(-1), chain))
        return chain

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eagle_module, "draft_chain", spy)
        pipe(PROMPTS, method="eagle", argmax_drafts=True, generator=torch.Generator().manual_seed(0),
             output_type="tokens")
    assert seen and all(chain.probs is None and torch.equal(chain.tokens[:, 0], first) for first, chain in seen)
    kwargs = dict(num_images_per_prompt=100, generator=torch.Generator().manual_seed(0), output_type="tokens",
                  argmax_drafts=True, num_draft_tokens=4)
    exact = pipe("a red circle", method="eagle", **kwargs).stats
    relaxed = pipe("a red circle", method="lantern", lantern_k=16, lantern_delta=0.5, **kwargs).stats
    assert relaxed.mean_accepted_length > exact.mean_accepted_length + 0.1


def _check_sampled_marginals(pipe: ARImagePipeline, method: str, kwargs: dict) -> None:
    rows, scale = 2000, 3.0
    out = pipe("a red circle", method=method, num_images_per_prompt=rows, guidance_scale=scale,
               generator=torch.Generator().manual_seed(0), output_type="tokens", **kwargs)
    if method != "none":
        assert 1.05 < out.stats.mean_accepted_length  # drafts are accepted and rejected
    words = pipe.encode_prompt(["a red circle"])[0]["condition_ids"]
    for j, marginal in enumerate(_exact_first_two_marginals(pipe.transformer, words, scale)):
        assert chi_square_pvalue(empirical(out.tokens.flatten(1)[:, j], V), marginal) > P_VALUE_FLOOR, f"token {j}"


def test_the_distribution_test_detects_a_lossy_method():
    """LANTERN with a budget (not lossless) fails the same test at token 1 (token 0 is the target's own)."""
    pipe = make_pipe(sharpness=3.0)
    out = pipe("a red circle", method="lantern", lantern_delta=0.3, lantern_k=8, num_images_per_prompt=2000,
               guidance_scale=3.0, generator=torch.Generator().manual_seed(0), output_type="tokens")
    marginal = _exact_first_two_marginals(pipe.transformer, pipe.encode_prompt(["a red circle"])[0]["condition_ids"], 3.0)[1]
    assert chi_square_pvalue(empirical(out.tokens.flatten(1)[:, 1], V), marginal) < 1e-10


# -- classifier-free guidance equals a manual loop ------------------------------------------------------------


def _manual_guided_loop(model, words, scale, sampling, generator):
    batch = words.shape[0]
    cond = torch.cat([words, words])
    mask = (cond >= 0).long()
    drop = torch.arange(2 * batch) >= batch
    out = model(condition_ids=cond, condition_drop=drop, attention_mask=mask)
    tokens = []
    for _ in range(N):
        probs = logits_to_probs(apply_guidance(out.logits[:, -1], scale), sampling)
        tokens.append(sample(probs, generator) if sampling.do_sample else probs.argmax(-1))
        mask = torch.cat([mask, torch.ones(2 * batch, 1, dtype=torch.long)], 1)
        out = model(input_ids=torch.cat([tokens[-1], tokens[-1]])[:, None], past_key_values=out.past_key_values,
                    attention_mask=mask)
    return torch.stack(tokens, 1)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_guided_baseline_equals_a_manual_guided_loop(do_sample):
    pipe = make_pipe(sharpness=3.0)
    sampling = SamplingConfig(do_sample=do_sample, temperature=0.8, top_k=12)
    words = pipe.encode_prompt(PROMPTS)[0]["condition_ids"]
    reference = _manual_guided_loop(pipe.transformer, words, 2.5, sampling, torch.Generator().manual_seed(3))
    out = pipe(PROMPTS, do_sample=do_sample, temperature=0.8, top_k=12, guidance_scale=2.5,
               generator=torch.Generator().manual_seed(3), output_type="tokens")
    assert torch.equal(out.tokens.flatten(1), reference)


# -- batching, outputs, drafted map ---------------------------------------------------------------------------


def test_batch_of_prompts_with_several_images_each(pipe):
    out = pipe(PROMPTS, method="eagle", do_sample=False, num_images_per_prompt=2, output_type="tokens")
    assert out.tokens.shape == (6, GRID, GRID) and out.drafted.shape == (6, GRID, GRID)
    for i, prompt in enumerate(PROMPTS):
        alone = pipe(prompt, method="none", do_sample=False, output_type="tokens").tokens[0]
        assert torch.equal(out.tokens[2 * i], alone) and torch.equal(out.tokens[2 * i + 1], alone)
    assert len(set(map(tuple, pipe(PROMPTS, do_sample=False, output_type="tokens").tokens.flatten(1).tolist()))) > 1


def test_output_types_decode_the_same_tokens(pipe):
    kwargs = dict(method="sjd", generator=None, do_sample=False)
    tokens = pipe(PROMPTS, output_type="tokens", **kwargs)
    assert tokens.images is None
    expected = pipe.vqvae.decode(tokens.tokens)  # [B, 3, 8, 8]
    pt = pipe(PROMPTS, output_type="pt", **kwargs)
    assert isinstance(pt.images, torch.Tensor) and pt.images.shape == (3, 3, 2 * GRID, 2 * GRID)
    assert torch.equal(pt.images, expected)
    arr = pipe(PROMPTS, output_type="np", **kwargs).images
    assert isinstance(arr, np.ndarray) and arr.shape == (3, 2 * GRID, 2 * GRID, 3)
    assert np.allclose(arr, expected.permute(0, 2, 3, 1).numpy())
    pil = pipe(PROMPTS, output_type="pil", **kwargs)
    assert isinstance(pil, ARImagePipelineOutput)
    assert len(pil.images) == 3 and all(isinstance(im, PIL.Image.Image) and im.size == (8, 8) for im in pil.images)
    assert np.abs(np.asarray(pil.images[1]) / 255.0 - arr[1]).max() <= 1 / 255 + 1e-6


def test_drafted_map_and_overlay(pipe):
    none = pipe(PROMPTS, do_sample=False, output_type="np")
    assert none.drafted.shape == (3, GRID, GRID) and none.drafted.dtype == torch.bool
    assert not none.drafted.any()  # the baseline drafts nothing
    spec = pipe(PROMPTS, method="sjd", do_sample=False, output_type="np")
    assert spec.drafted.any() and not spec.drafted[:, 0, 0].any()  # the first token comes from the prefill
    assert int(spec.drafted.sum()) < 3 * N  # corrections/bonus tokens are the target's
    overlay = spec.drafted_overlay(color=(255, 0, 255), alpha=1.0)
    pixels = np.asarray(overlay[0]).astype(int)  # [8, 8, 3]
    drafted = spec.drafted[0].numpy().repeat(2, 0).repeat(2, 1)
    assert (pixels[drafted] == [255, 0, 255]).all()
    plain = np.asarray(pipe.numpy_to_pil(spec.images)[0]).astype(int)
    assert (pixels[~drafted] == plain[~drafted]).all()
    with pytest.raises(ValueError, match="output_type"):
        pipe(PROMPTS, do_sample=False, output_type="tokens").drafted_overlay()


def test_progress_and_step_callback_see_every_token(pipe):
    seen = []
    out = pipe(PROMPTS, method="eagle", do_sample=False, output_type="tokens",
               callback_on_step_end=lambda p, step, kw: seen.append((step, kw["num_generated"].clone())))
    assert [s for s, _ in seen] == list(range(len(seen)))
    assert torch.equal(seen[-1][1], torch.full((3,), N))
    assert len(seen) == out.stats.target_calls  # one callback per target forward (prefill included)


# -- save / load ---------------------------------------------------------------------------------------------


def test_save_and_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["transformer"] == ["mmspec.models.llamagen", "LlamaGenTransformer"]
    assert index["eagle_head"] == ["mmspec.models.eagle", "EagleHead"]
    assert index["vqvae"][1] == "VQTokenizer"
    assert (tmp_path / "pipe" / "transformer" / "text_vocab.json").is_file()
    loaded = ARImagePipeline.from_pretrained(tmp_path / "pipe")
    loaded.set_progress_bar_config(disable=True)
    assert loaded.text_tokenizer.words == WORDS
    assert torch.equal(loaded.vqvae.codebook, pipe.vqvae.codebook)
    for method in ("none", "eagle", "lantern"):
        kwargs = {"lantern_k": 8} if method == "lantern" else {}
        assert torch.equal(_tokens(loaded, method, **kwargs).tokens, _tokens(pipe, method, **kwargs).tokens)


def test_round_trip_without_eagle_head(tmp_path):
    pipe = make_pipe("c2i", head=False)
    pipe.save_pretrained(tmp_path)
    loaded = ARImagePipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.eagle_head is None and loaded.text_tokenizer is None
    a = pipe(class_labels=[1, 2], do_sample=False, output_type="tokens").tokens
    assert torch.equal(loaded(class_labels=[1, 2], do_sample=False, output_type="tokens").tokens, a)


def test_zoo_ids_resolve_to_the_bundled_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "zoo_dir", lambda: tmp_path)
    assert resolve_pretrained("some/other-path") == "some/other-path"
    with pytest.raises(FileNotFoundError, match="unknown zoo id"):
        resolve_pretrained("mmspec/shapes-t2i")
    (tmp_path / "shapes-t2i" / "transformer").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="not built yet.*recipes.train_t2i"):
        ARImagePipeline.from_pretrained("mmspec/shapes-t2i")
    make_pipe().save_pretrained(tmp_path / "shapes-t2i")
    assert resolve_pretrained("mmspec/shapes-t2i") == str(tmp_path / "shapes-t2i")
    loaded = ARImagePipeline.from_pretrained("mmspec/shapes-t2i")
    assert loaded.text_tokenizer.words == WORDS and loaded.eagle_head is not None


# -- bad input -----------------------------------------------------------------------------------------------

BAD_INPUTS = {
    "empty prompt list": (dict(prompt=[]), ValueError, "empty list"),
    "unknown method": (dict(prompt="a circle", method="medusa"), ValueError, "method must be one of"),
    "top_k above vocab": (dict(prompt="a circle", top_k=V + 1), ValueError, "top_k"),
    "word outside vocab": (dict(prompt="a purple circle"), ValueError, "purple"),
    "both prompt and labels": (dict(prompt="a circle", class_labels=[1]), ValueError, "exactly one"),
    "neither prompt nor labels": (dict(), ValueError, "exactly one"),
    "labels on a t2i model": (dict(class_labels=[1]), ValueError, "text-conditioned"),
    "unknown output type": (dict(prompt="a circle", output_type="latent"), ValueError, "output_type"),
    "empty prompt": (dict(prompt=["a circle", ""]), ValueError, "prompt 1 is empty"),
    "rule contradicts do_sample": (dict(prompt="a circle", do_sample=True, rule=GroupedRule(G=2, greedy=True)),
                                   ValueError, "greedy"),
    "lantern_k too large": (dict(prompt="a circle", method="lantern", lantern_k=V), ValueError, "lantern_k"),
    "mulo without its drafter": (dict(prompt="a circle", method="mulo"), ValueError, "needs mulo_drafter"),
    "bad num_images": (dict(prompt="a circle", num_images_per_prompt=0), ValueError, "num_images_per_prompt"),
    "confidence threshold without a chain": (dict(prompt="a circle", method="sjd", draft_confidence_threshold=0.5),
                                             ValueError, "drafts no chain"),
    "confidence threshold above 1": (dict(prompt="a circle", method="eagle", draft_confidence_threshold=1.5),
                                     ValueError, "confidence_threshold must be a number in"),
    "argmax drafts without an EAGLE chain": (dict(prompt="a circle", method="sjd", argmax_drafts=True), ValueError,
                                             "drafts no EAGLE chain"),
    "argmax drafts on a tree": (dict(prompt="a circle", method="eagle", argmax_drafts=True,
                                     tree=TreeConfig(depth=2, top_k=2, total_tokens=4)), ValueError, "applies to chains"),
    "argmax drafts not a bool": (dict(prompt="a circle", method="eagle", argmax_drafts="yes"), ValueError,
                                 "argmax_drafts must be True or False"),
    "callback not callable": (dict(prompt="a circle", callback_on_step_end="print"), ValueError,
                              "callback_on_step_end must be callable"),
    "lookup tail without an EAGLE chain": (dict(prompt="a circle", method="gsd", lookup_tail=4), ValueError,
                                           "lookup_tail extends EAGLE chains"),
    "lookup tail on a tree": (dict(prompt="a circle", method="eagle", lookup_tail=4,
                                   tree=TreeConfig(depth=2, top_k=2, total_tokens=4)), ValueError, "pass tree=None"),
    "negative lookup tail": (dict(prompt="a circle", method="eagle", lookup_tail=-1), ValueError,
                             "lookup_tail must be a non-negative integer"),
    "lookup-only rounds without a tail": (dict(prompt="a circle", method="eagle", lookup_only_from=2), ValueError,
                                          "set lookup_tail too"),
    "lookup-only rounds from zero": (dict(prompt="a circle", method="eagle", lookup_tail=4, lookup_only_from=0),
                                     ValueError, "lookup_only_from must be a positive integer"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_clear_errors(pipe, case):
    kwargs, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        pipe(**{"output_type": "tokens", **kwargs})


def test_errors_that_depend_on_the_components():
    no_head = make_pipe(head=False)
    for method in ("eagle", "lantern"):
        with pytest.raises(ValueError, match="needs an eagle_head"):
            no_head("a circle", method=method)
    c2i = make_pipe("c2i", head=False)
    with pytest.raises(ValueError, match="class_labels must be in"):
        c2i(class_labels=[CLASSES])
    with pytest.raises(ValueError, match="class-conditioned"):
        c2i("a circle")
    no_null = ARImagePipeline(LlamaGenTransformer(dim=32, n_layer=1, n_head=4, multiple_of=16, vocab_size=V,
                                                  block_size=N, num_classes=CLASSES, class_dropout_prob=0.0),
                              tiny_vq())
    no_null.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match="unconditional model"):
        no_null(class_labels=[0], guidance_scale=3.0)
    assert no_null(class_labels=[0], guidance_scale=1.0, output_type="tokens").tokens.shape == (1, GRID, GRID)
    with pytest.raises(ValueError, match="codebook entries"):
        ARImagePipeline(tiny_transformer(), VQTokenizer(codebook_size=V + 1, patch_size=2, image_size=8))
    with pytest.raises(ValueError, match="no word vocabulary"):
        ARImagePipeline(tiny_transformer(), tiny_vq())("a circle")


def test_guided_and_conditional_eagle_drafting_are_both_lossless(pipe):
    """Under CFG the EAGLE head drafts from the guided combination of both halves (eagle_guided=True) or
    from the conditional half (False); both reproduce the baseline exactly (greedy). The default picks
    conditional drafts for greedy decoding and guided ones for sampling."""
    baseline = _tokens(pipe, "none", guidance_scale=3.0)
    guided = _tokens(pipe, "eagle", guidance_scale=3.0, eagle_guided=True)
    plain = _tokens(pipe, "eagle", guidance_scale=3.0, eagle_guided=False)
    assert torch.equal(guided.tokens, baseline.tokens) and torch.equal(plain.tokens, baseline.tokens)
    assert guided.stats.draft_calls > 0 and plain.stats.draft_calls > 0
    # the default (None) drafts from the conditional half when greedy and from both halves when sampling
    auto = _tokens(pipe, "eagle", guidance_scale=3.0, eagle_guided=None)
    assert auto.stats.position_accepts == plain.stats.position_accepts
    assert auto.stats.draft_calls == plain.stats.draft_calls
    sampled = {flag: pipe("a red circle", method="eagle", guidance_scale=3.0, eagle_guided=flag, output_type="tokens",
                          generator=torch.Generator().manual_seed(0)) for flag in (None, True, False)}
    assert torch.equal(sampled[None].tokens, sampled[True].tokens)
    assert sampled[None].stats.position_accepts == sampled[True].stats.position_accepts
    assert sampled[True].stats.position_accepts != sampled[False].stats.position_accepts


def test_guided_feature_drafting_is_lossless_and_picked_for_its_scale():
    """A head trained on guided features at scale s (``feature_guidance``) drafts one row from the target's
    guided features: the baseline's tokens (greedy), chosen by default at that scale only; asking for it
    at another scale, or an unknown mode, is a clear error."""
    pipe = make_pipe(feature_guidance=3.0)
    conditional = _tokens(pipe, "eagle", guidance_scale=3.0, eagle_guided=False)
    features = _tokens(pipe, "eagle", guidance_scale=3.0, eagle_guided="features")
    assert torch.equal(features.tokens, _tokens(pipe, "none", guidance_scale=3.0).tokens)
    assert torch.equal(features.tokens, conditional.tokens) and features.stats.draft_calls > 0
    assert features.stats.position_accepts != conditional.stats.position_accepts  # other features, other drafts
    auto = _tokens(pipe, "eagle", guidance_scale=3.0)
    assert auto.stats.position_accepts == features.stats.position_accepts
    other_scale = {flag: _tokens(pipe, "eagle", guidance_scale=2.0, eagle_guided=flag) for flag in (None, False)}
    assert other_scale[None].stats.position_accepts == other_scale[False].stats.position_accepts
    with pytest.raises(ValueError, match="feature_guidance is 3.0"):
        _tokens(pipe, "eagle", guidance_scale=2.0, eagle_guided="features")
    with pytest.raises(ValueError, match="feature_guidance is None"):
        _tokens(make_pipe(), "eagle", guidance_scale=3.0, eagle_guided="features")
    with pytest.raises(ValueError, match="eagle_guided must be"):
        _tokens(pipe, "eagle", guidance_scale=3.0, eagle_guided="both")


def test_guided_eagle_drafter_needs_both_halves_of_the_features(pipe):
    from mmspec.models.eagle import EagleDrafter
    from mmspec.speculate import speculative_generate

    condition, mask = pipe.encode_prompt(["a red circle"])
    words = condition["condition_ids"]
    inputs = {"condition_ids": torch.cat([words, words]), "condition_drop": torch.tensor([False, True])}
    target = GuidedRunner(CausalLMRunner(pipe.transformer, return_hidden=True), 3.0)  # conditional features only
    drafter = EagleDrafter(pipe.eagle_head, 3, guidance_scale=3.0)
    with pytest.raises(ValueError, match="both halves"):
        speculative_generate(target, drafter, None, torch.cat([mask, mask]), max_new_tokens=4, **inputs)


def test_gsd_with_group_size_one_is_sjd_and_lantern_delta_zero_is_eagle_when_sampling(pipe):
    """Relaxations switched off are the exact rules draw for draw: same generator seed, same tokens."""
    def sampled(method, **kwargs):
        return pipe(PROMPTS, method=method, output_type="tokens", generator=torch.Generator().manual_seed(5),
                    **kwargs).tokens

    assert torch.equal(sampled("gsd", gsd_group_size=1, sjd_window=5), sampled("sjd", sjd_window=5))
    assert torch.equal(sampled("lantern", lantern_delta=0.0, lantern_k=8), sampled("eagle"))
