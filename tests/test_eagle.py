"""EAGLE draft head: lossless drafting through the core loop, training objective, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from mmspec import CausalLMRunner, SamplingConfig, TreeConfig, speculative_generate
from mmspec.models.eagle import EagleDrafter, EagleHead, eagle_loss


def _head(target, dtype=torch.float64, **kwargs) -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(hidden_size=target.config.hidden_size, vocab_size=target.config.vocab_size,
                     num_attention_heads=4, **kwargs).to(dtype)
    return head.bind_target(target.get_input_embeddings(), target.get_output_embeddings())


@pytest.mark.parametrize("tree", [None, TreeConfig(depth=3, top_k=2, total_tokens=6)], ids=["chain", "tree"])
def test_untrained_head_is_lossless_under_greedy(llama_pair, tree):
    target, _ = llama_pair
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    baseline = speculative_generate(CausalLMRunner(target), None, ids, mask, max_new_tokens=16)
    drafter = EagleDrafter(_head(target, input_norm=True), 4, tree=tree)
    spec = speculative_generate(CausalLMRunner(target, return_hidden=True), drafter, ids, mask, max_new_tokens=16)
    assert torch.equal(spec.sequences, baseline.sequences)
    assert spec.stats.draft_calls > 0


def test_training_raises_acceptance_and_stays_lossless():
    """A few dozen EAGLE steps on the target's own samples: loss falls, drafts get accepted."""
    torch.manual_seed(0)
    target = tiny_llama(layers=2, seed=0, dtype=torch.float32)
    target.requires_grad_(False)
    head = _head(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 32, (64, 4), generator=g)
    samples = speculative_generate(CausalLMRunner(target), None, prompts, max_new_tokens=16,
                                   sampling=SamplingConfig(do_sample=True), generator=g).sequences
    sequences = torch.cat([prompts, samples], 1)
    ids = torch.randint(3, 32, (4, 4), generator=g)
    before = speculative_generate(CausalLMRunner(target, return_hidden=True), EagleDrafter(head, 4), ids,
                                  max_new_tokens=16).stats.mean_accepted_length
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(80):
        batch = sequences[torch.randint(0, 64, (32,), generator=g)]
        with torch.no_grad():
            hidden = target(batch, output_hidden_states=True).hidden_states[-1]
        out = eagle_loss(head, batch, hidden, feature_noise=0.1, generator=g)
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        losses.append(out["loss"].item())
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])
    baseline = speculative_generate(CausalLMRunner(target), None, ids, max_new_tokens=16)
    spec = speculative_generate(CausalLMRunner(target, return_hidden=True), EagleDrafter(head, 4), ids, max_new_tokens=16)
    assert torch.equal(spec.sequences, baseline.sequences)
    assert spec.stats.mean_accepted_length > before + 0.1


def test_save_load_roundtrip_does_not_store_the_target_head(tmp_path, llama_pair):
    target, _ = llama_pair
    head = _head(target)
    head.save_pretrained(tmp_path)
    loaded = EagleHead.from_pretrained(tmp_path).to(torch.float64)
    assert not any("lm_head" in k or "embed" in k for k in loaded.state_dict())
    loaded.bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    ids = torch.randint(3, 32, (2, 5))
    hidden = torch.randn(2, 5, 32, dtype=torch.float64)
    assert torch.allclose(loaded(ids, target_hidden=hidden, use_cache=False).logits,
                          head(ids, target_hidden=hidden, use_cache=False).logits)


def test_mismatched_head_is_a_clear_error(llama_pair):
    target, _ = llama_pair
    with pytest.raises(ValueError, match="vocab mismatch"):
        EagleHead(hidden_size=32, vocab_size=40).bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    with pytest.raises(RuntimeError, match="bind_target"):
        EagleDrafter(EagleHead(hidden_size=32, vocab_size=32))
    ids = torch.randint(3, 32, (1, 5))
    with pytest.raises(ValueError, match="return_hidden"):
        speculative_generate(CausalLMRunner(target), EagleDrafter(_head(target)), ids, max_new_tokens=4)
    wide = tiny_llama(hidden=48)
    head = EagleHead(hidden_size=32, vocab_size=32, num_attention_heads=4).double()
    head._target = {"embed": target.get_input_embeddings(), "head": target.get_output_embeddings()}
    with pytest.raises(ValueError, match="hidden size mismatch"):
        speculative_generate(CausalLMRunner(wide, return_hidden=True), EagleDrafter(head), ids, max_new_tokens=4)
