"""The bundled zoo entry mmspec/shapes-t2i: loads offline, and speculative decoding on it is lossless."""

from __future__ import annotations

import pytest
import torch
from pipeline_utils import quiet_pipeline

from mmspec import TreeConfig
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
    chain = pipe(PROMPTS, method="eagle", num_draft_tokens=8, **kwargs)
    tree = pipe(PROMPTS, method="eagle", tree=TreeConfig(depth=6, top_k=4, total_tokens=24), **kwargs)
    assert torch.equal(chain.tokens, baseline.tokens) and torch.equal(tree.tokens, baseline.tokens)
    assert chain.stats.mean_accepted_length > 2.0  # the trained head is accepted, so equality means something
    assert chain.stats.target_calls < baseline.stats.target_calls / 2


def test_lookup_tail_adds_accepted_tokens_on_the_zoo_and_stays_lossless(pipe):
    """Copies of the row above after each greedy EAGLE chain: the same tokens as target-only decoding, more
    tokens per target call than the same chain without the tail (the zoo's backgrounds are runs of one
    code), and every accepted tail token shows in the drafted map."""
    kwargs = dict(do_sample=False, output_type="tokens", num_draft_tokens=4, draft_confidence_threshold=0.3)
    baseline = pipe(PROMPTS[:1], method="none", do_sample=False, output_type="tokens")
    plain = pipe(PROMPTS[:1], method="eagle", **kwargs)
    tail = pipe(PROMPTS[:1], method="eagle", lookup_tail=16, **kwargs)
    assert torch.equal(tail.tokens, baseline.tokens) and torch.equal(plain.tokens, baseline.tokens)
    assert tail.stats.mean_accepted_length > plain.stats.mean_accepted_length + 0.5
    assert tail.stats.target_calls < plain.stats.target_calls
    assert tail.drafted.sum() > plain.drafted.sum()
    # rounds that start in a long run of one code verify the tail alone: fewer head forwards, the same tokens,
    # and no more target calls (the head reads the skipped rounds' pairs with the next round's)
    lookup_only = pipe(PROMPTS[:1], method="eagle", lookup_tail=16, lookup_only_from=4, **kwargs)
    assert torch.equal(lookup_only.tokens, baseline.tokens)
    assert lookup_only.stats.draft_calls < tail.stats.draft_calls
    assert lookup_only.stats.target_calls <= tail.stats.target_calls
    # several images per call: the head drafts every round (rows would commit different numbers of pairs)
    two = pipe(PROMPTS, method="eagle", lookup_tail=16, lookup_only_from=4, **kwargs)
    assert torch.equal(two.tokens, pipe(PROMPTS, method="none", do_sample=False, output_type="tokens").tokens)
    assert two.stats.draft_calls >= two.stats.target_calls - 1


def test_mulo_on_the_zoo_takes_one_target_pass_per_block(pipe):
    out = pipe(PROMPTS[:1], method="mulo", generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.stats.target_calls == 1 + 8 // 2
    assert out.images.shape == (1, 32, 32, 3) and out.drafted.any()
