"""The start-up self-test (sglang_dflash/ops/self_test.py), exercised on the CPU: the kernels pass it;
a deliberately broken kernel (wrong values, or an exception such as a missing kernel image) gets one
warning naming the op and the device, the op falls back to the reference (results still equal it),
and with SGLANG_DFLASH_STRICT=1 the failure is an error."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang_dflash import _extension, ops
from sglang_dflash.ops import reference, self_test
from sglang_dflash.ops.self_test import Attention, ContextKV

CPU = torch.device("cpu")
LOGGER = "sglang_dflash.ops.self_test"
CASES = {
    "verify_block": [torch.float32, torch.bfloat16],
    "verify_block_from_ids": [torch.int64, torch.int32],
    "verify_tree_from_ids": [torch.int64, torch.int32],
    "verify_tree": [torch.float32, torch.bfloat16],
    "gumbel_argmax": [torch.float32],
    "block_attention": [Attention(4, 2, 64, torch.float32, 16), Attention(9, 3, 64, torch.bfloat16, 4, 8, True),
                        Attention(8, 8, 128, torch.float16, 1)],
    "materialize_context_kv": [ContextKV(96, 2, 64, 64, torch.float32, torch.float32, torch.float32, True, True),
                               ContextKV(576, 3, 64, 32, torch.bfloat16, torch.float16, torch.bfloat16, False, False)],
    "skinny_linear": [torch.float32, torch.bfloat16, torch.float16],
    "rms_norm_rope": [torch.float32, torch.bfloat16, torch.float16],
    "w8a8_linear": [torch.float32, torch.bfloat16, torch.float16],
    "move_slots": [torch.float32, torch.bfloat16, torch.float16],
    "top_k_logprobs": [torch.float32, torch.bfloat16, torch.float16],
}


@pytest.fixture
def fresh(monkeypatch):
    """No cached self-test results and no fallbacks (both restored afterwards), strict mode off."""
    monkeypatch.setattr(self_test, "_RESULTS", {})
    monkeypatch.setattr(ops, "_REFERENCE_ON", set())
    monkeypatch.delenv("SGLANG_DFLASH_STRICT", raising=False)


def _break(monkeypatch, op, how):
    """Replace the compiled op: "wrong" perturbs its result, "raise" raises what a GPU without an
    image for its compute capability raises."""
    kernel = getattr(_extension.ops(), op)

    def broken(*args):
        if how == "raise":
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")
        out = kernel(*args)
        if op == "materialize_context_kv":
            args[10][0].zero_()  # the first layer's v pool overwritten
        elif op == "move_slots":
            args[0][0].zero_()  # the first buffer overwritten
        elif isinstance(out, tuple):  # verify: one bonus token off
            out[1][0] += 1
        elif out.dtype == torch.int64:  # gumbel_argmax: one pick off
            out[0] = (out[0] + 1) % args[0].shape[1]
        else:
            out.view(-1)[0] += 1.0
        return out

    monkeypatch.setattr(_extension.ops(), op, broken)


@pytest.mark.parametrize("op", list(CASES))
def test_kernels_pass_their_self_test(fresh, op):
    for case in CASES[op]:
        assert self_test.check(op, CPU, case) is None, (op, case)


def test_engine_plan_passes_on_the_cpu(fresh):
    plan = self_test.engine_plan(9, 3, 64, torch.bfloat16, CPU)
    assert set(plan) == {"verify_block", "verify_tree", "gumbel_argmax", "block_attention",
                         "materialize_context_kv", "skinny_linear", "rms_norm_rope", "w8a8_linear", "move_slots",
                         "top_k_logprobs"}
    assert plan["verify_block"] == [torch.float32, torch.bfloat16]
    assert self_test.select(CPU, plan, fallback="PyTorch") == set(plan)
    assert not ops._REFERENCE_ON


@pytest.mark.parametrize("how", ["wrong", "raise"])
@pytest.mark.parametrize("op", list(CASES))
def test_a_broken_kernel_warns_once_and_falls_back(fresh, monkeypatch, caplog, op, how):
    _break(monkeypatch, op, how)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ours = self_test.select(CPU, {op: CASES[op], "verify_block_from_ids": [torch.int64]}, fallback="PyTorch")
        self_test.select(CPU, {op: CASES[op]}, fallback="PyTorch")  # a second caller: no second warning
    assert ours == ({"verify_block_from_ids"} if op != "verify_block_from_ids" else set())
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    warnings = [r.getMessage() for r in records]
    assert warnings[0].startswith(f"sglang-dflash: self-test of {op} on cpu failed (")
    assert warnings[0].endswith(f"; {op} runs PyTorch there")
    if how == "raise":
        assert "raised RuntimeError: CUDA error: no kernel image is available" in warnings[0]
        assert "more" not in warnings[0]  # the first line of the error only
    assert not ops.runs_ours(op, CPU) and ops.runs_ours(op, "meta")
    assert all(ops.runs_ours(other, CPU) for other in CASES if other != op)


def test_fallback_results_equal_the_reference(fresh, monkeypatch):
    """After the self-test caught them, the public ops return the reference's results although the
    compiled kernels are still broken."""
    for op in ("verify_block", "gumbel_argmax", "block_attention"):
        _break(monkeypatch, op, "wrong")
    assert self_test.select(CPU, {op: CASES[op][:1] for op in ("verify_block", "gumbel_argmax", "block_attention")},
                            fallback="PyTorch") == set()
    gen = torch.Generator().manual_seed(5)
    bs, block, vocab = 3, 4, 200
    logits = torch.randn(bs * block, vocab, generator=gen)
    cands = torch.randint(0, vocab, (bs, block), generator=gen)
    args = (cands, logits, torch.tensor([0.0, 0.9, 1.1]), torch.tensor([0, 0, 40], dtype=torch.int32),
            torch.tensor([1.0, 0.9, 1.0]), 7, torch.tensor([3, 1 << 40, 99]))
    for got, want in zip(ops.verify_block(*args), reference.verify_block(*args), strict=True):
        assert torch.equal(got, want)
    scores, offsets, rows = torch.randn(4, 300, generator=gen), torch.arange(4) * 1000, torch.arange(4)
    assert torch.equal(ops.gumbel_argmax(scores, None, 7, offsets, rows),
                       reference.gumbel_argmax(scores, None, 7, offsets, rows))
    from sglang_dflash.ops.testing import make_attention_inputs

    attn = make_attention_inputs(2, 4, 4, 2, 64, [10, 30], torch.float32, seed=2)
    assert torch.equal(ops.block_attention(**attn, block_size=4), reference.block_attention(**attn, block_size=4))


def test_tree_step_ops_fall_back_to_the_reference(fresh, monkeypatch):
    """move_slots and top_k_logprobs (a tree step's) after a failed self-test: the reference's results."""
    for op in ("move_slots", "top_k_logprobs"):
        _break(monkeypatch, op, "wrong")
    assert self_test.select(CPU, {op: CASES[op][:1] for op in ("move_slots", "top_k_logprobs")},
                            fallback="PyTorch") == set()
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(6))
    for got, want in zip(ops.top_k_logprobs(logits, 4), reference.top_k_logprobs(logits, 4), strict=True):
        assert torch.equal(got, want)
    buffers = [torch.randn(8, 4) for _ in range(2)]
    want = [b.clone() for b in buffers]
    reference.move_slots(want, torch.tensor([3, 1]), torch.tensor([1, 0]))
    ops.move_slots(buffers, torch.tensor([3, 1]), torch.tensor([1, 0]))
    assert all(torch.equal(b, w) for b, w in zip(buffers, want, strict=True))


def test_skinny_linear_falls_back_to_torch_linear(fresh, monkeypatch):
    from sglang_dflash.models.skinny import linear, skinny_applies

    x, w = torch.randn(2, 64), torch.randn(32, 64)
    assert skinny_applies(x, w)
    _break(monkeypatch, "skinny_linear", "wrong")
    assert self_test.select(CPU, {"skinny_linear": [torch.float32]}, fallback="PyTorch") == set()
    assert not skinny_applies(x, w)  # F.linear, not the float64 reference, in the models
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


def test_draft_model_falls_back_to_pytorch(fresh, monkeypatch):
    """A failed rms_norm_rope / materialize_context_kv leaves the draft model on its PyTorch math,
    not on the (slower) references."""
    from sglang_dflash.models.draft import RMSNorm
    from tests.dflash_testlib import random_draft, tiny_target

    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 64)
    fused = norm(x)
    for op in ("rms_norm_rope", "materialize_context_kv"):
        _break(monkeypatch, op, "wrong")
    plan = {"rms_norm_rope": [torch.float32], "materialize_context_kv": CASES["materialize_context_kv"][:1]}
    assert self_test.select(CPU, plan, fallback="PyTorch") == set()
    draft = random_draft(tiny_target())  # the target's own self-test runs the references: before the spy
    calls = []
    monkeypatch.setattr(reference, "rms_norm_rope", lambda *a, **k: calls.append("rms_norm_rope"))
    monkeypatch.setattr(reference, "materialize_context_kv", lambda *a, **k: calls.append("materialize_context_kv"))
    with torch.no_grad():
        plain = norm(x)
        draft.allocate_cache(64, 1, 64)
        draft.append_context([draft.cache.add_request()], [5], torch.randn(5, draft.fc.in_features))
        draft(torch.randn(8, draft.config.hidden_size), torch.tensor([0]), 8)
    assert not calls
    assert bool(draft.cache.k[:, draft.cache.req_to_token[0, :5]].abs().sum(-1).gt(0).all())  # written
    xf = x.float()
    assert torch.equal(plain, norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)))
    torch.testing.assert_close(plain, fused, rtol=1e-5, atol=1e-5)


def test_strict_mode_raises_and_changes_nothing(fresh, monkeypatch, caplog):
    _break(monkeypatch, "block_attention", "wrong")
    _break(monkeypatch, "verify_block", "raise")
    monkeypatch.setenv("SGLANG_DFLASH_STRICT", "1")
    plan = {op: CASES[op] for op in ("verify_block", "block_attention", "gumbel_argmax")}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(self_test.SelfTestError) as info:
            self_test.select(CPU, plan, fallback="SGLang's own path")
    message = str(info.value)
    assert message.startswith("sglang-dflash: kernel self-test failed on cpu: verify_block (torch.float32: raised ")
    assert "; block_attention (Attention(q_heads=4, kv_heads=2, head_dim=64, dtype=torch.float32" in message
    assert "x the tolerance 2e-05)" in message and "gumbel_argmax" not in message
    assert message.endswith("Unset SGLANG_DFLASH_STRICT to fall back to SGLang's own path for these ops.")
    assert not caplog.records and not ops._REFERENCE_ON


def test_engine_target_self_tests_on_construction(fresh, monkeypatch, caplog):
    from tests.dflash_testlib import tiny_target

    _break(monkeypatch, "gumbel_argmax", "raise")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tiny_target()
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and "self-test of gumbel_argmax on cpu failed" in warnings[0]
    assert not ops.runs_ours("gumbel_argmax", CPU) and ops.runs_ours("block_attention", CPU)
    # The tiny target's head layout (4 heads, 2 KV heads, head_dim 16) in every float dtype.
    assert ("block_attention", CPU, Attention(4, 2, 16, torch.bfloat16, 16)) in self_test._RESULTS
