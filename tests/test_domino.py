"""Domino: training and inference compute the same residuals; chain and tree are lossless."""

from __future__ import annotations

import pytest
import torch
from lossless import SAMPLING_ALPHA, greedy_outputs_match, sampling_pvalue
from tiny import make_dflash, make_target

from byblock import SamplingParams
from byblock.drafters.ddtree import build_tree, build_tree_lazy
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.dflash_format import save_dflash
from byblock.drafters.domino import DominoConfig, DominoDrafter, DominoHead, load_domino, save_domino
from byblock.errors import ByblockError


def make_head(hidden: int, vocab: int, seed: int = 0, zero: bool = False) -> DominoHead:
    torch.manual_seed(seed)
    head = DominoHead(DominoConfig(hidden, vocab, gru_hidden_dim=32, emb_dim=16))
    if not zero:
        torch.nn.init.normal_(head.proj_out.weight, std=0.5)
    return head.eval()


def test_teacher_forced_block_equals_step_by_step():
    head = make_head(24, 50)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 24, generator=g)  # positions 1..5
    prefix = torch.randn(3, 5, 24, generator=g)  # tokens at 0..4
    block = head(h, prefix)
    state = None
    for k in range(5):
        res, state = head.step(h[:, k], prefix[:, k], state)
        want = torch.zeros_like(res) if k < head.config.pure_draft_prefix_len else res
        torch.testing.assert_close(block[:, k], want, rtol=1e-5, atol=1e-5)


def test_lazy_tree_equals_static_tree_when_position_only():
    g = torch.Generator().manual_seed(1)
    logp = torch.log_softmax(torch.randn(5, 7, generator=g), -1)
    for budget in (1, 5, 17, 40):
        assert build_tree_lazy(lambda n, p, t, d: logp[d], 5, budget) == build_tree(logp, budget)


def test_zero_head_drafts_exactly_like_dflash(tiny_targets):
    target = tiny_targets["llama"]
    dflash = DFlashDrafter(make_dflash(target, block=6), target)
    domino = DominoDrafter(DFlashDrafter(make_dflash(target, block=6), target), make_head(64, 320, zero=True))
    prompt = [5, 17, 33, 9]
    hidden = target.forward(torch.tensor([prompt]), target.new_cache(), hidden_layers=dflash.hidden_layers).hidden
    for d in (dflash, domino):
        d.start(prompt, hidden, SamplingParams(), None)
    assert dflash.propose([*prompt, 40], 5).tokens.tolist() == domino.propose([*prompt, 40], 5).tokens.tolist()


@pytest.mark.parametrize("tree_budget", [0, 12])
def test_domino_greedy_is_lossless(tiny_target, tree_budget):
    dflash = DFlashDrafter(make_dflash(tiny_target, block=6), tiny_target, draft_vocab=torch.arange(0, 320, 2))
    drafter = DominoDrafter(dflash, make_head(tiny_target.hidden_size, 160), tree_budget=tree_budget)
    for prompt in ([5, 17, 33, 9], [7, 7, 7, 7, 7, 7, 12, 40]):
        greedy_outputs_match(tiny_target, prompt, SamplingParams(max_new_tokens=40), drafter)


@pytest.mark.parametrize("tree_budget", [0, 6])
def test_domino_sampling_matches_target_distribution(tree_budget):
    target = make_target("llama")
    params = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=4)
    prompt = [5, 17, 33, 9, 5, 17]
    drafter = DominoDrafter(DFlashDrafter(make_dflash(target, block=4), target), make_head(64, 320), tree_budget)
    assert sampling_pvalue(target, drafter, prompt, params) > SAMPLING_ALPHA


def test_head_saved_beside_dflash_weights(tmp_path, tiny_targets):
    target = tiny_targets["llama"]
    save_dflash(make_dflash(target), tmp_path / "ck")
    with pytest.raises(ByblockError, match="no Domino head"):
        load_domino(tmp_path / "ck", 64)
    head = make_head(64, 320)
    save_domino(head, tmp_path / "ck")
    loaded = load_domino(tmp_path / "ck", 64)
    for (k, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=k)
