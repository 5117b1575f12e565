"""Every bad argument gets one ValueError that names it (never a crash or a wrong answer)."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.ops.testing import make_attention_inputs as make_inputs
from tests.test_ops_verify import sampling_args


def attention_args():
    return make_inputs(2, 4, 4, 2, 64, [5, 9], torch.float32, seed=0)


def _set(args, name, value):
    args = dict(args)
    args[name] = value
    return args


def _bad_attention_cases():
    a = attention_args()
    table = a["req_to_token"]
    yield "q_rank", _set(a, "q", a["q"][0]), {}, "q must be 3-D"
    yield "q_dtype", _set(a, "q", a["q"].double()), {}, "q must be float32, bfloat16 or float16"
    yield "k_block_dtype", _set(a, "k_block", a["k_block"].half()), {}, "k_block must have q's dtype"
    yield "v_cache_dtype", _set(a, "v_cache", a["v_cache"].bfloat16()), {}, "v_cache must have q's dtype"
    yield "gqa", _set(a, "q", torch.randn(8, 3, 64)), {}, r"q heads \(3\) must be a multiple of kv heads \(2\)"
    yield "head_dim", _set(a, "k_cache", torch.randn(30, 2, 32)), {}, r"k_cache.shape\[2\] must be head_dim"
    yield "kv_heads", _set(a, "v_block", torch.randn(8, 1, 64)), {}, r"v_block.shape\[1\] must be kv heads"
    yield "rows", _set(a, "k_block", torch.randn(4, 2, 64)), {}, r"k_block.shape\[0\] must be q.shape\[0\]"
    yield "v_cache_slots", _set(a, "v_cache", torch.randn(3, 2, 64)), {}, r"v_cache.shape\[0\] must be k_cache"
    yield "block_size", a, {"block_size": 3}, "not a multiple of block_size"
    yield "block_size_zero", a, {"block_size": 0}, "block_size must be >= 1"
    yield "window_zero", a, {"window": 0}, "window must be >= 1"
    yield "ctx_lens_len", _set(a, "ctx_lens", torch.tensor([1, 2, 3])), {}, r"ctx_lens.shape\[0\] must be bs"
    yield "table_dtype", _set(a, "req_to_token", table.float()), {}, "req_to_token must be int32 or int64"
    yield "pool_dtype", _set(a, "req_pool_indices", torch.tensor([0.0, 1.0])), {}, "req_pool_indices must be int32"
    yield "pool_range", _set(a, "req_pool_indices", torch.tensor([0, table.shape[0]])), {}, \
        r"req_pool_indices\[1\] = 4 is out of range"
    yield "pool_negative", _set(a, "req_pool_indices", torch.tensor([-1, 0])), {}, r"req_pool_indices\[0\] = -1"
    yield "ctx_too_long", _set(a, "ctx_lens", torch.tensor([5, table.shape[1] + 1])), {}, \
        r"ctx_lens\[1\] = 13 is out of range \[0, 12\]"
    yield "ctx_negative", _set(a, "ctx_lens", torch.tensor([-2, 1])), {}, r"ctx_lens\[0\] = -2"
    yield "slot_range", _set(a, "ctx_lens", torch.tensor([5, 11])), {}, "outside the KV cache"
    yield "last_dim_stride", _set(a, "k_cache", a["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)), {}, \
        "k_cache must have a contiguous last dimension"
    yield "device", _set(a, "v_cache", a["v_cache"].to("meta")), {}, "v_cache is on meta"
    tree = torch.tensor([[-1, 0, 1, 0], [-1, 0, 0, -1]])
    yield "tree_rank", a, {"tree_parents": tree[0]}, "tree_parents must be 2-D"
    yield "tree_nodes", a, {"tree_parents": tree[:, :3]}, r"tree_parents.shape\[1\] must be block_size"
    yield "tree_dtype", a, {"tree_parents": tree.float()}, "tree_parents must be int32 or int64"
    yield "tree_window", a, {"tree_parents": tree, "window": 8}, "tree_parents cannot be combined with a sliding window"
    yield "tree_causal", a, {"tree_parents": tree, "causal_block": True}, "tree_parents cannot be combined with causal"
    yield "tree_device", a, {"tree_parents": tree.to("meta")}, "tree_parents is on meta"


@pytest.mark.parametrize("name,args,kwargs,message", list(_bad_attention_cases()),
                         ids=[c[0] for c in _bad_attention_cases()])
def test_block_attention_rejects(name, args, kwargs, message):
    kwargs = {"block_size": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        ops.block_attention(**args, **kwargs)


def verify_args(bs=2, block=4, vocab=10):
    gen = torch.Generator().manual_seed(0)
    return dict(
        candidates=torch.randint(0, vocab, (bs, block), generator=gen),
        logits=torch.randn(bs * block, vocab, generator=gen),
        seed=0,
        **sampling_args(bs, temperature=1.0),
    )


def _bad_verify_cases():
    v = verify_args()
    yield "cand_dtype", _set(v, "candidates", v["candidates"].int()), "candidates must be Long"
    yield "cand_rank", _set(v, "candidates", v["candidates"].flatten()), "candidates must be 2-D"
    yield "cand_range", _set(v, "candidates", v["candidates"] + 10), r"outside the vocabulary \[0, 10\)"
    yield "cand_negative", _set(v, "candidates", v["candidates"] - 11), "outside the vocabulary"
    yield "logits_rows", _set(v, "logits", v["logits"][:7]), r"logits.shape\[0\] must be bs \* B"
    yield "logits_dtype", _set(v, "logits", v["logits"].double()), "logits must be float32"
    yield "logits_vocab", _set(v, "logits", v["logits"][:, :0]), "vocabulary of at least 1"
    yield "logits_stride", _set(v, "logits", torch.randn(10, 8).t()), "logits must have a contiguous last dimension"
    yield "temperature_dtype", _set(v, "temperature", v["temperature"].double()), "temperature must be Float"
    yield "top_k_dtype", _set(v, "top_k", v["top_k"].long()), "top_k must be Int"
    yield "top_p_len", _set(v, "top_p", v["top_p"][:1]), r"top_p.shape\[0\] must be bs"
    yield "offsets_dtype", _set(v, "offsets", v["offsets"].int()), "offsets must be Long"
    yield "offsets_rank", _set(v, "offsets", v["offsets"][None]), "offsets must be 1-D"
    yield "device", _set(v, "logits", v["logits"].to("meta")), "logits is on meta"


@pytest.mark.parametrize("name,args,message", list(_bad_verify_cases()),
                         ids=[c[0] for c in _bad_verify_cases()])
def test_verify_block_rejects(name, args, message):
    with pytest.raises(ValueError, match=message):
        ops.verify_block(**args)


@pytest.mark.parametrize(
    "target_ids,message",
    [
        (torch.zeros(2, 4), "target_ids must be int32 or int64"),
        (torch.zeros(3, 4, dtype=torch.int64), "target_ids must be"),
        (torch.zeros(7, dtype=torch.int64), "target_ids must be"),
    ],
)
def test_verify_from_ids_rejects(target_ids, message):
    with pytest.raises(ValueError, match=message):
        ops.verify_block_from_ids(torch.zeros(2, 4, dtype=torch.int64), target_ids)


def test_missing_extension_gives_install_hint(monkeypatch):
    """A checkout without the compiled kernels says how to build them."""
    import builtins
    import importlib

    from sglang_dflash import _extension

    real_import = builtins.__import__

    def no_c(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "sglang_dflash" and fromlist and "_C" in fromlist:
            raise ImportError("No module named 'sglang_dflash._C'")
        return real_import(name, globals, locals, fromlist, level)

    _extension.ops.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_c)
    try:
        with pytest.raises(ImportError, match="pip install --no-build-isolation"):
            _extension.ops()
    finally:
        monkeypatch.setattr(builtins, "__import__", real_import)
        _extension.ops.cache_clear()
        importlib.import_module("sglang_dflash._C")
