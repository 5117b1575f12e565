"""The served tree step's parts on SGLang's real CPU objects (trees.py): the tree mask in the
TARGET_VERIFY attention over SGLang's KV pool, the accepted path's K/V moved into place, the draft
head's trees and positions, the drafter's context along the path, and the settings' errors. The
whole step through a real server: test_sglang_smollm2_server.py. Needs SGLang."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang_cpu.sh VENV installs it beside the package)",
                allow_module_level=True)

from sglang_dflash import ops
from sglang_dflash.control.tree import DEFAULT_TREE_TOPK
from sglang_dflash.ops import reference
from sglang_dflash.ops.testing import follow_targets, make_tree
from sglang_dflash.serving import attention, trees


@pytest.fixture(autouse=True)
def no_tree_left():
    attention.publish_verify_tree(None)
    yield
    attention.publish_verify_tree(None)


def _pool(layers, size=96, hkv=2, dim=16, seed=0):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    gen = torch.Generator().manual_seed(seed)
    pool = MHATokenToKVPool(size=size, page_size=1, dtype=torch.float32, head_num=hkv, head_dim=dim,
                            layer_num=layers, device="cpu", enable_memory_saver=False)
    for layer in range(layers):
        for buffer in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            buffer.copy_(torch.randn(buffer.shape, generator=gen))
    return pool


def _verify_case(attn_type, nodes=6, ctx=(5, 70, 0), seed=0):
    """A TARGET_VERIFY call of `len(ctx)` requests with blocks of `nodes` rows over SGLang's pool."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    gen = torch.Generator().manual_seed(seed)
    hq, hkv, dim, bs = 4, 2, 16, len(ctx)
    pool = _pool(1, size=sum(ctx) + bs * nodes + 8, seed=seed)
    slots = torch.randperm(sum(ctx) + bs * nodes, generator=gen) + 1
    table = torch.zeros(bs + 1, max(ctx) + nodes + 3, dtype=torch.int32)
    rows, out_loc, used = torch.tensor([2, 0, 3])[:bs], [], 0
    for b in range(bs):
        table[rows[b], : ctx[b] + nodes] = slots[used : used + ctx[b] + nodes].int()
        out_loc.append(table[rows[b], ctx[b] : ctx[b] + nodes])
        used += ctx[b] + nodes
    layer = RadixAttention(hq, dim, 0.3, hkv, layer_id=0, attn_type=attn_type)
    fb = types.SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=None,
        req_pool_indices=rows, seq_lens=torch.tensor(ctx), out_cache_loc=torch.cat(out_loc).long(),
    )
    q, k, v = (torch.randn(bs * nodes, h * dim, generator=gen) for h in (hq, hkv, hkv))
    return layer, pool, table, fb, q, k, v


def test_verify_attention_applies_the_published_tree_and_counts_the_layer():
    from sglang.srt.layers.radix_attention import AttentionType

    nodes = 6
    layer, pool, table, fb, q, k, v = _verify_case(AttentionType.DECODER, nodes)
    context_k, context_v = pool.get_key_buffer(0).clone(), pool.get_value_buffer(0).clone()
    _, parents, _ = make_tree(3, nodes, 50, torch.Generator().manual_seed(3), unused=0.2)
    attention.publish_verify_tree(parents)
    out = attention.paged_block_attention(q, k, v, layer, fb, kv_pool=pool, req_to_token=table)
    assert attention.tree_layers_applied() == 1
    args = dict(q=q.view(-1, 4, 16), k_block=k.view(-1, 2, 16), v_block=v.view(-1, 2, 16), k_cache=context_k,
                v_cache=context_v, req_to_token=table, req_pool_indices=fb.req_pool_indices, ctx_lens=fb.seq_lens,
                block_size=nodes, sm_scale=0.3)
    expected = reference.block_attention(**args, tree_parents=parents)
    torch.testing.assert_close(out, expected.reshape(out.shape), rtol=1e-5, atol=1e-5)
    chain = reference.block_attention(**args, causal_block=True)
    assert (out - chain.reshape(out.shape)).abs().max() > 1e-3  # the tree's mask, not the chain's

    # Without a tree, and in the drafter's (non-causal) layers, the block is what it was.
    attention.publish_verify_tree(None)
    torch.testing.assert_close(attention.paged_block_attention(q, k, v, layer, fb, kv_pool=pool, req_to_token=table),
                               chain.reshape(out.shape), rtol=1e-5, atol=1e-5)
    draft_layer, *_ = _verify_case(AttentionType.ENCODER_ONLY, nodes)
    attention.publish_verify_tree(parents)
    drafted = attention.paged_block_attention(q, k, v, draft_layer, fb, kv_pool=pool, req_to_token=table)
    torch.testing.assert_close(drafted, reference.block_attention(**args).reshape(out.shape), rtol=1e-5, atol=1e-5)
    assert attention.tree_layers_applied() == 0

    with pytest.raises(RuntimeError, match="do not describe this verify's 3 blocks of 6 rows"):
        attention.publish_verify_tree(parents[:, :5])
        attention.paged_block_attention(q, k, v, layer, fb, kv_pool=pool, req_to_token=table)


@pytest.mark.parametrize("seed", range(6))
def test_the_accepted_path_moves_into_consecutive_slots_in_every_layer(seed):
    gen = torch.Generator().manual_seed(seed)
    bs, nodes, layers = 4, 9, 3
    pool = _pool(layers, size=bs * nodes + 20, seed=seed)
    before = [(pool.get_key_buffer(i).clone(), pool.get_value_buffer(i).clone()) for i in range(layers)]
    tokens, parents, depths = make_tree(bs, nodes, 6, gen)
    target = torch.randint(0, 6, (bs, nodes), generator=gen)
    tokens = follow_targets(tokens, parents, target, gen, follow=0.8)
    accept_len, path, _ = ops.verify_tree_from_ids(tokens, parents, depths, target)
    assert int(accept_len.max()) >= 2  # the paths go somewhere
    loc = (torch.randperm(bs * nodes + 19, generator=gen)[: bs * nodes] + 1).view(bs, nodes).int()
    moved = trees.move_path_kv(pool, loc, path, accept_len)
    assert moved == sum(int((path[b, : int(accept_len[b]) + 1] != torch.arange(int(accept_len[b]) + 1)).sum())
                        for b in range(bs))
    for layer, (k0, v0) in enumerate(before):
        k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        expected_k, expected_v = k0.clone(), v0.clone()
        for b in range(bs):
            for j in range(int(accept_len[b]) + 1):
                expected_k[loc[b, j]] = k0[loc[b, path[b, j]]]
                expected_v[loc[b, j]] = v0[loc[b, path[b, j]]]
        assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


@pytest.mark.parametrize("seed", range(4))
def test_verify_rows_move_into_path_order(seed):
    """SGLang's logprobs read verify row j as output position j's prediction: after the move, row j
    is the accepted path's node j's (and rows past the path the root's)."""
    gen = torch.Generator().manual_seed(seed)
    bs, nodes, vocab = 4, 9, 11
    tokens, parents, depths = make_tree(bs, nodes, 6, gen)
    target = torch.randint(0, 6, (bs, nodes), generator=gen)
    tokens = follow_targets(tokens, parents, target, gen, follow=0.8)
    accept_len, path, _ = ops.verify_tree_from_ids(tokens, parents, depths, target)
    assert int(accept_len.max()) >= 2  # the paths go somewhere
    logits = torch.randn(bs * nodes, vocab, generator=gen)
    before = logits.clone()
    trees.rows_in_path_order(logits, path)
    for b in range(bs):
        for j in range(nodes):
            node = int(path[b, j]) if j <= int(accept_len[b]) else 0
            assert torch.equal(logits[b * nodes + j], before[b * nodes + node])


class _DraftWorker:
    """The attributes of DFlashKernelWorker that ServedTrees.draft reads (a stand-in: a real worker
    needs a running SGLang server, where test_sglang_smollm2_server.py runs the whole step)."""

    def __init__(self, bs, block, prefix):
        self.block_size = block
        self._draft_block_ids_buf = torch.full((bs + 2, block), 7, dtype=torch.int64)
        self._draft_block_ids_buf[:bs, 0] = torch.arange(bs) + 100
        self._draft_block_positions_buf = prefix[:, None].repeat(1, block) + torch.arange(block)
        self._draft_block_positions_buf = torch.cat([self._draft_block_positions_buf, torch.zeros(2, block,
                                                                                                    dtype=torch.int64)])


def test_draft_builds_the_trees_and_their_positions_and_the_context_follows_the_path():
    bs, n, topk, vocab, hidden = 3, 7, 3, 40, 8
    prefix = torch.tensor([11, 0, 64])
    worker = _DraftWorker(bs, n + 1, prefix)
    served = trees.ServedTrees(worker, n, topk)
    served.begin(n)
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(bs * n, hidden, generator=gen)
    head = torch.randn(vocab, hidden, generator=gen)
    ids = torch.randperm(100, generator=gen)[:vocab]  # a draft vocabulary: column c is target id ids[c]
    drafted = served.draft(states, lambda h: (h @ head.T, ids))
    built = served.trees
    scores, picks = (states @ head.T).log_softmax(-1).topk(topk, dim=-1)
    from sglang_dflash.control.tree import build_trees

    expected = build_trees(torch.arange(bs) + 100, ids[picks].view(bs, n, topk), scores.view(bs, n, topk), [n] * bs)
    assert torch.equal(built.tokens, expected.tokens) and torch.equal(built.parents, expected.parents)
    assert torch.equal(drafted, built.tokens[:, 1:].reshape(-1))
    assert torch.equal(worker._draft_block_positions_buf[:bs], prefix[:, None] + built.depths)
    assert attention.verify_tree_parents() is built.parents
    assert built.depths.max() < n  # branches: not the chain

    # After the verify: the context of each request's accepted path, at positions prefix + j.
    target = torch.randint(0, 100, (bs, n + 1), generator=gen)
    tokens = follow_targets(built.tokens, built.parents, target, gen, follow=0.9)
    accept_len, served.path, _ = ops.verify_tree_from_ids(tokens, built.parents, built.depths, target)
    hidden_states = torch.randn(bs * (n + 1), 5, generator=gen)
    context, positions = served.path_context(hidden_states, worker._draft_block_positions_buf[:bs].reshape(-1))
    for b in range(bs):
        for j in range(int(accept_len[b]) + 1):
            assert torch.equal(context[b * (n + 1) + j], hidden_states[b * (n + 1) + int(served.path[b, j])])
            assert int(positions[b * (n + 1) + j]) == int(prefix[b]) + j

    # The chain of first choices inside each tree (the drafted top picks, each the child of the one
    # before), checked on its own against the target's tokens: what it would have had accepted.
    top = ids[picks[:, 0]].view(bs, n)
    chain_lens, depths = served.chains_in_trees(accept_len.tolist())
    assert depths == [int(built.depths[b, 1:].max()) for b in range(bs)]
    for b, chain_accepted in enumerate(chain_lens):
        node, expected = 0, 0
        while expected < n:
            child = [i for i in range(1, n + 1) if int(built.parents[b, i]) == node
                     and int(built.tokens[b, i]) == int(top[b, expected])]
            if not child or int(target[b, node]) != int(tokens[b, child[0]]):
                break
            node, expected = child[0], expected + 1
        assert chain_accepted == expected <= int(accept_len[b])
    assert served.chains_in_trees([0] * (bs + 1)) is None  # not this step's batch

    reqs = [types.SimpleNamespace(customized_info=None, output_ids=[1] * (b + 1)) for b in range(bs)]
    served.finish(reqs, [int(a) + 1 for a in accept_len])
    assert served.trees is None and served.path is None and not served.drafting
    assert attention.verify_tree_parents() is None
    assert served.chains_in_trees([0] * bs) is None  # no tree step in flight
    for b, req in enumerate(reqs):
        assert req.customized_info[trees.META_INFO_KEY] == [0] * (b + 1) + [n] * (int(accept_len[b]) + 1)


def test_a_tree_needs_the_worker_at_its_block_size():
    served = trees.ServedTrees(_DraftWorker(1, 8, torch.tensor([3])), 7, 4)
    with pytest.raises(RuntimeError, match="a tree of 5 nodes needs the worker at block size 6, not 8"):
        served.begin(5)


@pytest.mark.parametrize("env,message", [
    ({"SGLANG_DFLASH_TREE_BUDGET": "8"},
     r"SGLANG_DFLASH_TREE_BUDGET must be in \[1, 7\] drafted nodes \(a tree and its root fill the request's block "
     r"of --speculative-num-draft-tokens 8 rows; 0 turns trees off\), got 8"),
    ({"SGLANG_DFLASH_TREE_BUDGET": "-2"}, r"SGLANG_DFLASH_TREE_BUDGET must be in \[1, 7\] .*, got -2"),
    ({"SGLANG_DFLASH_TREE_BUDGET": "four"}, r"SGLANG_DFLASH_TREE_BUDGET='four': expected an integer"),
    ({"SGLANG_DFLASH_TREE_BUDGET": "7", "SGLANG_DFLASH_TREE_TOPK": "0"},
     r"SGLANG_DFLASH_TREE_TOPK must be in \[1, 64\] choices per position, got 0"),
    ({"SGLANG_DFLASH_TREE_BUDGET": "7", "SGLANG_DFLASH_TREE_TOPK": "65"},
     r"SGLANG_DFLASH_TREE_TOPK must be .*, got 65"),
    ({"SGLANG_DFLASH_TREE_BUDGET": "7", "SGLANG_DFLASH_TREE_TOPK": "7"},
     r"SGLANG_DFLASH_TREE_TOPK 7 exceeds the draft vocabulary \(6 tokens\)"),
])
def test_bad_tree_settings_name_the_variable(monkeypatch, env, message):
    """The CLI's checks and messages (control.tree.check_tree_options), naming the variables."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        trees.tree_options(8, 6)


def test_tree_settings(monkeypatch):
    monkeypatch.delenv("SGLANG_DFLASH_TREE_BUDGET", raising=False)
    monkeypatch.delenv("SGLANG_DFLASH_TREE_TOPK", raising=False)
    assert trees.tree_options(8, 100) is None
    # Unset: the engine's default budget where the block size adapts, cut to what the block
    # holds, off below 2 nodes; the CLI's default top-k.
    assert trees.tree_options(8, 100, block_size_adapts=True) == (7, DEFAULT_TREE_TOPK)
    assert trees.tree_options(4, 100, block_size_adapts=True) == (3, DEFAULT_TREE_TOPK)
    assert trees.tree_options(2, 100, block_size_adapts=True) is None
    monkeypatch.setenv("SGLANG_DFLASH_TREE_TOPK", "0")  # read only where trees are on
    assert trees.tree_options(2, 100, block_size_adapts=True) is None
    with pytest.raises(ValueError, match="SGLANG_DFLASH_TREE_TOPK must be in"):
        trees.tree_options(8, 100, block_size_adapts=True)
    monkeypatch.delenv("SGLANG_DFLASH_TREE_TOPK")
    monkeypatch.setenv("SGLANG_DFLASH_TREE_BUDGET", "0")
    assert trees.tree_options(8, 100) is None
    assert trees.tree_options(8, 100, block_size_adapts=True) is None  # 0 turns the default off
    monkeypatch.setenv("SGLANG_DFLASH_TREE_BUDGET", " 7 ")
    assert trees.tree_options(8, 100) == (7, DEFAULT_TREE_TOPK)
    monkeypatch.setenv("SGLANG_DFLASH_TREE_TOPK", "2")
    assert trees.tree_options(8, 100) == (7, 2)


def _tree_worker(monkeypatch, backend, window=-1, tp_size=1, mamba=False):
    """A stand-in worker with what tree_problem reads past adaptive_problem (which needs a running
    server and is stubbed here): one real RadixAttention target layer, a real backend class."""
    from sglang.srt.layers.radix_attention import RadixAttention

    from sglang_dflash.serving import adaptive

    monkeypatch.setattr(adaptive, "adaptive_problem", lambda worker: None)
    model = torch.nn.Module()
    model.attn = RadixAttention(2, 8, 0.3, 2, layer_id=0, sliding_window_size=window)
    runner = types.SimpleNamespace(model=model, attn_backend=object.__new__(backend))
    return types.SimpleNamespace(_tp_size=lambda: tp_size, _need_mamba_verify_commit=mamba,
                                 target_worker=types.SimpleNamespace(model_runner=runner))


def test_a_sliding_window_target_is_refused_at_start_up(monkeypatch):
    """A target layer with a sliding window refuses trees (the tree mode has no window), the same
    layer without one passes that check."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    assert "sliding-window attention" in trees.tree_problem(_tree_worker(monkeypatch, TorchNativeAttnBackend, 4))
    assert "sliding-window" not in (trees.tree_problem(_tree_worker(monkeypatch, TorchNativeAttnBackend)) or "")


@pytest.mark.parametrize("backend", ["flashinfer_backend.FlashInferAttnBackend", "triton_backend.TritonAttnBackend"])
def test_gpu_attention_backends_refuse_trees(monkeypatch, backend):
    """SGLang's GPU backends verify a DFLASH block under a causal mask (and replay CUDA graphs
    captured without a tree mask): a tree verified there would be lossy, so the worker must run
    chains. The real backend classes, imported on the CPU (their kernels never run here)."""
    import importlib

    module, name = backend.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"sglang.srt.layers.attention.{module}"), name)
    assert trees.tree_problem(_tree_worker(monkeypatch, cls)) == (
        f"the target's attention backend {name} has no tree mask (CPU's torch_native runs ours)")


def test_tensor_parallel_and_mamba_targets_refuse_trees(monkeypatch):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    assert "tensor parallelism" in trees.tree_problem(_tree_worker(monkeypatch, TorchNativeAttnBackend, tp_size=2))
    assert "Mamba" in trees.tree_problem(_tree_worker(monkeypatch, TorchNativeAttnBackend, mamba=True))


def test_tensor_parallelism_turns_the_adaptive_block_size_off():
    """Every rank must verify the same block size, and each would choose its own from its own step
    times: under TP the block size stays fixed (and so no trees). A stand-in worker (the check
    runs before anything that needs a server)."""
    from sglang_dflash.serving import adaptive

    worker = types.SimpleNamespace(**dict.fromkeys(adaptive.PER_BLOCK_SIZE_STATE), device="cpu",
                                   _tp_size=lambda: 2)
    assert adaptive.adaptive_problem(worker) == "tensor parallelism (the ranks would choose their block sizes apart)"
