"""Smaller core parts: sampling utilities, reward router, local 2-D sets, caches, statistics."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mmspec import (
    KVCache,
    RewardRouter,
    SamplingConfig,
    SpecStats,
    apply_guidance,
    local_resample_sets,
    logits_to_probs,
    sample,
)
from mmspec.cache import SlotState, crop_cache, drop_trailing_holes, select_cache_slots
from mmspec.rules import ExactRule, GreedyRule
from mmspec.sampling import CHUNKED_ARGMAX_MIN, first_argmax, sample_inverse_cdf, top_token
from mmspec.speculate import target_probs_fn

# ------------------------------------------------------------------------------------------- sampling


def test_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    assert torch.allclose(logits_to_probs(logits), logits.softmax(-1))
    assert torch.allclose(logits_to_probs(logits, SamplingConfig(temperature=0.5)), (logits / 0.5).softmax(-1))
    top2 = logits_to_probs(logits, SamplingConfig(top_k=2))
    assert (top2[0, 2:] == 0).all() and top2.sum().item() == pytest.approx(1.0)
    probs = logits.softmax(-1)[0]  # 0.644, 0.237, 0.087, 0.032
    nucleus = logits_to_probs(logits, SamplingConfig(top_p=0.8))
    assert (nucleus[0] > 0).tolist() == [True, True, False, False]
    assert nucleus[0, 0].item() == pytest.approx(probs[0] / (probs[0] + probs[1]))
    greedy = logits_to_probs(logits, SamplingConfig(do_sample=False))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_first_argmax_is_torch_argmax_on_long_rows(dtype):
    """The chunked CPU argmax returns torch's index on every row: the first maximum, NaN counting as the
    maximum, ties inside and across chunks, -inf rows, the shorter last chunk and non-contiguous rows."""
    g = torch.Generator().manual_seed(0)
    for vocab in (CHUNKED_ARGMAX_MIN, 151_936, 32_771):
        noise = torch.randn(3, 4, vocab, generator=g).to(dtype)
        ties = torch.randint(-2, 3, (3, 4, vocab), generator=g).to(dtype)  # many equal maxima per row
        special = noise.clone()
        special[0, 0, 1_000] = float("nan")
        special[0, 1, :] = float("-inf")
        special[0, 2, -1] = 1e4  # the maximum in the shorter last chunk
        special[1, 0, 5], special[1, 0, vocab - 5] = 1e4, 1e4  # tied across chunks: the first wins
        for weights in (noise, ties, special, special.transpose(0, 1), special[..., : vocab - 7]):
            assert torch.equal(first_argmax(weights), weights.argmax(-1))
        best, index = top_token(special)
        assert torch.equal(best.isnan(), special.isnan().any(-1)) and index[0, 0] == 1_000


def test_greedy_verification_reads_the_argmax_one_hot_only_for_the_greedy_rule():
    logits = torch.randn(2, 3, 50_000, generator=torch.Generator().manual_seed(1))
    greedy = SamplingConfig(do_sample=False)
    one_hot = target_probs_fn(greedy, GreedyRule())(logits)
    assert torch.equal(one_hot.argmax(-1), logits.argmax(-1)) and torch.equal(one_hot.sum(-1), torch.ones(2, 3))
    assert torch.allclose(target_probs_fn(greedy)(logits), logits.softmax(-1))  # relaxed greedy rules' masses
    assert torch.allclose(target_probs_fn(SamplingConfig(), ExactRule())(logits), logits.softmax(-1))
    logits[1, 2, 7] = float("nan")
    with pytest.raises(ValueError, match="target distribution: row"):
        target_probs_fn(greedy, GreedyRule())(logits)


def test_guidance_on_a_doubled_batch():
    cond = torch.tensor([[1.0, 2.0]])
    uncond = torch.tensor([[0.5, 0.5]])
    guided = apply_guidance(torch.cat([cond, uncond]), 3.0)
    assert torch.allclose(guided, uncond + 3.0 * (cond - uncond))
    with pytest.raises(ValueError, match="doubled batch"):
        apply_guidance(torch.zeros(3, 2), 2.0)


def test_sampling_is_deterministic_and_distributed_correctly():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64).expand(200_000, 4)
    a = sample(probs, torch.Generator().manual_seed(0))
    b = sample(probs, torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=4).double() / len(a)
    assert freq[1] == 0
    assert torch.allclose(freq, probs[0], atol=0.004)
    # inverse CDF picks the first index whose cumulative mass exceeds u * total
    w = torch.tensor([[0.0, 2.0, 0.0, 2.0]])
    assert sample_inverse_cdf(w, torch.tensor([0.49])).item() == 1
    assert sample_inverse_cdf(w, torch.tensor([0.5])).item() == 3


def test_bad_sampling_options():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="top_k=10 is larger"):
        logits_to_probs(torch.zeros(1, 4), SamplingConfig(top_k=10))


# -------------------------------------------------------------------------------------- reward router

def test_guided_runner_conditional_half_of_a_prompt_batch():
    """The first B rows of the 2B-row mask and of every 2B-row tensor input; other inputs pass unchanged."""
    from mmspec.runner import GuidedRunner

    mask, ids, scale = torch.arange(8).view(4, 2), torch.arange(12).view(4, 3), torch.tensor(2.0)
    half_mask, inputs = GuidedRunner.conditional_half(mask, {"ids": ids, "scale": scale, "name": "x",
                                                             "table": torch.zeros(3, 4)})
    assert torch.equal(half_mask, mask[:2]) and torch.equal(inputs["ids"], ids[:2])
    assert inputs["scale"] is scale and inputs["name"] == "x" and inputs["table"].shape == (3, 4)
    assert torch.equal(GuidedRunner.conditional_half(None, {"ids": ids})[1]["ids"], ids[:2])
    with pytest.raises(ValueError, match="2B rows"):
        GuidedRunner.conditional_half(torch.zeros(3, 2), {})


def test_reward_router_min_mean_and_first_block():
    scores = torch.tensor([[0.9, 0.2, 0.8], [0.7, 0.6, 0.65]])
    router = RewardRouter(lambda frames, prompt: scores, tau=0.5)
    first = router(None, "p", block_index=0, num_frames=3, batch_size=2)
    assert not first.accept.any() and torch.isnan(first.score).all()
    decision = router(None, "p", block_index=1, num_frames=3, batch_size=2)
    assert decision.accept.tolist() == [False, True]  # worst frames 0.2 and 0.6
    mean = RewardRouter(lambda f, p: scores, tau=0.5, aggregate="mean", force_reject_first=False)
    assert mean(None, "p", 0, 3, 2).accept.tolist() == [True, True]


def test_reward_router_infinite_tau_skips_scoring():
    def boom(frames, prompt):
        raise AssertionError("reward model must not run")

    assert RewardRouter(boom, tau=math.inf)(None, "p", 2, 4).accept.tolist() == [False]
    assert RewardRouter(boom, tau=-math.inf, force_reject_first=False)(None, "p", 0, 4).accept.tolist() == [True]


def test_reward_router_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        RewardRouter(lambda f, p: [1.0], tau=float("nan"))
    with pytest.raises(ValueError, match="aggregate"):
        RewardRouter(lambda f, p: [1.0], tau=0.0, aggregate="max")
    router = RewardRouter(lambda f, p: [0.5, 0.5], tau=0.0)
    with pytest.raises(ValueError, match="one per frame"):
        router(None, "p", block_index=1, num_frames=3)
    with pytest.raises(ValueError, match="callable"):
        RewardRouter("imagereward", tau=0.0)


# ------------------------------------------------------------------------------------------- local 2-D

def test_local_resample_sets():
    accepted = torch.ones(1, 5, 5, dtype=torch.bool)
    accepted[0, 2, 2] = False
    sets = local_resample_sets(accepted, radius=1)
    assert sets.resample[0].sum() == 9 and sets.resample[0, 1:4, 1:4].all()
    assert torch.equal(sets.keep, ~sets.resample)
    corner = torch.ones(1, 4, 4, dtype=torch.bool)
    corner[0, 0, 0] = False
    assert local_resample_sets(corner, radius=1).resample[0].sum() == 4
    assert local_resample_sets(corner, radius=0).resample[0].sum() == 1
    assert local_resample_sets(corner, radius=0).resample_indices().tolist() == [[0, 0, 0]]
    valid = torch.zeros(1, 4, 4, dtype=torch.bool)
    valid[0, :2] = True
    limited = local_resample_sets(corner, radius=3, valid=valid)
    assert limited.resample[0].sum() == 8 and not limited.keep.any()
    with pytest.raises(ValueError, match="radius"):
        local_resample_sets(corner, radius=-1)
    with pytest.raises(ValueError, match="bool"):
        local_resample_sets(corner.long(), radius=1)


# ---------------------------------------------------------------------------------------------- caches

def test_kv_cache_update_crop_and_select():
    cache = KVCache(num_layers=2, batch_size=2, num_heads=1, head_dim=1, max_length=8)
    for step in range(2):
        for layer in range(2):
            k = torch.arange(3, dtype=torch.float32).view(1, 1, 3, 1).expand(2, 1, 3, 1) + 10 * step
            cache.update(layer, k, k)
    assert cache.get_seq_length() == 6
    cache.crop(4)
    assert cache.get_seq_length() == 4
    # keep slots (relative to 1): row 0 -> 2, 0 ; row 1 -> 1, hole
    select_cache_slots(cache, 1, torch.tensor([[2, 0], [1, -1]]))
    assert cache.get_seq_length() == 3
    assert cache.keys[0, 0, 0, :3, 0].tolist() == [0.0, 10.0, 1.0]
    assert cache.keys[0, 1, 0, 1, 0].item() == 2.0
    fixed = KVCache(num_layers=1, batch_size=2, num_heads=1, head_dim=1, max_length=4, growable=False)
    with pytest.raises(ValueError, match="overflow"):
        fixed.update(0, torch.zeros(2, 1, 9, 1), torch.zeros(2, 1, 9, 1))
    cache.update(0, torch.ones(2, 1, 9, 1), torch.ones(2, 1, 9, 1))  # grows past max_length=8
    keys, _ = cache.update(1, torch.ones(2, 1, 9, 1), torch.ones(2, 1, 9, 1))
    assert cache.get_seq_length() == 12 and keys.shape[2] == 12 and cache.max_length >= 12
    assert keys[0, 0, 0, 0].item() == 0.0  # old content survives the growth
    cache.update(0, torch.full((2, 1, 1, 1), 7.0), torch.full((2, 1, 1, 1), 8.0))  # writes land in the grown buffers
    assert cache.keys[0, :, 0, 12, 0].tolist() == [7.0, 7.0] and cache.values[0, :, 0, 12, 0].tolist() == [8.0, 8.0]


def test_transformers_cache_rollback():
    from conftest import tiny_llama
    from transformers import DynamicCache

    from mmspec.evaluation.cache_commit import commit_by_concatenation

    model = tiny_llama()
    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 32, (2, 7))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    keys = cache.layers[0].keys.clone()
    crop_cache(cache, 5)
    assert cache.get_seq_length() == 5
    values = cache.layers[0].values.clone()
    index = torch.tensor([[2, 0], [1, 1]])
    reference = copy.deepcopy(cache)  # the same selection done by concatenation, out of place
    commit_by_concatenation(reference, 2, index)
    select_cache_slots(cache, 2, index)
    assert cache.get_seq_length() == 4
    layer = cache.layers[0]
    assert torch.equal(layer.keys[:, :, :2], keys[:, :, :2]) and torch.equal(layer.values[:, :, :2], values[:, :, :2])
    # row 0 moves slot 4 into slot 2 and slot 2 into slot 3 (in place: read before written)
    assert torch.equal(layer.keys[0, :, 2], keys[0, :, 4]) and torch.equal(layer.keys[0, :, 3], keys[0, :, 2])
    assert torch.equal(layer.values[0, :, 2], values[0, :, 4]) and torch.equal(layer.values[0, :, 3], values[0, :, 2])
    assert torch.equal(layer.keys[1, :, 3], keys[1, :, 3])
    for got, ref in zip(cache.layers, reference.layers):
        assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)
    # decoding continues from the selected slots exactly as from the concatenated ones
    nxt = torch.randint(3, 32, (2, 1))
    with torch.no_grad():
        step = model(nxt, past_key_values=cache, use_cache=True, position_ids=torch.full((2, 1), 4)).logits
        expected = model(nxt, past_key_values=reference, use_cache=True, position_ids=torch.full((2, 1), 4)).logits
    assert torch.equal(step, expected) and cache.get_seq_length() == 5
    legacy = ((keys, keys),)
    assert crop_cache(legacy, 3)[0][0].shape[2] == 3


def test_slot_state_rounds():
    state = SlotState.from_attention_mask(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert state.last_position.tolist() == [1, 2]
    assert state.prompt_positions().tolist() == [[0, 0, 1], [0, 1, 2]]
    state.begin_round()
    positions, mask = state.append(torch.tensor([[True, True, True], [False, True, True]]))
    assert positions.tolist() == [[2, 3, 4], [3, 3, 4]]
    assert mask.shape == (2, 6)
    state.commit(torch.tensor([[0, 1], [1, -1]]))
    assert state.valid.tolist() == [[False, True, True, True, True], [True, True, True, True, False]]
    assert state.last_position.tolist() == [3, 3]


def test_drop_trailing_holes_keeps_the_widest_row():
    keep = torch.tensor([[0, 1, -1, -1, -1], [0, -1, -1, -1, -1]])
    assert drop_trailing_holes(keep).tolist() == [[0, 1], [0, -1]]
    inner = torch.tensor([[0, -1, 2, -1], [-1, -1, -1, -1]])  # a hole before a kept slot stays
    assert drop_trailing_holes(inner).tolist() == [[0, -1, 2], [-1, -1, -1]]
    assert drop_trailing_holes(torch.full((2, 3), -1)).shape == (2, 0)
    assert drop_trailing_holes(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)
    with pytest.raises(ValueError, match="keep"):
        drop_trailing_holes(torch.tensor([0, 1]))


# ----------------------------------------------------------------------------------------------- stats

def test_spec_stats_accounting():
    stats = SpecStats()
    stats.record_verification(torch.tensor([2, 0, 4]), 4)
    stats.record_verification(torch.tensor([1, 1, 1]), 4, active=torch.tensor([True, True, False]))
    assert stats.verify_steps == 5
    assert stats.mean_accepted_length == pytest.approx((3 + 1 + 5 + 2 + 2) / 5)
    assert stats.mean_accepted_drafts == pytest.approx(stats.mean_accepted_length - 1)
    # position 0 verified 5 times, accepted 4 times (rows with n >= 1)
    assert stats.position_attempts[0] == 5 and stats.position_accepts[0] == 4
    assert stats.acceptance_rates[3] == 1.0  # only the n=4 row reached position 3 and accepted it
    with stats.phase("draft"):
        pass
    assert "draft" in stats.as_dict()["phase_seconds"]


def test_spec_stats_merge_sums_every_counter_and_position_checks_count_all_positions():
    from mmspec.stats import SpecStats

    a = SpecStats(target_calls=2, draft_calls=1, tokens=5, verify_steps=2, emitted=6)
    a.record_position_checks(torch.tensor([[True, False, True], [True, True, False]]))
    b = SpecStats(target_calls=3, tokens=4, verify_steps=1, emitted=2)
    b.record_position_checks(torch.tensor([[False, True]]))
    b.phase_seconds["draft"] += 0.5
    for stats in (a, b, b):
        with stats.phase("target"):
            pass
    merged = SpecStats.merge([a, b])
    assert merged.phase_calls["target"] == 3 and merged.as_dict()["phase_calls"] == {"target": 3}
    assert (merged.target_calls, merged.draft_calls, merged.tokens, merged.verify_steps, merged.emitted) == (5, 1, 9, 3, 8)
    assert merged.position_attempts == [3, 3, 2] and merged.position_accepts == [2, 2, 1]
    assert merged.phase_seconds["draft"] == 0.5 and merged.mean_accepted_length == 8 / 3


def test_a_prefix_selection_is_a_crop_that_moves_nothing():
    from mmspec.cache import keeps_prefix

    cache = KVCache(num_layers=1, batch_size=2, num_heads=1, head_dim=1, max_length=8)
    cache.update(0, torch.arange(5.0).view(1, 1, 5, 1).repeat(2, 1, 1, 1), torch.zeros(2, 1, 5, 1))
    before = cache.keys.clone()
    assert keeps_prefix(torch.tensor([[0, 1], [0, 1]])) and not keeps_prefix(torch.tensor([[0, 1], [0, -1]]))
    assert not keeps_prefix(torch.tensor([[1, 0], [0, 1]]))
    select_cache_slots(cache, 2, torch.tensor([[0, 1], [0, 1]]))
    assert cache.get_seq_length() == 4 and torch.equal(cache.keys, before)
    select_cache_slots(cache, 1, torch.tensor([[2], [0]]))  # not a prefix: row 0 moves slot 3 to slot 1
    assert cache.get_seq_length() == 2 and cache.keys[0, 0, 0, 1, 0].item() == 3.0 and cache.keys[0, 1, 0, 1, 0].item() == 1.0


def test_appending_by_count_is_appending_an_all_valid_mask():
    """``SlotState.append(T)`` (the runner's path for all-valid slots) gives the positions, key mask and state
    of ``append`` with an all-True mask, and a prefix commit after it (``keep_first``) the state of the
    general ``commit``."""
    def fresh():
        state = SlotState.from_attention_mask(torch.tensor([[0, 1, 1], [1, 1, 1]]))
        state.begin_round()
        return state

    by_count, by_mask = fresh(), fresh()
    got, want = by_count.append(4), by_mask.append(torch.ones(2, 4, dtype=torch.bool))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(by_count.last_position, by_mask.last_position) and by_count.round_all_valid
    assert not by_mask.round_all_valid  # a mask is not read on the host, so the round is not known all-valid
    by_count.keep_first(2)
    by_mask.commit(torch.arange(2).expand(2, -1))
    assert torch.equal(by_count.valid, by_mask.valid)
    assert torch.equal(by_count.last_position, by_mask.last_position) and by_count.last_position.tolist() == [3, 4]
    with pytest.raises(RuntimeError, match="valid chain slots"):
        by_mask.keep_first(1)


@pytest.mark.parametrize("keeps", [[[0, 1, 2], [0, 1, 2]], [[0, 1, -1], [0, -1, -1]], [[0, -1, -1, -1], [0, -1, -1, -1]],
                                   [[1, 2], [0, -1]], [[-1, -1], [-1, -1]]])
def test_runner_commit_paths_agree_with_the_reference_selection(keeps):
    """``CausalLMRunner.commit`` decides on the host whether a selection is a crop (and then skips the mask
    arithmetic when the round appended valid slots only); the next forward sees what the reference
    selection (``select_cache_slots`` + ``SlotState.commit``) leaves."""
    from conftest import tiny_llama

    from mmspec.runner import CausalLMRunner

    model = tiny_llama(layers=1)
    prompt = torch.tensor([[3, 4, 5], [6, 7, 8]])
    drafts = torch.tensor([[9, 10, 11, 12], [13, 14, 15, 16]])
    keep = torch.tensor(keeps)

    fast, reference = CausalLMRunner(model), CausalLMRunner(model)
    for runner in (fast, reference):
        runner.prefill(prompt)
        runner.begin_round()
        runner.forward(drafts)
    fast.commit(keep)
    state = reference.slots
    width = max([j + 1 for row in keeps for j, slot in enumerate(row) if slot >= 0], default=0)
    reference.cache = select_cache_slots(reference.cache, state.round_start, keep[:, :width])
    state.commit(keep[:, :width])
    assert torch.equal(fast.slots.valid, reference.slots.valid)
    assert torch.equal(fast.slots.last_position, reference.slots.last_position)
    for runner in (fast, reference):
        runner.begin_round()
    next_tokens = torch.tensor([[17, 18], [19, 20]])
    assert torch.equal(fast.forward(next_tokens).logits, reference.forward(next_tokens).logits)
