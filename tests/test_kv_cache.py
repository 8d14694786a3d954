"""Cropping / keeping cache slots then decoding equals recomputing from scratch."""

from __future__ import annotations

import torch


def logits_from_scratch(target, ids: list[int]) -> torch.Tensor:
    cache = target.new_cache()
    return target.forward(torch.tensor([ids]), cache).logits[0, -1]


def test_crop_then_decode_equals_recompute(tiny_target):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (30,), generator=g).tolist()
    cache = tiny_target.new_cache()
    tiny_target.forward(torch.tensor([ids]), cache)
    cache.crop(17)
    assert cache.length == 17
    got = tiny_target.forward(torch.tensor([[ids[17]]]), cache).logits[0, -1]
    torch.testing.assert_close(got, logits_from_scratch(tiny_target, ids[:18]), atol=1e-4, rtol=1e-4)


def test_keep_subset_then_decode_equals_recompute(tiny_target):
    """Keep a non-contiguous set of new slots (a tree's accepted path), then decode."""
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 300, (12,), generator=g).tolist()
    extra = torch.randint(3, 300, (6,), generator=g).tolist()
    cache = tiny_target.new_cache()
    tiny_target.forward(torch.tensor([prefix]), cache)
    # Feed the 6 extra tokens as a tree: node 0 root-child, 1 child of 0, 2 sibling of 0, 3 child of 1 ...
    parents = [-1, 0, -1, 1, 2, 3]
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    positions = torch.tensor([[len(prefix) - 1 + d for d in depth]])
    tiny_target.forward(torch.tensor([extra]), cache, positions=positions, tree_mask=mask)
    path = [0, 1, 3, 5]  # a root-to-leaf path
    cache.commit(len(prefix), len(prefix) + torch.tensor(path))
    assert cache.length == len(prefix) + len(path)
    committed = prefix + [extra[i] for i in path]
    nxt = 7
    got = tiny_target.forward(torch.tensor([[nxt]]), cache).logits[0, -1]
    torch.testing.assert_close(got, logits_from_scratch(tiny_target, [*committed, nxt]), atol=1e-4, rtol=1e-4)
