"""verify_tree_from_ids (CPU kernel) and verify_tree: exact against the reference; a chain tree is
verify_block, and branches off the accepted path change nothing (docs/design.md §3.3)."""

from __future__ import annotations

import re

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import follow_targets, make_tree
from tests.test_ops_verify import sampling_args


def _assert_equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a non-contiguous view (every other column of a wider tensor)."""
    wide = torch.empty(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
    wide[:, ::2] = t
    return wide[:, ::2]


def _random_cases():
    gen = torch.Generator().manual_seed(0)
    for case in range(60):
        bs = 1 + case % 5
        nodes = 1 + int(torch.randint(0, 40, (), generator=gen))
        vocab = int(torch.randint(7, 2001, (), generator=gen))
        yield case, bs, nodes, vocab


@pytest.mark.parametrize("case,bs,nodes,vocab", list(_random_cases()))
def test_from_ids_matches_reference(case, bs, nodes, vocab):
    gen = torch.Generator().manual_seed(1000 + case)
    target = torch.randint(0, vocab, (bs, nodes), generator=gen)
    tokens, parents, depths = make_tree(bs, nodes, vocab, gen)
    tokens = follow_targets(tokens, parents, target, gen)
    want = reference.verify_tree_from_ids(tokens, parents, depths, target)
    # Index dtypes, the flat target layout and strided inputs vary with the case.
    index_dtype = torch.int32 if case % 2 else torch.int64
    ids = target.to(index_dtype)
    ids = ids.reshape(-1) if case % 3 == 0 else ids
    args = [tokens, parents.to(index_dtype), depths, ids]
    if case % 4 == 1:
        args[:3] = [_strided(t) for t in args[:3]]
    _assert_equal(ops.verify_tree_from_ids(*args), want)


def test_random_trees_walk_deep():
    """The random trees above are not trivial: many walks accept several nodes, and many leave the
    chain of consecutive nodes for a branch."""
    accepted, branched = [], 0
    for case, bs, nodes, vocab in _random_cases():
        gen = torch.Generator().manual_seed(1000 + case)
        target = torch.randint(0, vocab, (bs, nodes), generator=gen)
        tokens, parents, depths = make_tree(bs, nodes, vocab, gen)
        tokens = follow_targets(tokens, parents, target, gen)
        accept_len, path, _ = ops.verify_tree_from_ids(tokens, parents, depths, target)
        accepted += accept_len.tolist()
        for a, row in zip(accept_len.tolist(), path, strict=True):
            branched += bool((row[1 : a + 1] != row[:a] + 1).any())
    assert max(accepted) >= 6 and sum(a >= 3 for a in accepted) >= 30 and branched >= 30


def test_many_requests_in_parallel_tasks():
    """Enough nodes for several CPU tasks: each request's walk stays its own."""
    gen = torch.Generator().manual_seed(3)
    bs, nodes, vocab = 700, 30, 20
    target = torch.randint(0, vocab, (bs, nodes), generator=gen)
    tokens, parents, depths = make_tree(bs, nodes, vocab, gen)
    tokens = follow_targets(tokens, parents, target, gen)
    _assert_equal(ops.verify_tree_from_ids(tokens, parents, depths, target),
                  reference.verify_tree_from_ids(tokens, parents, depths, target))


def test_walk_takes_the_lowest_child_of_the_current_node():
    """After node 2 the walk wants token 8: node 3 holds it first but hangs under node 1, nodes 4
    and 5 both hold it under node 2 (the lower one wins); after node 6 it wants 9, which only
    node 7, padding, holds (bonus 9)."""
    tokens = torch.tensor([[11, 5, 7, 8, 8, 8, 3, 9]])
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 4, -1]])
    depths = torch.tensor([[0, 1, 1, 2, 2, 2, 3, 0]])
    target = torch.tensor([[7, 20, 8, 21, 3, 22, 9, 23]])  # the target's token after node i
    want = (torch.tensor([3], dtype=torch.int32), torch.tensor([[0, 2, 4, 6, -1, -1, -1, -1]]),
            torch.tensor([[7, 8, 3, 9, -1, -1, -1, -1]]))
    _assert_equal(ops.verify_tree_from_ids(tokens, parents, depths, target), want)
    _assert_equal(reference.verify_tree_from_ids(tokens, parents, depths, target), want)


SAMPLING = [(0.0, 0, 1.0), (0.7, 20, 0.9), (1.3, 0, 0.8), (1.0, 0, 1.0), (0.9, 5, 1.0)]  # T, top_k, top_p


def _chain_case(temperature, top_k, top_p, dtype, bs=4, block=6, vocab=500):
    """verify_block's arguments with drafts that follow the spec's samples until a random point."""
    gen = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    logits = (torch.randn(bs * block, vocab, generator=gen) * 3).to(dtype)
    args = dict(logits=logits, **sampling_args(bs, temperature, top_k, top_p), seed=123)
    y = reference.target_samples(**args, block_size=block)
    cand = torch.randint(0, vocab, (bs, block), generator=gen)
    cand[:, 1:] = y[:, :-1]
    for b in range(bs - 1):  # request b's draft b + 1 is wrong; the last request's are all right
        cand[b, b + 1] = (y[b, b] + 1) % vocab
    return cand, args, y


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_is_verify_block(temperature, top_k, top_p, dtype):
    """A chain (parents[i] = i - 1, depth i) gives verify_block's accept_len and out_tokens, with
    path 0..accept_len: the depth keys the noise exactly as the block row does."""
    cand, args, _ = _chain_case(temperature, top_k, top_p, dtype)
    bs, block = cand.shape
    parents = (torch.arange(block) - 1).repeat(bs, 1)
    depths = torch.arange(block).repeat(bs, 1)
    accept_len, path, out_tokens = ops.verify_tree(cand, parents, depths, **args)
    want_len, _, want_out = ops.verify_block(cand, **args)
    assert accept_len.tolist() == want_len.tolist() == [0, 1, 2, block - 1]
    assert torch.equal(out_tokens, want_out)
    for b, a in enumerate(accept_len.tolist()):
        assert path[b].tolist() == list(range(a + 1)) + [-1] * (block - a - 1)
    _assert_equal((accept_len, path, out_tokens), reference.verify_tree(cand, parents, depths, **args))


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
def test_off_path_branches_change_nothing(temperature, top_k, top_p):
    """The chain of test_chain_is_verify_block, its nodes spread over a larger tree among padding
    and branches whose tokens the target never picks after their parents (decoys; their own
    children are random): same accept_len and out_tokens, the path through the chain's nodes."""
    cand, args, y = _chain_case(temperature, top_k, top_p, torch.float32)
    bs, block = cand.shape
    vocab = args["logits"].shape[1]
    nodes = 3 * block
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (bs, nodes), generator=gen)
    parents = torch.full((bs, nodes), -1)
    depths = torch.zeros(bs, nodes, dtype=torch.int64)
    logits = torch.randn(bs * nodes, vocab, generator=gen) * 3
    where = torch.empty(bs, block, dtype=torch.int64)  # chain node k of request b is tree node where[b, k]
    for b in range(bs):
        later = 1 + torch.randperm(nodes - 1, generator=gen)[: block - 1].sort().values
        where[b] = torch.cat([torch.zeros(1, dtype=torch.int64), later])
        chain_at = {int(n): k for k, n in enumerate(where[b])}
        for i in range(nodes):
            if i in chain_at:
                k = chain_at[i]
                tokens[b, i], depths[b, i] = cand[b, k], k
                parents[b, i] = where[b, k - 1] if k else -1
                logits[b * nodes + i] = args["logits"][b * block + k]
            elif torch.rand((), generator=gen) < 0.8:  # a branch (else padding)
                p = int(torch.randint(0, i, (), generator=gen))
                if p != 0 and parents[b, p] == -1:
                    continue  # under padding: padding too
                parents[b, i], depths[b, i] = p, depths[b, p] + 1
                if p in chain_at:
                    tokens[b, i] = (y[b, chain_at[p]] + 1 + torch.randint(0, vocab - 1, (), generator=gen)) % vocab
    tree_args = dict(args, logits=logits)
    accept_len, path, out_tokens = ops.verify_tree(tokens, parents, depths, **tree_args)
    want_len, _, want_out = ops.verify_block(cand, **args)
    assert torch.equal(accept_len, want_len) and accept_len.tolist() == [0, 1, 2, block - 1]
    assert torch.equal(out_tokens[:, :block], want_out) and (out_tokens[:, block:] == -1).all()
    for b, a in enumerate(accept_len.tolist()):
        assert path[b, : a + 1].tolist() == where[b, : a + 1].tolist() and (path[b, a + 1 :] == -1).all()
    _assert_equal((accept_len, path, out_tokens), reference.verify_tree(tokens, parents, depths, **tree_args))


def sampled_tree_case(temperature, top_k, top_p, dtype, bs=3, nodes=16, vocab=300, seed=0):
    """verify_tree's arguments for a random tree whose drafts often follow the spec's samples (also
    run on CUDA by test_cuda_ops)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, parents, depths = make_tree(bs, nodes, vocab, gen)
    logits = (torch.randn(bs * nodes, vocab, generator=gen) * 3).to(dtype)
    args = dict(logits=logits, **sampling_args(bs, temperature, top_k, top_p), seed=77)
    node_args = {k: v.repeat_interleave(nodes) for k, v in args.items() if k not in ("logits", "seed")}
    node_args["offsets"] = node_args["offsets"] + depths.reshape(-1)
    y = reference.target_samples(logits, seed=77, block_size=1, **node_args).reshape(bs, nodes)
    return dict(tokens=follow_targets(tokens, parents, y, gen), parents=parents, depths=depths, **args)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 0.9), (0, 0.8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_trees_match_reference(temperature, top_k, top_p, dtype):
    accepted = 0
    for seed in range(2):
        case = sampled_tree_case(temperature, top_k, top_p, dtype, seed=seed)
        got = ops.verify_tree(**case)
        _assert_equal(got, reference.verify_tree(**case))
        accepted += int(got[0].sum())
    assert accepted >= 5  # the kernels' samples were compared, not just rejections


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 20, 0.9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs,nodes", [(1, 9), (3, 16), (5, 40)])
def test_cpu_kernel_equals_sampling_every_node(temperature, top_k, top_p, dtype, bs, nodes):
    """The CPU kernel samples only the nodes its walk reaches; GPUs sample every node with
    verify_block, then walk (verify_tree_by_nodes): the same results, bit for bit."""
    for seed in range(2):
        case = sampled_tree_case(temperature, top_k, top_p, dtype, bs=bs, nodes=nodes, seed=seed)
        _assert_equal(ops.verify_tree(**case), ops.verify_tree_by_nodes(**case))


def test_a_token_outside_the_vocabulary_is_named():
    case = sampled_tree_case(0.0, 0, 1.0, torch.float32, bs=2, nodes=5, vocab=10, seed=1)
    case["tokens"][1, 3] = 10
    with pytest.raises(ValueError, match=r"^sglang_dflash.verify_tree: tokens\[1, 3\] = 10 is outside the "
                                         r"vocabulary \[0, 10\) of logits$"):
        ops.verify_tree(**case)


def test_mixed_batch_and_int32_parents():
    case = sampled_tree_case(1.0, 0, 1.0, torch.float32, bs=4, nodes=12, seed=9)
    case.update(temperature=torch.tensor([0.0, 1.0, 0.6, -1.0]), top_k=torch.tensor([0, 10, 3, 0], dtype=torch.int32),
                top_p=torch.tensor([1.0, 0.8, 0.5, 1.0]))
    want = reference.verify_tree(**case)
    _assert_equal(ops.verify_tree(**dict(case, parents=case["parents"].int())), want)


def _tree_args():
    """A valid call of verify_tree_from_ids: two requests of 4 nodes (request 1 padded)."""
    tokens = torch.tensor([[4, 5, 6, 7], [8, 9, 3, 2]])
    return dict(tokens=tokens, parents=torch.tensor([[-1, 0, 1, 0], [-1, 0, -1, 1]]),
                depths=torch.tensor([[0, 1, 2, 1], [0, 1, 0, 2]]), target_ids=tokens.roll(1, dims=1))


def _bad_tree_cases():
    a = _tree_args()
    yield "tokens_rank", dict(a, tokens=a["tokens"].flatten()), "tokens must be 2-D [bs, N], got shape [8]"
    yield "tokens_dtype", dict(a, tokens=a["tokens"].int()), "tokens must be Long, got Int"
    yield "no_root", dict(a, tokens=a["tokens"][:, :0], parents=a["parents"][:, :0], depths=a["depths"][:, :0]), \
        "tokens must have at least one column (the root), got shape [2, 0]"
    yield "parents_shape", dict(a, parents=a["parents"][:, :3]), \
        "parents must have tokens' shape [bs, N] = [2, 4], got shape [2, 3]"
    yield "parents_dtype", dict(a, parents=a["parents"].float()), "parents must be int32 or int64, got Float"
    yield "depths_shape", dict(a, depths=a["depths"][:1]), \
        "depths must have tokens' shape [bs, N] = [2, 4], got shape [1, 4]"
    yield "depths_dtype", dict(a, depths=a["depths"].int()), "depths must be Long, got Int"
    yield "target_shape", dict(a, target_ids=a["target_ids"][:, :3]), \
        "target_ids must be [bs, N] or [bs * N] with bs, N = 2, 4 from tokens, got shape [2, 3]"
    yield "target_dtype", dict(a, target_ids=a["target_ids"].float()), "target_ids must be int32 or int64, got Float"
    yield "device", dict(a, depths=a["depths"].to("meta")), "depths is on meta but the other inputs are on cpu"


@pytest.mark.parametrize("name,args,message", list(_bad_tree_cases()), ids=[c[0] for c in _bad_tree_cases()])
def test_verify_tree_from_ids_rejects(name, args, message):
    with pytest.raises(ValueError, match=f"^{re.escape(f'sglang_dflash.verify_tree_from_ids: {message}')}$"):
        ops.verify_tree_from_ids(**args)


def _bad_verify_tree_cases():
    a = _tree_args()
    a = dict(tokens=a["tokens"], parents=a["parents"], depths=a["depths"], logits=torch.randn(8, 10), seed=0,
             **sampling_args(2, 1.0))
    yield "tokens_rank", dict(a, tokens=a["tokens"].flatten()), "tokens must be 2-D [bs, N], got shape [8]"
    yield "parents_shape", dict(a, parents=a["parents"].T), \
        "parents must have tokens' shape [bs, N] = [2, 4], got shape [4, 2]"
    yield "tokens_dtype", dict(a, tokens=a["tokens"].int()), "tokens must be torch.int64, got torch.int32"
    yield "depths_dtype", dict(a, depths=a["depths"].float()), "depths must be torch.int64, got torch.float32"
    yield "logits_rows", dict(a, logits=a["logits"][:6]), \
        "logits must be [bs * N, V] with bs, N = 2, 4 from tokens, got shape [6, 10]"
    yield "top_p_shape", dict(a, top_p=a["top_p"][:1]), "top_p must be [bs] with bs = 2 from tokens, got shape [1]"
    yield "offsets_shape", dict(a, offsets=a["offsets"].repeat(4)), \
        "offsets must be [bs] with bs = 2 from tokens, got shape [8]"


@pytest.mark.parametrize("name,args,message", list(_bad_verify_tree_cases()),
                         ids=[c[0] for c in _bad_verify_tree_cases()])
def test_verify_tree_rejects(name, args, message):
    with pytest.raises(ValueError, match=f"^{re.escape(f'sglang_dflash.verify_tree: {message}')}$"):
        ops.verify_tree(**args)


def test_verify_tree_reports_a_bad_tree_as_verify_tree_from_ids():
    args = _tree_args()
    args["depths"][0, 3] = 2
    text = "sglang_dflash.verify_tree_from_ids: depths[0, 3] = 2 is not its parent's depth + 1 = 1"
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        ops.verify_tree(args["tokens"], args["parents"], args["depths"], torch.randn(8, 10), seed=0,
                        **sampling_args(2, 0.5))


def test_meta_shapes():
    meta = {k: v.to("meta") for k, v in _tree_args().items()}
    for accept_len, path, out_tokens in (
        ops.verify_tree_from_ids(**dict(meta, parents=meta["parents"].int(), target_ids=meta["target_ids"].view(-1))),
        ops.verify_tree(meta["tokens"], meta["parents"], meta["depths"], torch.empty(8, 10, device="meta"), seed=0,
                        **{k: v.to("meta") for k, v in sampling_args(2).items()}),
    ):
        assert accept_len.device.type == path.device.type == out_tokens.device.type == "meta"
        assert (accept_len.shape, accept_len.dtype) == ((2,), torch.int32)
        assert (path.shape, path.dtype) == (out_tokens.shape, out_tokens.dtype) == ((2, 4), torch.int64)


def test_empty_batch():
    accept_len, path, out_tokens = ops.verify_tree_from_ids(*(torch.empty(0, 3, dtype=torch.int64),) * 4)
    assert accept_len.shape == (0,) and path.shape == out_tokens.shape == (0, 3)
