"""mmspec.neighbors.nearest_neighbors: the codebook neighbourhoods every tokenizer's LANTERN table comes from."""

import pytest
import torch

from mmspec.neighbors import nearest_neighbors


def brute_force(embeddings: torch.Tensor, k: int) -> torch.Tensor:
    """Full stable sort of exact distances: nearest first, equal distances by index."""
    d2 = torch.cdist(embeddings.double(), embeddings.double()).pow(2)
    d2.fill_diagonal_(float("inf"))
    return torch.sort(d2, dim=-1, stable=True).indices[:, :k]


@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_matches_brute_force_with_many_ties(chunk):
    # small integer coordinates: squared distances are exact in float64 and tie often, also at the k-th place
    points = torch.randint(-2, 3, (60, 3), generator=torch.Generator().manual_seed(0)).float()
    for k in (1, 4, 11, 59):
        assert torch.equal(nearest_neighbors(points, k, chunk=chunk), brute_force(points, k)), k


def test_tie_at_the_kth_place_keeps_the_lower_index():
    # row 0 at the origin, rows 1..6 on the unit axes: all at distance 1 from row 0
    points = torch.cat([torch.zeros(1, 3), torch.eye(3), -torch.eye(3)])
    assert nearest_neighbors(points, 2)[0].tolist() == [1, 2]
    assert nearest_neighbors(points.flip(0), 2)[-1].tolist() == [0, 1]  # origin last: the lowest indices win


def test_random_codebook_excludes_itself_and_orders_by_distance():
    points = torch.randn(300, 8, generator=torch.Generator().manual_seed(1))
    table = nearest_neighbors(points, 16, chunk=64)
    assert table.shape == (300, 16) and table.dtype == torch.long
    assert not (table == torch.arange(300)[:, None]).any()
    assert torch.equal(table, brute_force(points, 16))


@pytest.mark.parametrize("bad", [0, 5, 2.5, True])
def test_bad_k(bad):
    with pytest.raises(ValueError, match="k must be an integer in \\[1, 4\\]"):
        nearest_neighbors(torch.randn(5, 2), bad)


def test_bad_embeddings_and_chunk():
    with pytest.raises(ValueError, match="float tensor \\[V, D\\]"):
        nearest_neighbors(torch.randn(5), 1)
    with pytest.raises(ValueError, match="float tensor"):
        nearest_neighbors(torch.arange(10).reshape(5, 2), 1)
    with pytest.raises(ValueError, match="chunk must be"):
        nearest_neighbors(torch.randn(5, 2), 1, chunk=0)
