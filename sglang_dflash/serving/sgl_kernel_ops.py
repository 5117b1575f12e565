"""sgl-kernel's CPU ops of SGLang's speculative path, for SGLang installs whose sgl-kernel lacks them.

SGLang 0.5.23's speculative path on CPU calls these ops through `torch.ops.sgl_kernel` (its
`sgl_kernel` Python wrappers forward to them): only a CPU build of sgl-kernel has CPU kernels for
them, and the PyPI wheel is a CUDA build (it defines `reconstruct_indices_from_tree_mask`, which
NGRAM calls, with a CUDA kernel only). Without them every speculative algorithm on CPU (NGRAM and
DFLASH alike) dies at start-up, when its KV pool's copy warm-up runs
("'_OpNamespace' 'sgl_kernel' object has no attribute 'copy_all_layer_kv_cache_cpu'").

`register_missing()` gives each op SGLang calls, under its own name, a CPU kernel of ours when and
only when `torch.ops.sgl_kernel` has none (defining the op when it is missing): the three index /
KV-copy ops from our extension (csrc/cpu/sgl_kernel_compat.cpp); the ops of a tree verify (NGRAM's)
in PyTorch and Python, below: they touch a few draft tokens per request. A real sgl-kernel CPU
build keeps its own. Called by the plugin's create_worker hook on CPU (plugin.supply_cpu_ops), in
the scheduler process (the only one that runs the speculative path), for every speculative
algorithm and before its workers are built.
"""

from __future__ import annotations

import logging

from sglang_dflash._extension import ops

logger = logging.getLogger(__name__)

# SGLang's op name -> its schema (the argument lists SGLang's wrappers pass).
SCHEMAS = {
    "copy_all_layer_kv_cache_cpu": "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()"
    ),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()"
    ),
    "reconstruct_indices_from_tree_mask": (
        "(Tensor tree_mask, Tensor verified_seq_len, Tensor(a!) positions, Tensor(b!) retrive_index, "
        "Tensor(c!) retrive_next_token, Tensor(d!) retrive_next_sibling, int batch_size, int draft_token_num) -> ()"
    ),
    "verify_tree_greedy_cpu": (
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, Tensor candidates, "
        "Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, Tensor target_predict) -> ()"
    ),
    "fill_accept_out_cache_loc_cpu": (
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()"
    ),
    "fill_bonus_tokens_cpu": (
        "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, int accept_stride) -> ()"
    ),
}

_library = None  # the torch.library fragment holding what we registered (kept alive)


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrive_index, retrive_next_token,
                                       retrive_next_sibling, batch_size: int, draft_token_num: int) -> None:
    """NGRAM's verify metadata from its draft trees, in place, as SGLang's kernels define it: per
    request b and node i of n (`tree_mask` [b, i, j]: node j is node i or one of its ancestors),
    positions = the request's length + i's number of ancestors; retrive_index = b * n + i;
    retrive_next_token = i's first child (-1: a leaf); retrive_next_sibling = the next child of
    i's parent after i (-1: none, or i is the root)."""
    import torch

    bs, n = batch_size, draft_token_num
    if tree_mask.numel() != bs * n * n:
        raise ValueError(f"reconstruct_indices_from_tree_mask: tree_mask has {tree_mask.numel()} entries, "
                         f"expected batch_size * draft_token_num^2 = {bs * n * n}")
    node = torch.arange(n, device=tree_mask.device)
    ancestors = tree_mask.reshape(bs, n, n).bool() & (node[None, :] < node[:, None])  # [b, i, j], j < i
    positions.view(bs, n).copy_(ancestors.sum(-1) + verified_seq_len.reshape(bs, 1).long())
    retrive_index.view(bs, n).copy_(torch.arange(bs * n, device=tree_mask.device).view(bs, n))
    parent = torch.where(ancestors, node, -1).amax(-1)  # [b, i]: the nearest ancestor
    first_child = torch.where(ancestors, node[:, None], n).amin(1)  # [b, j]: the first node below j
    retrive_next_token.view(bs, n).copy_(torch.where(first_child < n, first_child, -1))
    later_sibling = (parent[:, :, None] == parent[:, None, :]) & (node[:, None] > node[None, :])  # [b, k, i]
    next_sibling = torch.where(later_sibling, node[:, None], n).amin(1)
    retrive_next_sibling.view(bs, n).copy_(torch.where((parent >= 0) & (next_sibling < n), next_sibling, -1))


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict) -> None:
    """Greedy acceptance down each request's draft tree, in place, as SGLang's kernels define it:
    from the root, take the first child (then its siblings) whose token is the target's greedy
    token at the last accepted node, for up to accept_index.shape[1] - 1 steps.
    accept_index[b] = the flat indices (retrive_index) of the root and the accepted nodes;
    accept_token_num[b] = how many were accepted; predicts[idx] = the target's token at each
    of them (at the last, the bonus token)."""
    import torch

    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand, index, first_child, sibling = (t.reshape(bs, n).tolist() for t in (
        candidates, retrive_index, retrive_next_token, retrive_next_sibling))
    target = target_predict.reshape(-1).tolist()
    if len(target) != bs * n:
        raise ValueError(f"verify_tree_greedy_cpu: target_predict has {len(target)} entries, expected {bs * n}")
    accepted = []
    for b in range(bs):
        path, cur = [index[b][0]], 0
        for _ in range(1, steps):
            cur = first_child[b][cur]
            while cur != -1 and cand[b][cur] != target[path[-1]]:
                cur = sibling[b][cur]
            if cur == -1:
                break
            path.append(index[b][cur])
        accepted.append(path)
    flat = torch.tensor([i for path in accepted for i in path], dtype=torch.long)
    predicts.view(-1)[flat] = torch.tensor([target[i] for i in flat.tolist()], dtype=predicts.dtype)
    for b, path in enumerate(accepted):
        accept_index[b, : len(path)] = torch.tensor(path, dtype=accept_index.dtype)
        accept_token_num[b] = len(path) - 1


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """accept_out_cache_loc[k] = out_cache_loc[i] for the k-th entry i of accept_index (flat,
    in order) that is not -1."""
    index = accept_index.reshape(-1)
    index = index[index != -1].long()
    if index.numel() > accept_out_cache_loc.numel():
        raise ValueError(f"fill_accept_out_cache_loc_cpu: {index.numel()} accepted entries, but "
                         f"accept_out_cache_loc holds {accept_out_cache_loc.numel()}")
    accept_out_cache_loc[: index.numel()] = out_cache_loc[index]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride: int) -> None:
    """bonus_tokens[b] = the last of request b's accept_lens[b] accepted tokens (accept_tokens flat,
    accept_stride per request)."""
    import torch

    last = torch.arange(accept_lens.numel()) * accept_stride + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[last])


def _has_op(name: str) -> bool:
    import torch

    try:
        getattr(torch.ops.sgl_kernel, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _has_cpu_kernel(name: str) -> bool:
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key(f"sgl_kernel::{name}", "CPU")


# The ops whose CPU kernel is the Python function above; the others' are our extension's.
_PYTHON_KERNELS = {f.__name__: f for f in (reconstruct_indices_from_tree_mask, verify_tree_greedy_cpu,
                                           fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu)}


def _cpu_kernel(name: str):
    return _PYTHON_KERNELS.get(name) or getattr(ops(), "sgl_kernel_" + name)


def register_missing() -> list[str]:
    """Gives each op of SCHEMAS that torch.ops.sgl_kernel has no CPU kernel for ours (defining the
    op when it is missing); returns their names."""
    global _library
    import torch

    try:  # sgl-kernel registers its own ops when imported: let it go first
        import sgl_kernel  # noqa: F401
    except Exception:  # a CUDA build without a driver, or no sgl-kernel: nothing of it to keep
        pass
    missing = [name for name in SCHEMAS if not _has_op(name) or not _has_cpu_kernel(name)]
    if not missing:
        return []
    if _library is None:
        _library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in missing:
        if not _has_op(name):
            _library.define(name + SCHEMAS[name])
        _library.impl(name, _cpu_kernel(name), "CPU")
    return missing
