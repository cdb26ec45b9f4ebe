"""Loss aggregation modes: hand-computed values, weighting invariances, empty masks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrl.algo import aggregate, get_aggregation, known_aggregations

# 100 marks positions outside the mask: they must never count.
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [5.0, 6.0, 100.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
GROUPS = torch.tensor([7, 7, 42])


def test_known_modes_and_unknown_mode_error():
    assert known_aggregations() == ["prompt", "sample", "token"]
    with pytest.raises(KeyError, match="prompt, sample, token"):
        get_aggregation("seq-mean-token-sum")


def test_token_mode():
    # (1 + 2 + 3 + 4 + 5 + 6) / 6 tokens = 3.5
    assert aggregate(LOSS, MASK, "token").item() == pytest.approx(3.5)


def test_sample_mode():
    # per-sample token means 6/3 = 2, 4/1 = 4, 11/2 = 5.5; their mean = 11.5 / 3
    assert aggregate(LOSS, MASK, "sample").item() == pytest.approx(11.5 / 3)


def test_prompt_mode():
    # group 7: (6 + 4) / (3 + 1) = 2.5; group 42: 11 / 2 = 5.5; mean over groups = 4.0
    assert aggregate(LOSS, MASK, "prompt", GROUPS).item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="group_ids"):
        aggregate(LOSS, MASK, "prompt")


def test_empty_samples_and_groups_are_left_out():
    loss = torch.cat([LOSS, torch.full((2, 4), 9.0)])
    mask = torch.cat([MASK, torch.zeros(2, 4)])
    groups = torch.tensor([7, 7, 42, 42, -3])  # a masked sample in group 42, group -3 empty
    assert aggregate(loss, mask, "token").item() == pytest.approx(3.5)
    assert aggregate(loss, mask, "sample").item() == pytest.approx(11.5 / 3)
    assert aggregate(loss, mask, "prompt", groups).item() == pytest.approx(4.0)


@pytest.mark.parametrize("mode", ["token", "sample", "prompt"])
def test_all_zero_mask_gives_zero_and_finite_gradient(mode):
    loss = torch.ones(3, 4, requires_grad=True)
    total = aggregate(loss, torch.zeros(3, 4), mode, torch.tensor([1, 1, 2]))
    assert total.item() == 0.0
    total.backward()
    assert (loss.grad == 0).all()


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_prompt_mode_weighs_groups_equally_whatever_their_lengths(data):
    num_groups = data.draw(st.integers(1, 5))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=num_groups, max_size=num_groups))
    values = data.draw(st.lists(st.floats(-10, 10), min_size=num_groups, max_size=num_groups))
    rows, masks, ids = [], [], []
    for g, (size, value) in enumerate(zip(sizes, values, strict=True)):
        for _ in range(size):
            length = data.draw(st.integers(1, 8))
            rows.append(torch.full((8,), value, dtype=torch.float64))
            masks.append((torch.arange(8) < length).double())
            ids.append(1000 * g - 17)  # arbitrary, non-contiguous ids
    loss, mask = torch.stack(rows), torch.stack(masks)
    # every token of group g carries value_g: each group's mean is value_g, whatever its
    # sample count or response lengths, so the result is the plain mean of the values
    result = aggregate(loss, mask, "prompt", torch.tensor(ids))
    assert result.item() == pytest.approx(sum(values) / num_groups, abs=1e-9)


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.floats(-10, 10), min_size=1, max_size=24), seed=st.integers(0, 99))
def test_token_mode_weighs_tokens_equally_whatever_their_rows(values, seed):
    # spread the same tokens over rows of random lengths: the token mean never changes
    n = len(values)
    gen = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, n + 1, (1,), generator=gen))
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: rows - 1].add(1).tolist())
    bounds = [0, *cuts, n]
    loss, mask = torch.zeros(rows, n, dtype=torch.float64), torch.zeros(rows, n)
    for r in range(rows):
        chunk = values[bounds[r] : bounds[r + 1]]
        loss[r, : len(chunk)] = torch.tensor(chunk, dtype=torch.float64)
        mask[r, : len(chunk)] = 1.0
    result = aggregate(loss, mask, "token")
    assert result.item() == pytest.approx(sum(values) / n, abs=1e-9)
