"""The t2i target recipe's later stages: ``train_t2i --init`` starts from a trained target's weights."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.recipes import train_t2i

TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--train-images", "40", "--batch", "4", "--threads", "1"]


def _weights(folder) -> dict[str, torch.Tensor]:
    return LlamaGenTransformer.from_pretrained(folder).state_dict()


def test_init_starts_a_later_stage_from_the_trained_weights(tmp_path):
    train_t2i.main([*TINY, "--steps", "3", "--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa")])
    # a zero learning rate leaves the initial weights as they are: stage 2's output is stage 1's model
    train_t2i.main([*TINY, "--steps", "1", "--lr", "0", "--seed", "1", "--init", str(tmp_path / "a"),
                    "--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb")])
    first, second = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    # without --init the same stage starts from fresh weights
    train_t2i.main([*TINY, "--steps", "1", "--lr", "0", "--seed", "1", "--out", str(tmp_path / "c"),
                    "--work", str(tmp_path / "wc")])
    fresh = _weights(tmp_path / "c")
    assert not all(torch.equal(first[k], fresh[k]) for k in first)


def test_init_rejects_another_architecture_and_a_missing_folder(tmp_path):
    train_t2i.main([*TINY, "--steps", "1", "--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa")])
    wider = [*TINY[:1], "48", *TINY[2:]]
    with pytest.raises(ValueError, match="another architecture"):
        train_t2i.main([*wider, "--steps", "1", "--init", str(tmp_path / "a"), "--out", str(tmp_path / "b"),
                        "--work", str(tmp_path / "wb")])
    with pytest.raises(FileNotFoundError, match="no trained target"):
        train_t2i.main([*TINY, "--steps", "1", "--init", str(tmp_path / "missing"), "--out", str(tmp_path / "c"),
                        "--work", str(tmp_path / "wc")])


@pytest.mark.slow
def test_eagle_self_distillation_adds_the_targets_own_samples(tmp_path):
    """``train_eagle --self-distill N``: N extra rows whose tokens are the target's own guided samples for
    the first N training captions (cached in the work folder), and the head trains on them."""
    from mmspec.models.recipes import train_eagle
    from mmspec.models.recipes.report_t2i import generate_tokens
    from mmspec.sampling import SamplingConfig

    train_t2i.main([*TINY, "--steps", "2", "--out", str(tmp_path / "target"), "--work", str(tmp_path / "wt")])
    common = ["--target", str(tmp_path / "target"), "--heads", "2", "--train-images", "40", "--batch", "4",
              "--threads", "1", "--steps", "2"]
    train_eagle.main([*common, "--self-distill", "6", "--out", str(tmp_path / "head"), "--work", str(tmp_path / "we")])
    own = torch.load(tmp_path / "we" / "self_distill.pt")
    data = torch.load(tmp_path / "we" / "data.pt")
    assert torch.equal(own["words"], data["words"][:6])
    target = LlamaGenTransformer.from_pretrained(tmp_path / "target").float().eval()
    expected = generate_tokens(target, data["words"][:6], 3.0, SamplingConfig(), torch.Generator().manual_seed(0))
    assert torch.equal(own["tokens"], expected)
    assert not torch.equal(own["tokens"], data["tokens"][:6])  # the target's samples, not the rendered images
    assert (tmp_path / "head" / "config.json").is_file()
    # --self-distill-greedy: the target's argmax images instead (cached under their own name)
    train_eagle.main([*common, "--self-distill", "6", "--self-distill-greedy", "--out", str(tmp_path / "hg"),
                      "--work", str(tmp_path / "we")])
    greedy = torch.load(tmp_path / "we" / "self_distill_greedy.pt")
    assert torch.equal(greedy["tokens"], generate_tokens(target, data["words"][:6], 3.0, SamplingConfig(do_sample=False),
                                                         torch.Generator().manual_seed(0)))
    assert not torch.equal(greedy["tokens"], own["tokens"])
    report = json.loads((tmp_path / "we" / "report.json").read_text())
    assert 0.0 <= report["own_greedy_top1"] <= 1.0 and 0.0 <= report["top1"] <= 1.0
    assert all(0.0 <= report[f"own_greedy_top1_depth{d}"] <= 1.0 for d in (1, 2, 3, 4))
    with pytest.raises(SystemExit):
        train_eagle.main([*common, "--self-distill", "41", "--out", str(tmp_path / "h2"), "--work", str(tmp_path / "w2")])


@pytest.mark.slow
def test_eagle_init_starts_a_later_stage_from_a_trained_head(tmp_path):
    """``train_eagle --init HEAD``: stage 2 of the head starts from stage 1's weights (a zero learning rate
    keeps them); a missing folder is a clear error."""
    from mmspec.models.eagle import EagleHead
    from mmspec.models.recipes import train_eagle

    train_t2i.main([*TINY, "--steps", "2", "--out", str(tmp_path / "target"), "--work", str(tmp_path / "wt")])
    common = ["--target", str(tmp_path / "target"), "--heads", "2", "--train-images", "40", "--batch", "4",
              "--threads", "1"]
    train_eagle.main([*common, "--steps", "2", "--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa")])
    train_eagle.main([*common, "--steps", "1", "--lr", "0", "--seed", "1", "--init", str(tmp_path / "a"),
                      "--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb")])
    first = EagleHead.from_pretrained(tmp_path / "a").state_dict()
    second = EagleHead.from_pretrained(tmp_path / "b").state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    # a later stage with the training-time test (--rollout-steps) trains from the same start
    train_eagle.main([*common, "--steps", "1", "--seed", "1", "--rollout-steps", "3", "--init", str(tmp_path / "a"),
                      "--out", str(tmp_path / "r"), "--work", str(tmp_path / "wr")])
    rolled = EagleHead.from_pretrained(tmp_path / "r").state_dict()
    assert not all(torch.equal(first[k], rolled[k]) for k in first)
    with pytest.raises(SystemExit):
        train_eagle.main([*common, "--rollout-steps", "0", "--out", str(tmp_path / "x"), "--work", str(tmp_path / "wx")])
    with pytest.raises(FileNotFoundError, match="no trained EAGLE head"):
        train_eagle.main([*common, "--steps", "1", "--init", str(tmp_path / "missing"), "--out", str(tmp_path / "c"),
                          "--work", str(tmp_path / "wc")])
    # --device: an explicit --device cpu is the default run; the saved head is a CPU checkpoint either way
    train_eagle.main([*common, "--steps", "2", "--device", "cpu", "--out", str(tmp_path / "d"),
                      "--work", str(tmp_path / "wd")])
    assert all(torch.equal(first[k], v) for k, v in EagleHead.from_pretrained(tmp_path / "d").state_dict().items())
    gpu_run = [*common, "--steps", "2", "--device", "cuda", "--out", str(tmp_path / "g"), "--work", str(tmp_path / "wg")]
    if torch.cuda.is_available():
        train_eagle.main(gpu_run)
        assert all(v.device.type == "cpu" for v in EagleHead.from_pretrained(tmp_path / "g").state_dict().values())
    else:
        with pytest.raises(RuntimeError, match="--device cuda: torch sees no CUDA GPU"):
            train_eagle.main(gpu_run)


@pytest.mark.slow
def test_eagle_guided_features_train_on_the_guided_combination(tmp_path):
    """``train_eagle --guided-features S``: the head's features are h_u + S (h_c - h_u) of the two passes (their
    LM-head logits are the guided logits), the saved config records S, and the flag needs --uncond-prob 0."""
    from mmspec.models.eagle import EagleHead
    from mmspec.models.recipes import train_eagle
    from mmspec.sampling import apply_guidance

    train_t2i.main([*TINY, "--steps", "2", "--out", str(tmp_path / "target"), "--work", str(tmp_path / "wt")])
    target = LlamaGenTransformer.from_pretrained(tmp_path / "target").float().eval()
    data = torch.load(tmp_path / "wt" / "data.pt")
    words, tokens = data["words"][:3], data["tokens"][:3]
    mask = (words >= 0).long()
    with torch.no_grad():
        halves = [target.forward_train(words, tokens, torch.full((3,), drop), condition_mask=mask, return_hidden=True)
                  for drop in (False, True)]
    _, hidden, _ = train_eagle.eagle_batch(target, words, tokens, torch.zeros(3, dtype=torch.bool), guidance=3.0)
    assert torch.allclose(hidden, halves[1][1] + 3.0 * (halves[0][1] - halves[1][1]), atol=1e-5)
    with torch.no_grad():  # logits row k (token k) reads the feature at slot C - 1 + k: the last N slots
        logits = target.get_output_embeddings()(hidden[:, -tokens.shape[1]:])
    assert torch.allclose(logits, apply_guidance(torch.cat([halves[0][0], halves[1][0]]), 3.0), atol=1e-4)
    common = ["--target", str(tmp_path / "target"), "--heads", "2", "--train-images", "40", "--batch", "4",
              "--threads", "1", "--steps", "1", "--guided-features", "3"]
    train_eagle.main([*common, "--uncond-prob", "0", "--out", str(tmp_path / "g"), "--work", str(tmp_path / "wg")])
    assert EagleHead.from_pretrained(tmp_path / "g").config.feature_guidance == 3.0
    with pytest.raises(SystemExit):
        train_eagle.main([*common, "--out", str(tmp_path / "x"), "--work", str(tmp_path / "wx")])


def test_train_eagle_refuses_bad_self_distill_batch(capsys):
    from mmspec.models.recipes.train_eagle import main

    with pytest.raises(SystemExit):
        main(["--target", "unused", "--out", "unused", "--self-distill-batch", "0"])
    assert "--self-distill-batch must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--target", "unused", "--out", "unused", "--data-workers", "0"])
    assert "--data-workers" in capsys.readouterr().err


def test_generate_tokens_guides_with_the_conditional_rows_first_on_the_conditions_device(monkeypatch):
    """``generate_tokens`` runs classifier-free guidance as one doubled batch: the B conditional rows, then the
    same conditions dropped; its drop mask lives on the conditions' device (a CPU mask next to CUDA
    conditions failed in ``train_eagle --self-distill --device cuda``; conditions on the ``meta`` device
    check that here without a GPU)."""
    from mmspec.models.recipes import report_t2i
    from mmspec.sampling import SamplingConfig

    seen = {}

    class Out:
        sequences = torch.zeros(3, 4, dtype=torch.long)

    def fake_generate(target, drafter, input_ids, attention_mask, **kwargs):
        seen.update(kwargs, attention_mask=attention_mask)
        return Out()

    monkeypatch.setattr(report_t2i, "speculative_generate", fake_generate)
    model = LlamaGenTransformer(dim=32, n_layer=1, n_head=2, vocab_size=16, block_size=4)
    words = torch.tensor([[1, 2], [-1, 3], [4, 5]])
    out = report_t2i.generate_tokens(model, words, 3.0, SamplingConfig(do_sample=False), torch.Generator())
    assert torch.equal(out, Out.sequences)
    assert torch.equal(seen["condition_drop"], torch.tensor([False] * 3 + [True] * 3))
    assert seen["condition_drop"].device == words.device
    assert torch.equal(seen["condition_ids"], torch.cat([words, words]))
    assert torch.equal(seen["attention_mask"], (torch.cat([words, words]) >= 0).long())
    report_t2i.generate_tokens(model, words.to("meta"), 3.0, SamplingConfig(do_sample=False), torch.Generator())
    assert seen["condition_drop"].device.type == "meta" and seen["condition_ids"].device.type == "meta"


@pytest.mark.slow
def test_eagle_block_head_grows_from_a_plain_head_and_can_train_its_readout_alone(tmp_path):
    """``train_eagle --num-future K --init PLAIN``: the plain head's layers are copied and the readout starts as
    the identity; ``--freeze-head`` trains only futures 2..K, so the head's own prediction stays the plain one."""
    from mmspec.models.eagle import EagleHead
    from mmspec.models.recipes import train_eagle

    train_t2i.main([*TINY, "--steps", "2", "--out", str(tmp_path / "target"), "--work", str(tmp_path / "wt")])
    common = ["--target", str(tmp_path / "target"), "--heads", "2", "--train-images", "40", "--batch", "4",
              "--threads", "1"]
    train_eagle.main([*common, "--steps", "2", "--out", str(tmp_path / "plain"), "--work", str(tmp_path / "wp")])
    plain = EagleHead.from_pretrained(tmp_path / "plain").state_dict()
    train_eagle.main([*common, "--steps", "1", "--lr", "0", "--seed", "1", "--num-future", "3", "--init",
                      str(tmp_path / "plain"), "--out", str(tmp_path / "grown"), "--work", str(tmp_path / "wg")])
    grown = EagleHead.from_pretrained(tmp_path / "grown")
    assert grown.config.num_future == 3
    assert all(torch.equal(plain[k], v) for k, v in grown.state_dict().items() if not k.startswith("future."))
    assert not grown.future[-1].weight.any() and not grown.future[-1].bias.any()  # the identity start
    train_eagle.main([*common, "--steps", "3", "--seed", "1", "--num-future", "3", "--freeze-head", "--init",
                      str(tmp_path / "plain"), "--out", str(tmp_path / "frozen"), "--work", str(tmp_path / "wf")])
    frozen = EagleHead.from_pretrained(tmp_path / "frozen")
    assert all(torch.equal(plain[k], v) for k, v in frozen.state_dict().items() if not k.startswith("future."))
    offsets = frozen.future[-1].weight.view(3, -1, frozen.future[-1].weight.shape[1])  # [K, d, 4d]
    assert not offsets[0].any() and offsets[1:].any()  # future 1 stays the plain prediction; 2..K learn
    report = json.loads((tmp_path / "wf" / "report.json").read_text())
    assert {"own_greedy_top1_future1", "own_greedy_top1_future3"} <= set(report)
    for bad in (["--freeze-head"], ["--num-future", "2", "--freeze-head"], ["--num-future", "0"],
                ["--num-future", "2", "--rollout-steps", "2"]):
        with pytest.raises(SystemExit):
            train_eagle.main([*common, *bad, "--out", str(tmp_path / "x"), "--work", str(tmp_path / "wx")])


MULO_TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--train-images", "40", "--batch", "4", "--threads", "1",
             "--drafter-steps", "2", "--upsampler-steps", "2"]


def _mulo_weights(folder) -> dict[str, torch.Tensor]:
    from mmspec.models.mulo import TokenUpsampler

    drafter = LlamaGenTransformer.from_pretrained(folder / "mulo_drafter").state_dict()
    upsampler = TokenUpsampler.from_pretrained(folder / "mulo_upsampler").state_dict()
    return {**{f"d.{k}": v for k, v in drafter.items()}, **{f"u.{k}": v for k, v in upsampler.items()}}


def test_train_mulo_trains_both_parts_on_the_low_res_images_and_a_later_stage_starts_from_them(tmp_path):
    """``train_mulo``: the drafter learns the low-res tokens (``downsample_tokens`` of the rendered images), both
    parts are saved in fp16 under the pipeline folder; ``--init`` starts a later stage from a trained pair (a
    zero learning rate keeps it), and a missing pair is a clear error."""
    from safetensors.torch import load_file

    from mmspec.models.mulo import TokenUpsampler, downsample_tokens
    from mmspec.models.recipes import train_mulo
    from mmspec.models.recipes.common import DEFAULT_VQ
    from mmspec.models.tokenizers import VQTokenizer

    train_mulo.main([*MULO_TINY, "--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa")])
    data = torch.load(tmp_path / "wa" / "data.pt")
    vq = VQTokenizer.from_pretrained(DEFAULT_VQ)
    assert torch.equal(data["low_tokens"], downsample_tokens(vq, data["tokens"].view(-1, 8, 8), 2).flatten(1))
    first = _mulo_weights(tmp_path / "a")
    for part in ("mulo_drafter", "mulo_upsampler"):  # bundled in half precision
        saved = load_file(tmp_path / "a" / part / "diffusion_pytorch_model.safetensors")
        assert all(v.dtype == torch.float16 for v in saved.values() if v.is_floating_point())
    train_mulo.main([*MULO_TINY, "--lr", "0", "--seed", "1", "--init", str(tmp_path / "a"), "--out", str(tmp_path / "b"),
                     "--work", str(tmp_path / "wb")])
    second = _mulo_weights(tmp_path / "b")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    train_mulo.main([*MULO_TINY, "--lr", "0", "--seed", "1", "--out", str(tmp_path / "c"), "--work", str(tmp_path / "wc")])
    fresh = _mulo_weights(tmp_path / "c")
    assert not all(torch.equal(first[k], fresh[k]) for k in first)
    with pytest.raises(FileNotFoundError, match="no trained MuLo drafter"):
        train_mulo.main([*MULO_TINY, "--init", str(tmp_path / "missing"), "--out", str(tmp_path / "d"),
                         "--work", str(tmp_path / "wd")])
    # --high-res-context: an up-sampler that reads the final rows above each block (another architecture)
    train_mulo.main([*MULO_TINY, "--part", "upsampler", "--high-res-context", "--out", str(tmp_path / "e"),
                     "--work", str(tmp_path / "we")])
    assert TokenUpsampler.from_pretrained(tmp_path / "e" / "mulo_upsampler").config.high_res_context
    with pytest.raises(ValueError, match="another architecture"):
        train_mulo.main([*MULO_TINY, "--part", "upsampler", "--high-res-context", "--init", str(tmp_path / "a"),
                         "--out", str(tmp_path / "f"), "--work", str(tmp_path / "wf")])


def test_train_mulo_self_distillation_adds_the_targets_own_samples_to_both_parts(tmp_path, monkeypatch):
    """``train_mulo --self-distill N --target T``: N extra rows of the target's own guided temperature-1 samples
    for the first N training captions (cached), with their low-res tokens, in the training sets of the drafter
    and the up-sampler; without ``--target`` or with more rows than captions it refuses."""
    from mmspec.models.recipes import train_mulo
    from mmspec.models.recipes.report_t2i import generate_tokens
    from mmspec.sampling import SamplingConfig

    train_t2i.main([*TINY, "--steps", "2", "--out", str(tmp_path / "target"), "--work", str(tmp_path / "wt")])
    sizes = []
    real_loop = train_mulo.train_loop

    def counting_loop(model, loss_fn, num_items, **kwargs):
        sizes.append(num_items)
        return real_loop(model, loss_fn, num_items, **kwargs)

    monkeypatch.setattr(train_mulo, "train_loop", counting_loop)
    train_mulo.main([*MULO_TINY, "--target", str(tmp_path / "target"), "--self-distill", "6",
                     "--out", str(tmp_path / "m"), "--work", str(tmp_path / "wm")])
    own = torch.load(tmp_path / "wm" / "self_distill.pt")
    data = torch.load(tmp_path / "wm" / "data.pt")
    target = LlamaGenTransformer.from_pretrained(tmp_path / "target").float().eval()
    expected = generate_tokens(target, data["words"][:6], 3.0, SamplingConfig(), torch.Generator().manual_seed(0))
    assert torch.equal(own["words"], data["words"][:6]) and torch.equal(own["tokens"], expected)
    assert not torch.equal(own["tokens"], data["tokens"][:6])
    assert sizes == [46, 46]  # 40 rendered + 6 own rows, for the drafter and for the up-sampler
    with pytest.raises(SystemExit):
        train_mulo.main([*MULO_TINY, "--self-distill", "6", "--out", str(tmp_path / "x"), "--work", str(tmp_path / "wx")])
    with pytest.raises(SystemExit):
        train_mulo.main([*MULO_TINY, "--target", str(tmp_path / "target"), "--self-distill", "41",
                         "--out", str(tmp_path / "y"), "--work", str(tmp_path / "wy")])
