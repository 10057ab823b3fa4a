"""Pipelines decode under ``torch.inference_mode`` (mmspec/inference_mode.py) without leaking inference tensors.

What is shown: outputs come back as ordinary tensors (editable in place, usable by autograd), nested output
containers are converted and ordinary tensors pass through untouched; state a call caches for later
(LANTERN's codebook-neighbour table) is built from ordinary tensors; a model trains on its own generated
tokens right after a call; and the decorated bodies really run in inference mode.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field

import pytest
import torch

from mmspec.inference_mode import as_ordinary_tensors, inference_call, outside_inference_mode

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class _Frozen:
    values: torch.Tensor


@dataclass
class _Output:
    tokens: torch.Tensor
    extras: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def test_as_ordinary_tensors_converts_nested_containers_and_keeps_ordinary_tensors():
    ordinary = torch.arange(3)
    pair = namedtuple("pair", "a b")
    with torch.inference_mode():
        made = [torch.ones(2) for _ in range(5)]
    out = _Output(made[0], [made[1], (made[2], ordinary)], {"x": made[3], "p": pair(made[4], ordinary)})
    with torch.inference_mode():
        frozen = _Frozen(torch.zeros(1))
    assert not as_ordinary_tensors(frozen).values.is_inference()
    converted = as_ordinary_tensors(out)
    assert converted is out
    leaves = [out.tokens, out.extras[0], out.extras[1][0], out.stats["x"], out.stats["p"].a]
    assert not any(t.is_inference() for t in leaves)
    assert isinstance(out.stats["p"], pair)
    assert out.extras[1][1] is ordinary and out.stats["p"].b is ordinary  # no needless copies
    out.tokens.add_(1)  # in place outside inference mode: refused for inference tensors
    assert out.tokens.tolist() == [2.0, 2.0]


def test_inference_call_runs_the_body_in_inference_mode_and_returns_ordinary_tensors():
    seen = {}

    @inference_call
    def body(x: torch.Tensor) -> _Output:
        seen["inference"], seen["grad"] = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        return _Output(x * 2)

    weight = torch.ones(2, requires_grad=True)
    out = body(torch.ones(2))
    assert seen == {"inference": True, "grad": False}
    assert not out.tokens.is_inference()
    (out.tokens * weight).sum().backward()  # autograd may save an output: refused for inference tensors
    assert weight.grad.tolist() == [2.0, 2.0]
    assert body.__name__ == "body"


def test_outside_inference_mode_builds_ordinary_tensors_without_gradients():
    with torch.inference_mode():
        with outside_inference_mode():
            assert not torch.is_grad_enabled()
            made = torch.ones(2)
        assert torch.is_inference_mode_enabled()
    assert not made.is_inference()


def test_ar_image_pipeline_outputs_and_cached_neighbours_are_ordinary():
    from tiny_shapes_pipeline import tiny_shapes_pipeline

    pipe = tiny_shapes_pipeline()
    from mmspec.methods.eagle import LanternConfig

    out = pipe("a red circle", method=LanternConfig(k=4, delta=0.1, num_draft_tokens=3), do_sample=True,
               output_type="pt", generator=torch.Generator().manual_seed(0))
    assert not any(t.is_inference() for t in (out.images, out.tokens, out.drafted))
    assert out["tokens"] is out.tokens and not out.to_tuple()[1].is_inference()  # BaseOutput's dict view too
    out.tokens[0, 0] = 0  # editable in place
    assert not pipe.codebook_neighbors(4).is_inference()


def test_continuous_pipeline_outputs_train_the_same_model():
    from test_continuous_pipeline import make_pipe, run, tiny_mar

    from mmspec.models.recipes.mar_loss import mar_loss

    pipe = make_pipe(tiny_mar(1, depth=1))
    out = run(pipe, num_iter=4)
    assert not out.tokens.is_inference() and not out.drafted.is_inference()
    model = pipe.transformer.train()
    loss = mar_loss(model, out.tokens.flatten(1, 2), torch.tensor([1, 3, 4]),
                    generator=torch.Generator().manual_seed(0))
    loss.backward()  # the generated tokens and the model's state after a call both serve autograd
    assert all(p.grad is not None for p in model.head.parameters())
