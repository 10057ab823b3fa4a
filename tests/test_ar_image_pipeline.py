"""ARImagePipeline: every method against the target-only baseline, CFG, batching, outputs, save/load, errors.

Tiny random components in float64: a LlamaGen t2i / c2i transformer (4x4 token grid, 32 image tokens),
a VQTokenizer whose codebook is k-means of random patches (2x2 patches, 8x8 images) and an EAGLE head.
The head is a "copy head" (fc passes the previous feature through, the decoder layer adds nothing), so
it drafts the distribution of the last token again: drafts are plausible and often accepted, which makes
the losslessness tests meaningful. Correctness never depends on the head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import PIL.Image
import pytest
import torch
from pipeline_utils import copy_pending_method
from stats_utils import P_VALUE_FLOOR, chi_square_pvalue, empirical

from mmspec import GroupedRule, SamplingConfig, TreeConfig, apply_guidance, logits_to_probs, sample
from mmspec.methods import MethodConfig, MethodPlan, SpeculationSettings
from mmspec.methods.eagle import EagleConfig, LanternConfig
from mmspec.methods.jacobi import GSDConfig, SJDConfig
from mmspec.methods.scd import SCDConfig
from mmspec.methods.sjd_pac import SJDPACConfig
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
    "eagle-tree": (EagleConfig(tree=TreeConfig(depth=3, top_k=2, total_tokens=6)), {}),
    "eagle-dynamic-chain": (EagleConfig(num_draft_tokens=6, draft_confidence_threshold=0.5), {}),
    "lantern-delta0": (LanternConfig(delta=0.0, k=8), {}),
    "sjd": (SJDConfig(window=5), {}),
    "scd": (SCDConfig(window=5), {}),
    "sjd_pac": (SJDPACConfig(window=5, tree_width=3), {}),
    "sjd_pac-left": (SJDPACConfig(window=5, init="left"), {}),
    "gsd-G1": (GSDConfig(group_size=1, window=5), {}),
    "gsd-rule-on-eagle": ("eagle", {"rule": GroupedRule(G=1, greedy=True)}),
    "eagle-lookup-tail": (EagleConfig(num_draft_tokens=2, lookup_tail=6), {}),
    "eagle-lookup-only-rounds": (EagleConfig(num_draft_tokens=2, lookup_tail=6, lookup_only_from=1), {}),
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
@pytest.mark.parametrize("fields", [{}, {"num_draft_tokens": 6, "draft_confidence_threshold": 0.5},
                                    {"guided": True}], ids=["chain", "dynamic-chain", "guided-drafts"])
def test_block_drafting_head_reproduces_target_only_tokens(fields, guidance_scale):
    """A head with 3 futures drafts chains in blocks of 3 (one head forward each), same greedy output."""
    pipe = make_pipe(num_future=3)
    baseline = _tokens(pipe, "none", guidance_scale=guidance_scale)
    out = _tokens(pipe, EagleConfig(blocks=True, **fields), guidance_scale=guidance_scale)
    assert torch.equal(out.tokens, baseline.tokens)
    assert out.stats.mean_accepted_length > 1.2
    rounds = out.stats.target_calls - 1
    assert out.stats.draft_calls <= rounds * (1 + (fields.get("num_draft_tokens", 4) - 1) // 3) + 1


def test_block_head_drafts_token_by_token_when_asked_and_when_sampling():
    """blocks=False drafts a K-future head token by token (its own prediction, the readout skipped):
    the same greedy output with one head forward per draft, and trees work; sampling does so by default."""
    pipe = make_pipe(num_future=3)
    baseline = _tokens(pipe, "none")
    k6 = EagleConfig(num_draft_tokens=6)
    blocks = _tokens(pipe, k6.replace(blocks=True))
    tokens = _tokens(pipe, k6)  # auto: several images per call draft token by token
    assert tokens.stats.draft_calls == _tokens(pipe, k6.replace(blocks=False)).stats.draft_calls
    one = {flag: pipe(PROMPTS[1], method=k6.replace(blocks=flag), do_sample=False, output_type="tokens")
           for flag in (None, True, False)}  # auto: one greedy image drafts blocks
    assert one[None].stats.draft_calls == one[True].stats.draft_calls < one[False].stats.draft_calls
    tree = _tokens(pipe, EagleConfig(tree=TreeConfig(depth=3, top_k=2, total_tokens=6), blocks=False))
    for out in (blocks, tokens, tree):
        assert torch.equal(out.tokens, baseline.tokens)
    assert tokens.stats.draft_calls > blocks.stats.draft_calls
    plain = _tokens(make_pipe(), k6)  # the same weights without a readout
    assert tokens.stats.draft_calls == plain.stats.draft_calls and tokens.stats.emitted == plain.stats.emitted
    sampled = {flag: pipe(PROMPTS, method=k6.replace(blocks=flag), generator=torch.Generator().manual_seed(0),
                          output_type="tokens") for flag in (None, False, True)}
    assert torch.equal(sampled[None].tokens, sampled[False].tokens)
    assert sampled[None].stats.draft_calls == sampled[False].stats.draft_calls != sampled[True].stats.draft_calls
    with pytest.raises(ValueError, match="EagleConfig.blocks must be"):
        EagleConfig(blocks="yes")
    with pytest.raises(NotImplementedError, match="blocks=False"):
        _tokens(pipe, EagleConfig(tree=TreeConfig(depth=2, top_k=2, total_tokens=4), blocks=True))


def test_a_block_head_beside_the_plain_head_drafts_greedy_chains(tmp_path):
    """eagle_block_head: block chains draft with it, sampling and trees stay with the eagle_head; it
    is saved and loaded with the pipeline, and a plain head is refused there."""
    pipe = make_pipe()
    pipe.register_modules(eagle_block_head=copy_head(num_future=3).bind_target(
        pipe.transformer.get_input_embeddings(), pipe.transformer.get_output_embeddings()))
    k6 = EagleConfig(num_draft_tokens=6)
    baseline, plain = _tokens(pipe, "none"), _tokens(make_pipe(), k6)
    blocks = _tokens(pipe, k6.replace(blocks=True))
    assert torch.equal(blocks.tokens, baseline.tokens) and blocks.stats.draft_calls < plain.stats.draft_calls
    tokens = _tokens(pipe, k6.replace(blocks=False))
    assert tokens.stats.draft_calls == plain.stats.draft_calls
    sampled = [p("a red circle", method="eagle", generator=torch.Generator().manual_seed(0), output_type="tokens")
               for p in (pipe, make_pipe())]
    assert torch.equal(sampled[0].tokens, sampled[1].tokens)  # sampling drafts with the eagle_head
    pipe.save_pretrained(tmp_path / "p")
    loaded = ARImagePipeline.from_pretrained(tmp_path / "p").to(torch.float64)
    assert loaded.eagle_block_head.config.num_future == 3
    assert torch.equal(_tokens(loaded, k6.replace(blocks=True)).tokens, baseline.tokens)
    with pytest.raises(ValueError, match="num_future > 1"):
        ARImagePipeline(pipe.transformer, pipe.vqvae, copy_head(), pipe.text_tokenizer, eagle_block_head=copy_head())
    alone = ARImagePipeline(pipe.transformer, pipe.vqvae, None, pipe.text_tokenizer,
                            eagle_block_head=pipe.eagle_block_head)
    assert torch.equal(_tokens(alone, EagleConfig(blocks=True)).tokens, baseline.tokens)
    with pytest.raises(ValueError, match="needs an eagle_head"):
        _tokens(alone, EagleConfig(blocks=False))


def test_dynamic_eagle_chains_stop_early_and_keep_the_output(pipe):
    fixed = _tokens(pipe, EagleConfig(num_draft_tokens=6))
    dynamic = _tokens(pipe, EagleConfig(num_draft_tokens=6, draft_confidence_threshold=0.9))
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
        out = _tokens(pipe, LanternConfig(delta=0.3, k=k))
        assert out.tokens.shape == (3, GRID, GRID) and 0 <= int(out.tokens.min()) and int(out.tokens.max()) < V
    assert calls == [12]
    assert torch.equal(pipe.codebook_neighbors(8), original(8))
    out = _tokens(pipe, GSDConfig(group_size=4, window=5))
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


@pytest.mark.parametrize("method", ["none", "eagle", EagleConfig(tree=TreeConfig(depth=2, top_k=2, total_tokens=4)),
                                    EagleConfig(num_draft_tokens=3, draft_confidence_threshold=0.3),
                                    EagleConfig(guided="features"), EagleConfig(argmax_drafts=True),
                                    EagleConfig(num_draft_tokens=2, lookup_tail=3, lookup_only_from=1),
                                    SJDConfig(window=4), SCDConfig(window=4), SJDPACConfig(window=4, tree_width=3)],
                         ids=["none", "eagle", "eagle-tree", "eagle-dynamic-chain", "eagle-guided-features",
                              "eagle-argmax-drafts", "eagle-lookup-only-rounds", "sjd", "scd", "sjd_pac"])
def test_sampling_matches_the_exact_target_marginals(method):
    """2000 rows of one prompt at temperature 1 with CFG: tokens 0 and 1 follow the exact guided marginals."""
    features = getattr(method, "guided", None) == "features"
    _check_sampled_marginals(make_pipe(sharpness=3.0, feature_guidance=3.0 if features else None), method)


def test_block_drafting_sampling_matches_the_exact_target_marginals():
    """The same test with a head drafting blocks of 3 (each draft drawn from its own distribution)."""
    _check_sampled_marginals(make_pipe(sharpness=3.0, num_future=3), EagleConfig(num_draft_tokens=6))


def test_argmax_block_drafts_match_the_exact_target_marginals_and_are_the_default_blocks():
    """Argmax drafts are point-mass proposals: blocks of 3 of them keep sampling exact, and one image per
    call with argmax drafts drafts blocks by default (deterministic chains, like greedy decoding)."""
    pipe = make_pipe(sharpness=3.0, num_future=3)
    argmax = EagleConfig(num_draft_tokens=6, argmax_drafts=True)
    _check_sampled_marginals(pipe, argmax.replace(blocks=True))
    one = {flag: pipe(PROMPTS[1], method=argmax.replace(blocks=flag), generator=torch.Generator().manual_seed(0),
                      output_type="tokens") for flag in (None, True)}
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
        pipe(PROMPTS, method=EagleConfig(argmax_drafts=True), generator=torch.Generator().manual_seed(0),
             output_type="tokens")
    assert seen and all(chain.probs is None and torch.equal(chain.tokens[:, 0], first) for first, chain in seen)
    kwargs = dict(num_images_per_prompt=100, generator=torch.Generator().manual_seed(0), output_type="tokens")
    exact = pipe("a red circle", method=EagleConfig(argmax_drafts=True, num_draft_tokens=4), **kwargs).stats
    relaxed = pipe("a red circle", method=LanternConfig(argmax_drafts=True, num_draft_tokens=4, k=16, delta=0.5),
                   **kwargs).stats
    assert relaxed.mean_accepted_length > exact.mean_accepted_length + 0.1


def _check_sampled_marginals(pipe: ARImagePipeline, method: str | EagleConfig | SJDConfig) -> None:
    rows, scale = 2000, 3.0
    out = pipe("a red circle", method=method, num_images_per_prompt=rows, guidance_scale=scale,
               generator=torch.Generator().manual_seed(0), output_type="tokens")
    if method != "none":
        assert 1.02 < out.stats.mean_accepted_length  # drafts are accepted and rejected
    words = pipe.encode_prompt(["a red circle"])[0]["condition_ids"]
    for j, marginal in enumerate(_exact_first_two_marginals(pipe.transformer, words, scale)):
        assert chi_square_pvalue(empirical(out.tokens.flatten(1)[:, j], V), marginal) > P_VALUE_FLOOR, f"token {j}"


def test_the_distribution_test_detects_a_lossy_method():
    """LANTERN with a budget (not lossless) fails the same test at token 1 (token 0 is the target's own)."""
    pipe = make_pipe(sharpness=3.0)
    out = pipe("a red circle", method=LanternConfig(delta=0.3, k=8), num_images_per_prompt=2000,
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
    """diffusers' convention: fn(pipeline, step, timestep, callback_kwargs) -> dict, once per round."""
    seen = []

    def callback(p, step, timestep, kwargs):
        seen.append((step, timestep, kwargs["num_generated"].clone()))
        return kwargs

    out = pipe(PROMPTS, method="eagle", do_sample=False, output_type="tokens", callback_on_step_end=callback)
    assert [s for s, _, _ in seen] == list(range(len(seen)))
    assert torch.equal(seen[-1][2], torch.full((3,), N)) and seen[-1][1] == N
    assert [t for _, t, _ in seen] == [int(g.max()) for _, _, g in seen]  # timestep: the furthest image's tokens
    assert len(seen) == out.stats.target_calls  # one callback per target forward (prefill included)


def test_step_callback_tensor_inputs_and_diffusers_callback_objects(pipe):
    from diffusers.callbacks import PipelineCallback

    seen = []
    pipe(PROMPTS, method="eagle", do_sample=False, output_type="tokens", callback_on_step_end_tensor_inputs=["drafted"],
         callback_on_step_end=lambda p, step, t, kwargs: seen.append(sorted(kwargs)) or kwargs)
    assert seen and all(keys == ["drafted"] for keys in seen)

    class CountDrafted(PipelineCallback):
        tensor_inputs = ["drafted"]

        def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
            seen.append(int(callback_kwargs["drafted"].sum()))
            return callback_kwargs

    seen.clear()
    out = pipe(PROMPTS, method="eagle", do_sample=False, output_type="tokens", callback_on_step_end=CountDrafted())
    assert sum(seen) == int(out.drafted.sum())
    with pytest.raises(ValueError, match=r"callback_on_step_end_tensor_inputs has \['latents'\].*offers"):
        pipe(PROMPTS, output_type="tokens", callback_on_step_end=lambda *a: {},
             callback_on_step_end_tensor_inputs=["latents"])
    with pytest.raises(TypeError, match="must return a dict"):
        pipe(PROMPTS, output_type="tokens", callback_on_step_end=lambda p, step, t, kwargs: None)


def test_return_dict_false_gives_the_tuple(pipe):
    out = pipe(PROMPTS, method="eagle", do_sample=False, output_type="np")
    images, tokens, stats, drafted = pipe(PROMPTS, method="eagle", do_sample=False, output_type="np",
                                          return_dict=False)
    assert torch.equal(tokens, out.tokens) and np.array_equal(images, out.images) and torch.equal(drafted, out.drafted)
    assert stats.target_calls == out.stats.target_calls


# -- save / load ---------------------------------------------------------------------------------------------


def test_save_and_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["transformer"] == ["mmspec.models.llamagen", "LlamaGenTransformer"]
    assert index["eagle_head"] == ["mmspec.models.eagle", "EagleHead"]
    assert index["vqvae"][1] == "VQTokenizer"
    assert index["text_tokenizer"] == ["mmspec.models.text", "WordTokenizer"]
    assert (tmp_path / "pipe" / "text_tokenizer" / "tokenizer.json").is_file()
    loaded = ARImagePipeline.from_pretrained(tmp_path / "pipe")
    loaded.set_progress_bar_config(disable=True)
    assert loaded.text_tokenizer.words == WORDS
    assert torch.equal(loaded.vqvae.codebook, pipe.vqvae.codebook)
    for method in ("none", "eagle", LanternConfig(k=8)):
        assert torch.equal(_tokens(loaded, method).tokens, _tokens(pipe, method).tokens)


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
    "unknown method": (dict(prompt="a circle", method="medusa"), ValueError,
                       r"method='medusa' is not a method of ARImagePipeline \(ar_image pipelines\); choose from"),
    "top_k above vocab": (dict(prompt="a circle", top_k=V + 1), ValueError, "top_k"),
    "word outside vocab": (dict(prompt="a purple circle"), ValueError, "purple"),
    "both prompt and labels": (dict(prompt="a circle", class_labels=[1]), ValueError, "exactly one"),
    "neither prompt nor labels": (dict(), ValueError, "exactly one"),
    "labels on a t2i model": (dict(class_labels=[1]), ValueError, "text-conditioned"),
    "unknown output type": (dict(prompt="a circle", output_type="latent"), ValueError, "output_type"),
    "empty prompt": (dict(prompt=["a circle", ""]), ValueError, "prompt 1 is empty"),
    "rule contradicts do_sample": (dict(prompt="a circle", do_sample=True, rule=GroupedRule(G=2, greedy=True)),
                                   ValueError, "greedy"),
    "lantern k too large": (dict(prompt="a circle", method=LanternConfig(k=V)), ValueError,
                            f"LanternConfig.k must be at most the image vocabulary minus one \\({V - 1}\\)"),
    "mulo without its drafter": (dict(prompt="a circle", method="mulo"), ValueError, "needs mulo_drafter"),
    "bad num_images": (dict(prompt="a circle", num_images_per_prompt=0), ValueError, "num_images_per_prompt"),
    "argmax drafts on a tree": (dict(prompt="a circle", method=EagleConfig(
        argmax_drafts=True, tree=TreeConfig(depth=2, top_k=2, total_tokens=4))), ValueError, "applies to chains"),
    "callback not callable": (dict(prompt="a circle", callback_on_step_end="print"), ValueError,
                              "callback_on_step_end must be callable"),
    "method not a name or config": (dict(prompt="a circle", method=3), ValueError,
                                    "method must be a method name or a MethodConfig"),
    "removed method keyword": (dict(prompt="a circle", method="lantern", lantern_k=8), TypeError,
                               r"no longer takes lantern_k.*lantern_k -> LanternConfig\.k.*"
                               r"method=LanternConfig\(k=\.\.\.\) or method=pipe\.method_config\('lantern', "
                               r"\.\.\.\)\.replace\(k=\.\.\.\)"),
    "unknown keyword": (dict(prompt="a circle", num_steps=4), TypeError,
                        r"ARImagePipeline.__call__\(\) got an unexpected keyword argument 'num_steps'"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_clear_errors(pipe, case):
    kwargs, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        pipe(**{"output_type": "tokens", **kwargs})


CONFIG_ERRORS = {
    "confidence threshold above 1": (lambda: EagleConfig(draft_confidence_threshold=1.5),
                                     r"EagleConfig.draft_confidence_threshold must be a number in \[0.0, 1.0\)"),
    "argmax drafts not a bool": (lambda: EagleConfig(argmax_drafts="yes"),
                                 "EagleConfig.argmax_drafts must be True or False"),
    "lookup tail on a tree": (lambda: EagleConfig(lookup_tail=4, tree=TreeConfig(depth=2, top_k=2, total_tokens=4)),
                              r"EagleConfig.lookup_tail extends draft chains: use tree=None"),
    "negative lookup tail": (lambda: EagleConfig(lookup_tail=-1), r"EagleConfig.lookup_tail must be an integer in \[0"),
    "lookup-only rounds without a tail": (lambda: EagleConfig(lookup_only_from=2), "set lookup_tail too"),
    "lookup-only rounds from zero": (lambda: EagleConfig(lookup_tail=4, lookup_only_from=0),
                                     r"EagleConfig.lookup_only_from must be an integer in \[1"),
    "lantern delta out of range": (lambda: LanternConfig(delta=1.5), r"LanternConfig.delta must be a number in"),
    "a field of another method": (lambda: SJDConfig().replace(draft_confidence_threshold=0.5),
                                  "SJDConfig has no field 'draft_confidence_threshold'; its fields are window, init"),
    "argmax drafts on Jacobi drafts": (lambda: GSDConfig().replace(argmax_drafts=True),
                                       "GSDConfig has no field 'argmax_drafts'"),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_bad_method_settings_name_the_config_field(case):
    make, match = CONFIG_ERRORS[case]
    with pytest.raises(ValueError, match=match):
        make()


@dataclass(frozen=True)
class _VLMOnlyConfig(MethodConfig):
    pipelines: ClassVar[tuple[str, ...]] = ("vlm",)

    def build(self, pipeline, request):
        return MethodPlan()


def test_bad_methods_are_refused_naming_what_to_pass(pipe):
    """An unknown config field, an out-of-range value, a method of another pipeline family (by name or as a
    config), and a keyword that became a config field: each error names the field or the choices."""
    with pytest.raises(ValueError, match="EagleConfig has no field 'window'; its fields are num_draft_tokens"):
        pipe.method_config("eagle").replace(window=3)
    with pytest.raises(ValueError, match=r"LanternConfig.k must be an integer >= 1, got 0"):
        pipe.method_config("lantern").replace(k=0)
    for name in ("cspd", "draft"):  # continuous and video methods are not AR image ones
        with pytest.raises(ValueError, match=f"method='{name}' is not a method of ARImagePipeline.*'eagle'"):
            pipe("a circle", method=name, output_type="tokens")
        with pytest.raises(ValueError, match=f"method='{name}' is not a method"):
            pipe.method_config(name)
    with pytest.raises(ValueError, match=r"_VLMOnlyConfig configures a method of vlm pipelines, not of this one "
                                         r"\(ar_image\)"):
        pipe("a circle", method=_VLMOnlyConfig(), output_type="tokens")
    # a removed keyword names the config field, for the call's own method when its config has the field
    with pytest.raises(TypeError, match=r"no longer takes sjd_window.*sjd_window -> SJDConfig.window / "
                                        r"GSDConfig.window.*method=pipe.method_config\('gsd', \.\.\.\)"
                                        r"\.replace\(window=\.\.\.\)"):
        pipe("a circle", method="gsd", sjd_window=4)
    with pytest.raises(TypeError, match=r"draft_confidence_threshold -> EagleConfig.draft_confidence_threshold / "
                                        r"LanternConfig.draft_confidence_threshold.*method=EagleConfig\("):
        pipe("a circle", method="sjd", draft_confidence_threshold=0.5)  # sjd has no such field: EAGLE's
    with pytest.raises(TypeError, match=r"no longer takes num_draft_tokens, eagle_blocks.*eagle_blocks -> "
                                        r"EagleConfig.blocks.*method=<your LanternConfig>\.replace\("
                                        r"num_draft_tokens=\.\.\., blocks=\.\.\.\)"):
        pipe("a circle", method=LanternConfig(), num_draft_tokens=6, eagle_blocks=True)
    with pytest.raises(TypeError, match=r"mulo_resample -> MuLoConfig.resample"):
        pipe("a circle", mulo_resample="parallel")


def test_a_method_registered_from_outside_the_package_runs_losslessly(pipe):
    """The toy method of tests/pipeline_utils.py (copies of the pending token), registered by a test as a
    plugin would be: listed by the pipeline, run by name (its class defaults: nothing is stored for it) and
    as a config, and greedy decoding gives target-only's tokens."""
    with copy_pending_method() as config_class:
        assert "copy_pending" in pipe.methods() and pipe.method_config("copy_pending") == config_class()
        for guidance_scale in (1.0, 3.0):
            baseline = _tokens(pipe, "none", guidance_scale=guidance_scale)
            for method in ("copy_pending", config_class(num_tokens=6)):
                out = _tokens(pipe, method, guidance_scale=guidance_scale)
                assert torch.equal(out.tokens, baseline.tokens)
                assert out.stats.target_calls <= baseline.stats.target_calls and sum(out.stats.position_attempts) > 0
    assert "copy_pending" not in pipe.methods()
    with pytest.raises(ValueError, match="not a method"):
        _tokens(pipe, "copy_pending")


def test_stored_settings_travel_with_the_folder_and_explicit_configs_win(pipe, tmp_path):
    """``speculation_config.json``: written by save_pretrained, read by from_pretrained (or replaced by
    ``speculation_settings=``); a call with only ``method=`` equals the call with the stored config given
    explicitly, and an explicit config is used as given."""
    stored = {"eagle": {"settings": {"num_draft_tokens": 6},
                        "variants": [{"when": {"greedy": True}, "settings": {"draft_confidence_threshold": 0.5}}]},
              "sjd": {"settings": {"window": 5, "init": "left"}}}
    source = make_pipe()
    source.set_speculation_settings(stored)
    source.save_pretrained(tmp_path / "p")
    assert json.loads((tmp_path / "p" / "speculation_config.json").read_text())["sjd"] == stored["sjd"]
    loaded = ARImagePipeline.from_pretrained(tmp_path / "p").to(torch.float64)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.method_config("eagle", do_sample=False) == EagleConfig(num_draft_tokens=6,
                                                                        draft_confidence_threshold=0.5)
    assert loaded.method_config("eagle") == EagleConfig(num_draft_tokens=6)  # sampling: the variant does not apply
    assert loaded.method_config("gsd") == GSDConfig() and loaded.method_config("none") is None
    for name in ("eagle", "sjd"):
        plain = _tokens(loaded, name)
        explicit = _tokens(loaded, loaded.method_config(name, do_sample=False, batch_size=len(PROMPTS)))
        assert torch.equal(plain.tokens, explicit.tokens) and plain.stats.draft_calls == explicit.stats.draft_calls
    as_given = _tokens(loaded, SJDConfig())  # an explicit config wins: the class's window of 16, not the stored 5
    assert len(as_given.stats.position_attempts) > 5 == len(_tokens(loaded, "sjd").stats.position_attempts)
    replaced = ARImagePipeline.from_pretrained(tmp_path / "p", speculation_settings={"sjd": {"settings": {"window": 3}}})
    assert replaced.method_config("sjd") == SJDConfig(window=3) and replaced.method_config("eagle") == EagleConfig()
    make_pipe().save_pretrained(tmp_path / "q")  # nothing stored: no file, every method at its class defaults
    assert not (tmp_path / "q" / "speculation_config.json").exists()
    assert ARImagePipeline.from_pretrained(tmp_path / "q").method_config("eagle") == EagleConfig()
    (tmp_path / "q" / "speculation_config.json").write_text(json.dumps({"eagle": {"settings": {"k": 5}}}))
    with pytest.raises(ValueError, match=r"EagleConfig has no field 'k' in .*speculation_config.json \(eagle\)"):
        ARImagePipeline.from_pretrained(tmp_path / "q")


def test_hub_repositories_read_their_settings_file(tmp_path, monkeypatch):
    """A hub id's ``speculation_config.json`` is fetched next to the pipeline; a repository without one has
    no stored settings."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    (tmp_path / "speculation_config.json").write_text(json.dumps({"sjd": {"settings": {"window": 5}}}))
    asked = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, name, **kw: asked.append((repo, name, kw)) or str(tmp_path / name))
    pipe = make_pipe()
    pipe.read_speculation_settings("someone/their-pipeline", revision="v1")
    assert asked == [("someone/their-pipeline", "speculation_config.json", {"revision": "v1"})]
    assert pipe.method_config("sjd") == SJDConfig(window=5)

    def missing(repo, name, **kw):
        raise LocalEntryNotFoundError("not cached")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    pipe.read_speculation_settings("someone/other")
    assert pipe.method_config("sjd") == SJDConfig() and isinstance(pipe.speculation_settings, SpeculationSettings)


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
    guided = _tokens(pipe, EagleConfig(guided=True), guidance_scale=3.0)
    plain = _tokens(pipe, EagleConfig(guided=False), guidance_scale=3.0)
    assert torch.equal(guided.tokens, baseline.tokens) and torch.equal(plain.tokens, baseline.tokens)
    assert guided.stats.draft_calls > 0 and plain.stats.draft_calls > 0
    # the default (None) drafts from the conditional half when greedy and from both halves when sampling
    auto = _tokens(pipe, EagleConfig(guided=None), guidance_scale=3.0)
    assert auto.stats.position_accepts == plain.stats.position_accepts
    assert auto.stats.draft_calls == plain.stats.draft_calls
    sampled = {flag: pipe("a red circle", method=EagleConfig(guided=flag), guidance_scale=3.0, output_type="tokens",
                          generator=torch.Generator().manual_seed(0)) for flag in (None, True, False)}
    assert torch.equal(sampled[None].tokens, sampled[True].tokens)
    assert sampled[None].stats.position_accepts == sampled[True].stats.position_accepts
    assert sampled[True].stats.position_accepts != sampled[False].stats.position_accepts


def test_guided_feature_drafting_is_lossless_and_picked_for_its_scale():
    """A head trained on guided features at scale s (``feature_guidance``) drafts one row from the target's
    guided features: the baseline's tokens (greedy), chosen by default at that scale only; asking for it
    at another scale, or an unknown mode, is a clear error."""
    pipe = make_pipe(feature_guidance=3.0)
    conditional = _tokens(pipe, EagleConfig(guided=False), guidance_scale=3.0)
    features = _tokens(pipe, EagleConfig(guided="features"), guidance_scale=3.0)
    assert torch.equal(features.tokens, _tokens(pipe, "none", guidance_scale=3.0).tokens)
    assert torch.equal(features.tokens, conditional.tokens) and features.stats.draft_calls > 0
    assert features.stats.position_accepts != conditional.stats.position_accepts  # other features, other drafts
    auto = _tokens(pipe, "eagle", guidance_scale=3.0)
    assert auto.stats.position_accepts == features.stats.position_accepts
    other_scale = {flag: _tokens(pipe, EagleConfig(guided=flag), guidance_scale=2.0) for flag in (None, False)}
    assert other_scale[None].stats.position_accepts == other_scale[False].stats.position_accepts
    with pytest.raises(ValueError, match="feature_guidance is 3.0"):
        _tokens(pipe, EagleConfig(guided="features"), guidance_scale=2.0)
    with pytest.raises(ValueError, match="feature_guidance is None"):
        _tokens(make_pipe(), EagleConfig(guided="features"), guidance_scale=3.0)
    with pytest.raises(ValueError, match="EagleConfig.guided must be"):
        EagleConfig(guided="both")


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
    def sampled(method):
        return pipe(PROMPTS, method=method, output_type="tokens", generator=torch.Generator().manual_seed(5)).tokens

    assert torch.equal(sampled(GSDConfig(group_size=1, window=5)), sampled(SJDConfig(window=5)))
    assert torch.equal(sampled(LanternConfig(delta=0.0, k=8)), sampled("eagle"))


def test_a_list_of_generators_makes_each_image_its_own_call(pipe):
    """diffusers' convention: one generator per image; image i equals a call for that image alone with
    generators[i], whatever the other images are."""
    seeds = [3, 4, 5, 6]
    batch = pipe(PROMPTS[:2], method="eagle", num_images_per_prompt=2, output_type="np",
                 generator=[torch.Generator().manual_seed(s) for s in seeds])
    alone = [pipe(prompt, method="eagle", output_type="np", generator=torch.Generator().manual_seed(seed))
             for prompt, seed in zip([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]], seeds)]
    assert torch.equal(batch.tokens, torch.cat([a.tokens for a in alone]))
    assert np.array_equal(batch.images, np.concatenate([a.images for a in alone]))
    assert batch.stats.target_calls == sum(a.stats.target_calls for a in alone)
    with pytest.raises(ValueError, match="list of 3 generators, but the call makes 4 images"):
        pipe(PROMPTS[:2], num_images_per_prompt=2, generator=[torch.Generator()] * 3)
    with pytest.raises(ValueError, match=r"generator\[1\] is a int"):
        pipe(PROMPTS[:2], generator=[torch.Generator(), 7])
