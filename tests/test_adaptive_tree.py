"""Entropy-adaptive draft trees (TreeConfig(adaptive="entropy")): the node budget holds, a sure drafter grows
deep and narrow trees and an unsure one shallow and wide ones, and decoding stays lossless (greedy output equals
target-only decoding, sampled output follows the target), in the core loop and on the VLM zoo with a head."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from pipeline_utils import quiet_pipeline
from stats_utils import P_VALUE_FLOOR, chi_square_pvalue, empirical
from test_speculate import _exact_marginals, _prompt

from mmspec import CausalLMRunner, ModelDrafter, SamplingConfig, TreeConfig, speculative_generate
from mmspec.methods.eagle import EagleConfig
from mmspec.methods.vlm_heads import VLMEagleConfig
from mmspec.tree import entropy_branching, expand_dynamic_tree, expand_entropy_tree, is_sure

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENTROPY = TreeConfig(depth=6, top_k=3, total_tokens=30, adaptive="entropy")


def _table_step(table: torch.Tensor, calls: list):
    """A context-free drafter: the log-probabilities after a node depend on its token only (``table[token]``);
    records each call's frontier width and depth."""
    def step(tokens, node_ids, parent_ids, depth):
        calls.append((tokens.shape[1], depth))
        return table[tokens]
    return step


def _scripted_table(vocab: int, sure: bool) -> torch.Tensor:
    """Next-token log-probabilities ``[V, V]``: after token t a sure drafter puts 0.97 on t + 1, an unsure one
    spreads its mass evenly over six tokens."""
    probs = torch.full((vocab, vocab), 1e-4, dtype=torch.float64)
    for token in range(vocab):
        if sure:
            probs[token, (token + 1) % vocab] = 0.97
        else:
            probs[token, [(token + j) % vocab for j in range(1, 7)]] = 1.0
    return (probs / probs.sum(-1, keepdim=True)).log()


def test_entropy_branching_counts_the_effective_choices():
    vocab = 40
    sure = torch.full((vocab,), 1e-6, dtype=torch.float64)
    sure[3] = 1.0
    coin = torch.zeros(vocab, dtype=torch.float64)
    coin[[4, 9]] = 0.5
    spread = torch.zeros(vocab, dtype=torch.float64)
    spread[:5] = 0.2
    uniform = torch.ones(vocab, dtype=torch.float64)
    rows = torch.stack([p / p.sum() for p in (sure, coin, spread, uniform)]).log()
    assert entropy_branching(rows, top_k=8).tolist() == [1, 2, 5, 8]  # the uniform row is capped at top_k
    assert entropy_branching(rows.unsqueeze(0), top_k=3).tolist() == [[1, 2, 3, 3]]
    favourite = torch.full((vocab,), 0.05 / (vocab - 1), dtype=torch.float64)
    favourite[7] = 0.95
    assert is_sure(torch.cat([rows, favourite.log().unsqueeze(0)])).tolist() == [True, False, False, False, True]


@pytest.mark.parametrize("seed", range(4))
def test_the_tree_keeps_the_node_budget(seed):
    """Random drafters, batch sizes and settings: at most total_tokens nodes (exactly that many when the
    expansion stopped early), at most top_k nodes fed per drafter call and one per row past ``depth`` (sure
    paths only), one call per level below the root, and every node's token is one of its parent's top_k draft
    tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = 30
    for _ in range(25):
        batch = int(torch.randint(1, 4, (1,), generator=g))
        depth, top_k = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        total = int(torch.randint(1, 40, (1,), generator=g))
        sharpness = float(torch.rand(1, generator=g)) * 8
        table = (torch.randn(vocab, vocab, generator=g) * sharpness).log_softmax(-1)
        root = (torch.randn(batch, vocab, generator=g) * sharpness).log_softmax(-1)
        calls: list = []
        tree = expand_entropy_tree(root, _table_step(table, calls), depth, top_k, total)
        assert tree.num_nodes <= total and int(tree.depths().max()) <= max(depth, total)
        assert all(width <= top_k for width, _ in calls)
        assert all(width <= batch for width, level in calls if level >= depth)
        assert [level for _, level in calls] == list(range(1, len(calls) + 1))
        if len(calls) < depth - 1:  # stopped early: nothing more could enter, so the budget is full
            assert tree.num_nodes == total
        parent_tokens = torch.where(tree.parents >= 0, tree.tokens.gather(1, tree.parents.clamp_min(0)), -1)
        for b in range(batch):
            for j in range(tree.num_nodes):
                dist = root[b] if parent_tokens[b, j] < 0 else table[parent_tokens[b, j]]
                assert tree.tokens[b, j] in dist.topk(top_k).indices


def test_sure_drafters_grow_deep_narrow_trees_and_unsure_ones_shallow_wide_ones():
    vocab, depth, top_k, total = 24, 6, 4, 16
    shapes = {}
    for sure in (True, False):
        table = _scripted_table(vocab, sure)
        root = table[torch.tensor([0])]
        calls: list = []
        tree = expand_entropy_tree(root, _table_step(table, calls), depth, top_k, total)
        widest_level = int(torch.bincount(tree.depths()[0]).max())
        shapes[sure] = {"depth": int(tree.depths().max()), "widest_level": widest_level,
                        "widest_call": max(width for width, _ in calls), "calls": len(calls), "nodes": tree.num_nodes}
    assert shapes[True]["depth"] == total and shapes[True]["widest_level"] == 1  # one sure path, past depth
    assert shapes[False]["depth"] <= 3 and shapes[False]["calls"] < depth - 1  # stopped early: shallow
    assert shapes[False]["widest_call"] == top_k  # every root child expanded
    assert shapes[False]["widest_level"] > top_k
    assert shapes[True]["nodes"] == shapes[False]["nodes"] == total  # the same budget, spent differently
    # EAGLE-2 with the same settings expands top_k nodes at every level whatever the drafter's confidence
    calls = []
    expand_dynamic_tree(_scripted_table(vocab, True)[torch.tensor([0])], _table_step(_scripted_table(vocab, True), calls),
                        depth, top_k, total)
    assert [width for width, _ in calls] == [top_k] * (depth - 1)


@pytest.mark.parametrize("expand", [expand_dynamic_tree, expand_entropy_tree])
def test_children_tied_with_their_parents_keep_the_tree_ancestor_closed(expand):
    """A float32 drafter sure to the last bit gives children the score of their parent (and -inf ties -inf):
    the kept nodes still include every ancestor, in topological order."""
    vocab = 10
    table = torch.full((vocab, vocab), -1e9)
    table[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 0.0
    table[:, 0] = -torch.inf
    root = torch.full((2, vocab), -30.0)
    root[:, 3] = -20.0
    root[1, 5] = -torch.inf
    tree = expand(root.log_softmax(-1) - 50, lambda tokens, *_: table[tokens].log_softmax(-1), 6, 4, 20)
    assert tree.num_nodes == 20 and int(tree.depths().max()) >= 6  # the sure path runs to the depth limit


def test_tree_config_validates_and_round_trips():
    with pytest.raises(ValueError, match=r"TreeConfig.adaptive must be one of None, 'entropy', got 'wide'"):
        TreeConfig(adaptive="wide")
    for config in (VLMEagleConfig(tree=ENTROPY), EagleConfig(tree=ENTROPY)):
        again = type(config).from_dict(json.loads(json.dumps(config.to_dict())))
        assert again == config and again.tree.adaptive == "entropy"
    assert VLMEagleConfig.from_dict({"tree": {"depth": 3, "top_k": 2, "total_tokens": 6}}).tree.adaptive is None


@pytest.mark.parametrize("drafter", ["self", "small"])
def test_greedy_output_equals_target_only_decoding(llama_pair, drafter):
    target, draft = llama_pair
    ids, mask = _prompt()
    baseline = speculative_generate(CausalLMRunner(target), None, ids, mask, max_new_tokens=24)
    spec = speculative_generate(CausalLMRunner(target), ModelDrafter(target if drafter == "self" else draft,
                                                                     tree=ENTROPY), ids, mask, max_new_tokens=24)
    assert torch.equal(spec.sequences, baseline.sequences)
    if drafter == "self":  # a perfect drafter is sure of its drafts: deep trees, far fewer target calls
        assert spec.stats.mean_accepted_length > 3.5
    else:
        assert 1.0 < spec.stats.mean_accepted_length < 6.0  # both accepted and rejected drafts


def test_sampling_preserves_the_target_distribution():
    """4000 rows of one prompt, temperature 1: each of the first three tokens follows the exact target
    marginal (chi-square p > 1e-4), with a drafter that disagrees often."""
    vocab = 12
    target = tiny_llama(vocab_size=vocab, layers=2, seed=3)
    draft = tiny_llama(vocab_size=vocab, layers=1, seed=4)
    with torch.no_grad():  # soften both so sampling explores and the drafter is plausible but wrong
        target.lm_head.weight.mul_(0.25)
        draft.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([3, 5, 7, 9])
    rows = 4000
    sampling = SamplingConfig(do_sample=True)
    drafter = ModelDrafter(draft, sampling=sampling, tree=TreeConfig(depth=3, top_k=3, total_tokens=5, adaptive="entropy"),
                           generator=torch.Generator().manual_seed(1))
    out = speculative_generate(CausalLMRunner(target), drafter, prompt.expand(rows, -1).contiguous(), max_new_tokens=3,
                               sampling=sampling, generator=torch.Generator().manual_seed(2))
    assert 1.02 < out.stats.mean_accepted_length < 4.0  # drafts are both accepted and rejected
    for j, marginal in enumerate(_exact_marginals(target, prompt, 3)):
        assert chi_square_pvalue(empirical(out.sequences[:, j], vocab), marginal) > P_VALUE_FLOOR, f"token {j}"


def test_vlm_zoo_head_with_an_entropy_tree_reproduces_target_only_text(monkeypatch):
    """mmspec/shapes-vlm, greedy, the EAGLE head drafting entropy-adaptive trees (through EagleDrafter, which
    every VLM head's drafter derives from): the text equals target-only decoding and the trained head is
    accepted deeper than the tree's depth setting (along paths it is sure of)."""
    from mmspec.models import shapes_vlm as sv
    from mmspec.pipelines import VLMPipeline
    from mmspec.pipelines.hub import zoo_dir

    if not (zoo_dir() / "shapes-vlm" / "model_index.json").is_file():
        pytest.fail("mmspec/shapes-vlm is not built (bash scripts/build_zoo_vlm.sh)")
    pipe = quiet_pipeline(VLMPipeline, "mmspec/shapes-vlm")
    grown = []

    def counting(*args, **kwargs):
        tree = expand_entropy_tree(*args, **kwargs)
        grown.append(int(tree.depths().max()))
        return tree

    monkeypatch.setattr("mmspec.drafters.expand_entropy_tree", counting)
    image, video = sv.image_example("test", 0, 0, "describe"), sv.video_example("test", 0, 0, "narrate")
    videos, prompts = [list(image["frames"]), list(video["frames"])], [image["prompt"], video["prompt"]]
    base = pipe(videos=videos, prompt=prompts, method="none", max_new_tokens=48)
    tree = TreeConfig(depth=4, top_k=4, total_tokens=24, adaptive="entropy")
    for name in ("eagle", "vispec"):
        spec = pipe(videos=videos, prompt=prompts, method=pipe.method_config(name).replace(tree=tree), max_new_tokens=48)
        assert spec.text == base.text and all(torch.equal(a, b) for a, b in zip(spec.tokens, base.tokens)), name
        assert spec.stats.mean_accepted_length > 5.0, name  # more than depth 4 allows: sure paths went deeper
    assert grown and max(grown) > 4  # the entropy expansion ran
