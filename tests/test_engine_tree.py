"""Tree verification in the engine: best-first draft trees (tree.py), and generation that verifies
trees instead of chains, lossless (greedy = plain greedy, seeded sampled = seeded plain sampled),
with the target's cache and the drafter's context kept along the committed path only."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from sglang_dflash.control.tree import (
    DEFAULT_TREE_BUDGET,
    MAX_TREE_BUDGET,
    MAX_TREE_TOPK,
    DraftTrees,
    build_trees,
    chain_accept_lens,
    chain_depths,
    default_tree_budget,
    most_tree_nodes,
)
from sglang_dflash.engine import DFlashDrafter, Generator, SamplingParams
from sglang_dflash.engine.drafters import NoDrafter
from sglang_dflash.engine.target import MAX_DEAD_COLUMNS
from tests.dflash_testlib import STOP_TOKEN, TINY_VOCAB, CandidateOracle, hf_greedy, random_draft, tiny_target

PROMPTS = [[3, 4, 5], list(range(10, 30)), [50, 60, 70, 80, 90, 11, 12], [5]]
MAX_NEW = 24


def random_choices(bs, depth, k, seed):
    g = torch.Generator().manual_seed(seed)
    candidates = torch.randint(0, 1000, (bs, depth, k), generator=g)
    scores = -torch.rand(bs, depth, k, generator=g).mul(4).cumsum(-1)  # log-probabilities, decreasing
    return torch.randint(0, 1000, (bs,), generator=g), candidates, scores


def brute_force_best(scores, budget):
    """The `budget` best (depth, ranks) paths of one request by exhaustive enumeration."""
    depth_limit, k = scores.shape
    paths = [ranks for d in range(1, depth_limit + 1) for ranks in itertools.product(range(k), repeat=d)]
    score = {p: sum(float(scores[i, r]) for i, r in enumerate(p)) for p in paths}
    return set(sorted(paths, key=lambda p: (-score[p], sum(p)))[:budget])


@pytest.mark.parametrize("depth,k", [(1, 1), (1, 4), (3, 1), (3, 3), (5, 2), (4, 4)])
def test_trees_are_the_best_paths_and_hold_the_chain(depth, k):
    budgets = [1, 7, 30]
    anchors, candidates, scores = random_choices(len(budgets), depth, k, seed=depth * 10 + k)
    trees = build_trees(anchors, candidates, scores, budgets)
    n = max(trees.sizes)  # padded to the largest tree, not the largest budget
    assert trees.tokens.shape == trees.parents.shape == trees.depths.shape == (3, n)
    for b, budget in enumerate(budgets):
        size = trees.sizes[b]
        assert size == 1 + min(budget, sum(k ** d for d in range(1, depth + 1)))
        assert int(trees.tokens[b, 0]) == int(anchors[b]) and int(trees.parents[b, 0]) == -1
        assert (trees.parents[b, size:] == -1).all() and (trees.depths[b, size:] == 0).all()
        ranks = {0: ()}  # node -> the ranks of its path
        for i in range(1, size):
            parent, d = int(trees.parents[b, i]), int(trees.depths[b, i])
            assert 0 <= parent < i and d == int(trees.depths[b, parent]) + 1 <= depth
            rank = next(r for r in range(k) if int(candidates[b, d - 1, r]) == int(trees.tokens[b, i])
                        and ranks[parent] + (r,) not in ranks.values())
            ranks[i] = ranks[parent] + (rank,)
        assert set(ranks.values()) - {()} == brute_force_best(scores[b], budget)
        path_scores = [sum(float(scores[b, j, r]) for j, r in enumerate(p)) for p in ranks.values()]
        assert path_scores == sorted(path_scores, reverse=True), "nodes come best first"
        deepest = max(len(p) for p in ranks.values())
        assert all((0,) * d in ranks.values() for d in range(1, deepest + 1)), "the chain to the tree's depth"


@pytest.mark.parametrize("depth,k", [(1, 1), (1, 4), (2, 3), (4, 4), (5, 2)])
def test_most_tree_nodes_is_what_an_unbounded_tree_grows_to(depth, k):
    anchors, candidates, scores = random_choices(2, depth, k, seed=depth * 7 + k)
    trees = build_trees(anchors, candidates, scores, [1000, 1000])
    assert trees.sizes == [most_tree_nodes(depth + 1, k) + 1] * 2  # + the root


def test_the_default_budget_is_cut_to_what_the_trees_hold():
    assert DEFAULT_TREE_BUDGET == 15
    assert default_tree_budget(most_tree_nodes(8, 4)) == 15  # the shipped drafter's B 8, top 4
    assert default_tree_budget(most_tree_nodes(2, 4)) == 4  # one position: its 4 choices
    assert default_tree_budget(8 - 1) == 7  # the served worker: B - 1 drafted rows
    assert default_tree_budget(most_tree_nodes(2, 1)) == default_tree_budget(1) == 0  # the chain of 2
    assert default_tree_budget(most_tree_nodes(1, 4)) == 0  # B 1: no drafted position


@pytest.mark.parametrize("min_prob", [0.15, 0.3, 0.999])
def test_trees_stop_at_the_least_path_probability(min_prob):
    """A tree holds, of the nodes its budget allows, those whose path probability is at least
    min_prob, and always its first node: the first nodes of the tree grown without the bound,
    padded to the largest tree."""
    budgets = [2, 9, 40]
    anchors, candidates, scores = random_choices(len(budgets), 4, 3, seed=11)
    scores = scores / 4  # first choices of probability 0.37-1
    full = build_trees(anchors, candidates, scores, budgets)
    trees = build_trees(anchors, candidates, scores, budgets, min_prob)
    assert trees.tokens.shape[1] == max(trees.sizes) and trees.known_ancestors.shape[1:] == (max(trees.sizes),) * 2
    for b, budget in enumerate(budgets):
        likely = [p for p in brute_force_best(scores[b], budget)
                  if sum(float(scores[b, d, r]) for d, r in enumerate(p)) >= math.log(min_prob)]
        size = trees.sizes[b]
        assert size == 1 + max(len(likely), 1)
        for field in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(trees, field)[b, :size], getattr(full, field)[b, :size]), field
        assert torch.equal(trees.ancestors()[b, :size, :size], full.ancestors()[b, :size, :size])
    if min_prob < 0.5:
        assert trees.sizes[0] == full.sizes[0] and max(trees.sizes) < max(full.sizes), "cut the large trees only"
    else:
        assert trees.sizes == [2, 2, 2], "the first node stays"


def test_chain_accept_lens_follow_the_chain_inside_the_tree():
    """The chain's node at each depth is the first one added there (nodes 1, 3, 6 below); its
    accepted drafts are the committed path's prefix along it, whatever the path does after."""
    #   0 -+- 1 -+- 3 --- 6        depth 1: 1 (chain), 2; depth 2: 3 (chain), 4, 5; depth 3: 6
    #      |     +- 5
    #      +- 2 --- 4
    parents = torch.tensor([[-1, 0, 0, 1, 2, 1, 3]] * 5)
    depths = torch.tensor([[0, 1, 1, 2, 2, 2, 3]] * 5)
    trees = DraftTrees(torch.arange(7).repeat(5, 1), parents, depths, [7] * 5)
    path = torch.tensor([[0, 1, 3, 6], [0, 1, 5, 5], [0, 2, 4, 4], [0, 1, 3, 3], [0, 0, 0, 0]])
    assert chain_accept_lens(trees, path, [3, 2, 2, 2, 0]) == [3, 1, 0, 2, 0]
    assert chain_depths(trees) == [3] * 5
    shallow = DraftTrees(torch.arange(7).repeat(2, 1), parents[:2], depths[:2], [3, 1])  # nodes 0-2; the root alone
    assert chain_depths(shallow) == [1, 0]


def test_ancestors_are_the_paths_to_the_root():
    anchors, candidates, scores = random_choices(2, 4, 3, seed=5)
    trees = build_trees(anchors, candidates, scores, [9, 20])
    seen = trees.ancestors()
    for b in range(2):
        for i in range(trees.tokens.shape[1]):
            expected, node = set(), i
            while node >= 0:
                expected.add(node)
                node = int(trees.parents[b, node]) if node < trees.sizes[b] else -1
            assert set(torch.nonzero(seen[b, i])[:, 0].tolist()) == expected


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request):
    target = tiny_target(request.param)
    return target, [hf_greedy(target, p, MAX_NEW, STOP_TOKEN) for p in PROMPTS]


def check_steps(result, max_depth):
    assert all(1 <= len(s) <= max_depth + 1 for s in result.steps)
    assert [t for s in result.steps for t in s] == result.output_ids[1:]
    assert len(result.trees) == len(result.steps)
    for tree, step in zip(result.trees, result.steps, strict=True):
        assert tree["path"][0] == 0 and len(tree["path"]) >= len(step)  # a stop / max cut may drop commits
        assert tree["path"] == sorted(tree["path"]) and tree["nodes"] > tree["path"][-1]


@pytest.mark.parametrize("budget,topk,min_prob", [(1, 1, 0.03), (5, 3, 0), (16, 4, 0.03), (40, 2, 0), (40, 3, 0.1)])
@pytest.mark.parametrize("batch", ["bs1", "bs4"])
def test_greedy_tree_generation_equals_plain_greedy(tiny, budget, topk, min_prob, batch):
    target, refs = tiny
    prompts, refs = (PROMPTS[1:2], refs[1:2]) if batch == "bs1" else (PROMPTS, refs)
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,))
    oracle = CandidateOracle(random_draft(target), target, [p + r for p, r in zip(prompts, refs, strict=True)],
                             seed=budget)
    runs = {}
    for name, drafter in (("oracle", oracle), ("drafter", DFlashDrafter(random_draft(target), target))):
        runs[name] = Generator(target, drafter, 8, tree_budget=budget, tree_topk=topk,
                               tree_min_prob=min_prob).generate(prompts, params)
        for result, ref in zip(runs[name], refs, strict=True):
            assert result.output_ids == ref
            check_steps(result, 7)
    paths = [t["path"] for r in runs["oracle"] for t in r.trees]
    if budget > 1:  # else the tests below could pass without a tree
        assert max(len(p) for p in paths) >= 3, "the oracle's trees must accept paths of several nodes"
    if topk > 1:
        assert any(p != list(range(len(p))) for p in paths), \
            "some accepted path must skip nodes (else masking the skipped ones out is untested)"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_target_trees_and_chains_equal_its_plain_decoding(arch):
    """A bf16 target (skinny_linear on AMX tiles where the CPU has them): every verified row is bit
    for bit what plain decoding computes, so greedy trees and chains and seeded sampled trees give
    plain bf16 decoding's output exactly, though bf16 logits have near-ties aplenty."""
    target = tiny_target(arch)
    target.model.to(torch.bfloat16)
    plain = Generator(target, NoDrafter(), 1)
    for params in (SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,)),
                   SamplingParams(temperature=1.0, seed=3, max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,))):
        refs = [r.output_ids for r in plain.generate(PROMPTS, params)]
        continuations = [p + r for p, r in zip(PROMPTS, refs, strict=True)]
        for budget in (0, 8):
            oracle = CandidateOracle(random_draft(target).to(torch.bfloat16), target, continuations, seed=budget)
            results = Generator(target, oracle, 6, tree_budget=budget).generate(PROMPTS, params)
            assert [r.output_ids for r in results] == refs, (params.temperature, budget)
            if budget:  # the oracle serves trees (a chain takes the random drafter's proposals)
                assert max(len(s) for r in results for s in r.steps) >= 3, "paths of several nodes"


@pytest.mark.parametrize("bs", [1, 2])
def test_accepted_paths_move_into_place_and_the_rest_is_dropped(tiny, bs):
    """commit_nodes moves each row's accepted path to the first columns of its block (move_slots)
    and drops the rest: at batch size 1 at once (no masked-out column ever), in a batch whose rows
    accept different lengths as masked-out columns until MAX_DEAD_COLUMNS pile up and one compaction
    drops them. The target's next logits must be those of a plain forward over the committed tokens
    all along, so every moved K/V must sit at its column with its position's RoPE."""
    target, _ = tiny
    target.set_taps(())
    g = torch.Generator().manual_seed(4)
    committed = [list(p) for p in PROMPTS[1:1 + bs]]
    target.prefill(committed)
    # Root, a chain of 3 and siblings. Row 0 accepts 0 -> 2 -> 5 (skipping 1, 3, 4 and 6: nodes 2 and
    # 5 move), row 1 accepts 0 -> 1 (in place).
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 5]]).expand(bs, -1)
    depths = torch.tensor([[0, 1, 1, 2, 2, 2, 3]]).expand(bs, -1)
    ancestors = DraftTrees(parents, parents, depths, [7] * bs).ancestors()
    path = torch.tensor([[0, 2, 5, 5, 5, 5, 5], [0, 1, 1, 1, 1, 1, 1]])[:bs]
    accept_len = torch.tensor([2, 1])[:bs]
    starts = torch.tensor([len(c) for c in committed])[:, None]
    dead = []
    for _ in range(2 * MAX_DEAD_COLUMNS // 4):
        tokens = torch.randint(2, TINY_VOCAB, (bs, 7), generator=g)
        logits, _ = target.verify_tree(tokens, starts + depths, ancestors, parents)
        for b in range(bs):
            expected = target.model(torch.tensor([committed[b] + tokens[b, :1].tolist()])).logits[0, -1]
            torch.testing.assert_close(logits[b * 7], expected, atol=2e-4, rtol=1e-4)
        target.commit_nodes(path, accept_len)
        for b in range(bs):
            committed[b] += tokens[b, path[b, :int(accept_len[b]) + 1]].tolist()
        starts = starts + accept_len[:, None] + 1
        dead.append(target._valid.shape[1] - int(target._valid.sum(1).max()))  # what compaction checks
    if bs == 1:
        assert dead == [0] * len(dead)
    else:  # holes pile up, then a compaction
        assert max(dead) < MAX_DEAD_COLUMNS + 7 and max(dead) >= MAX_DEAD_COLUMNS // 2 and 0 in dead[1:], dead


def test_the_drafter_gets_the_committed_paths_context(tiny):
    """The tapped states each commit hands the drafter must be those of a plain forward over the
    committed text at the same positions: the tree's off-path nodes neither reach the drafter
    nor stay in the target's cache (a wrong cache column would change later taps)."""
    target, refs = tiny
    drafter = CandidateOracle(random_draft(target), target, [p + r for p, r in zip(PROMPTS, refs, strict=True)])
    results = Generator(target, drafter, 6, tree_budget=12, tree_topk=3).generate(
        PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,)))
    target.set_taps(drafter.layer_ids)
    for r, (prompt, result) in enumerate(zip(PROMPTS, results, strict=True)):
        with torch.no_grad():
            target.model(torch.tensor([prompt + result.output_ids]))
        full = target.take_taps()[0]
        got = torch.cat(drafter.committed[r])
        start = len(prompt)  # the first step's root is the prefill token at position len(prompt)
        torch.testing.assert_close(got, full[start:start + got.shape[0]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 1.0), (1.3, 5, 0.9)])
def test_seeded_sampled_tree_output_equals_seeded_plain_output(tiny, temperature, top_k, top_p):
    target, _ = tiny
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=7, max_new_tokens=MAX_NEW,
                            stop_token_ids=(STOP_TOKEN,))
    plain = Generator(target, NoDrafter(), 1).generate(PROMPTS, params)
    references = [p + r.output_ids for p, r in zip(PROMPTS, plain, strict=True)]
    for drafter in (CandidateOracle(random_draft(target), target, references, seed=3),
                    DFlashDrafter(random_draft(target), target)):
        # The least path probability bounds greedy trees only: sampled ones fill their budget.
        trees = Generator(target, drafter, 8, tree_budget=10, tree_topk=3, tree_min_prob=0.99).generate(
            PROMPTS, params)
        assert [r.output_ids for r in trees] == [r.output_ids for r in plain]
        assert all(t["nodes"] == 11 for r in trees for t in r.trees)
    assert max(len(t["path"]) for r in trees for t in r.trees) >= 1


def test_a_tree_accepts_more_than_the_chain_of_its_drafter(tiny):
    target, refs = tiny
    references = [p + r for p, r in zip(PROMPTS, refs, strict=True)]
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,))
    chain = Generator(target, CandidateOracle(random_draft(target), target, references, seed=1), 8,
                      tree_budget=7, tree_topk=1).generate(PROMPTS, params)
    tree = Generator(target, CandidateOracle(random_draft(target), target, references, seed=1), 8,
                     tree_budget=24, tree_topk=4).generate(PROMPTS, params)
    steps = [sum(r.stats.steps for r in results) for results in (chain, tree)]
    assert steps[1] < steps[0], steps


@pytest.mark.parametrize("budget,depth", [(1, 1), (3, 3), (7, 7), (10, 7)])
def test_a_tree_drafts_no_deeper_than_it_can_grow(tiny, budget, depth):
    """A tree of n nodes is at most n deep: it drafts a block of min(n + 1, B) (as the served worker
    does), not the whole block, so a small tree's draft costs what the chain of its rows' does."""
    target, _ = tiny
    asked = []

    class Recording(DFlashDrafter):
        def propose_candidates(self, reqs, anchors, starts, depth, topk, sampling=None):
            asked.append(depth)
            return super().propose_candidates(reqs, anchors, starts, depth, topk, sampling)

    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(STOP_TOKEN,))
    Generator(target, Recording(random_draft(target), target), 8, tree_budget=budget, tree_topk=2).generate(
        PROMPTS, params)
    assert asked and set(asked) == {depth}


def test_tree_options_are_checked():
    target = tiny_target()
    drafter = DFlashDrafter(random_draft(target), target)
    too_many = MAX_TREE_BUDGET + 1
    with pytest.raises(ValueError, match=rf"--tree-budget must be in \[1, {MAX_TREE_BUDGET}\].*got {too_many}"):
        Generator(target, drafter, 8, tree_budget=MAX_TREE_BUDGET + 1)
    with pytest.raises(ValueError, match=rf"--tree-topk must be in \[1, {MAX_TREE_TOPK}\].*got 0"):
        Generator(target, drafter, 8, tree_budget=4, tree_topk=0)
    small = DFlashDrafter(random_draft(target), target)
    small.lm_head_weight = small.lm_head_weight[:20]
    with pytest.raises(ValueError, match=r"--tree-topk 30 exceeds the draft vocabulary \(20 tokens\)"):
        Generator(target, small, 8, tree_budget=4, tree_topk=30)
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        Generator(target, NoDrafter(), 1, tree_budget=4)
