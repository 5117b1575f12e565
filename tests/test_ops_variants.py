"""sglang_dflash.ops.variants: listing and selecting kernel variants, and the tuned choice per call.
(Each CUDA variant against the spec: tests/test_cuda_ops.py.)"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash._extension import has_cuda_kernels
from sglang_dflash.ops import variants
from sglang_dflash.ops.testing import make_attention_inputs


@pytest.mark.parametrize("op", variants.OPS)
def test_default_first_and_the_cpu_build_lists_it_alone(op):
    names = variants.kernel_variants(op)
    assert names[0] == "default" and len(set(names)) == len(names)
    if not has_cuda_kernels():
        assert names == ["default"]
    assert variants.selected_variant(op) == "default"


def test_unknown_names_raise_value_errors_naming_the_valid_ones():
    valid = ", ".join(f'"{n}"' for n in variants.kernel_variants("block_attention"))
    with pytest.raises(ValueError, match=f'no kernel variant "k1s1w1" in this build; its variants: {valid}$'):
        with variants.using_variant("block_attention", "k1s1w1"):
            pass
    assert variants.selected_variant("block_attention") == "default"
    with pytest.raises(ValueError, match="no op named 'gemm' has kernel variants; ops with variants: "
                                         "block_attention, verify_block"):
        variants.kernel_variants("gemm")
    with pytest.raises(ValueError, match="no op named"):
        torch.ops.sglang_dflash.kernel_variants("gemm")


@pytest.mark.parametrize("op", variants.OPS)
def test_scopes_nest_restore_and_belong_to_their_thread(op):
    names = variants.kernel_variants(op)
    last = names[-1]
    seen_by_other_thread = []
    with variants.using_variant(op, last):
        assert variants.selected_variant(op) == last
        other = threading.Thread(target=lambda: seen_by_other_thread.append(variants.selected_variant(op)))
        other.start()
        other.join()
        with variants.using_variant(op, "default"):
            assert variants.selected_variant(op) == "default"
        assert variants.selected_variant(op) == last
        with pytest.raises(RuntimeError), variants.using_variant(op, names[0]):
            raise RuntimeError("the scope restores on an exception")
        assert variants.selected_variant(op) == last
    assert variants.selected_variant(op) == "default"
    assert seen_by_other_thread == ["default"]


def test_cpu_calls_ignore_the_selected_variant():
    """A CUDA-only variant selected around a CPU call is no error: the CPU kernel has one configuration."""
    args = make_attention_inputs(2, 4, 4, 2, 64, [30, 7], torch.bfloat16, seed=1)
    plain = ops.block_attention(**args, block_size=4)
    with variants.using_variant("block_attention", variants.kernel_variants("block_attention")[-1]):
        assert torch.equal(ops.block_attention(**args, block_size=4), plain)


def test_tuned_table_covers_every_gpu_and_shape_class():
    for op in variants.OPS:
        gpus = {gpu for gpu, _ in variants.TUNED[op]}
        assert set(variants.TUNED[op]) == {(g, s) for g in gpus for s in variants.SHAPE_CLASSES[op]}
        assert {"sm80", "sm90"} <= gpus
        if has_cuda_kernels():
            assert set(variants.TUNED[op].values()) <= set(variants.kernel_variants(op))


@pytest.mark.parametrize("op,batch,expected", [
    ("block_attention", 1, "bs1-8"), ("block_attention", 8, "bs1-8"), ("block_attention", 9, "bs9-32"),
    ("block_attention", 33, "bs33+"), ("verify_block", 64, "rows1-64"), ("verify_block", 65, "rows65+"),
])
def test_shape_classes(op, batch, expected):
    assert variants.shape_class(op, batch=batch) == expected
    assert expected in variants.SHAPE_CLASSES[op]


def test_for_call_is_free_while_everything_is_default(monkeypatch):
    """With "default" everywhere the per-call scope asks nothing (not the GPU, not the selection)."""
    def fail(*_):
        raise AssertionError("looked up")

    monkeypatch.setattr(variants, "selected_variant", fail)
    monkeypatch.setattr(variants, "gpu_class", fail)
    assert isinstance(variants.for_call("block_attention", torch.device("cuda", 0), 4), contextlib.nullcontext)


def test_for_call_applies_the_tuned_choice_unless_a_scope_chose(monkeypatch):
    used = []
    monkeypatch.setitem(variants.TUNED, "block_attention",
                        {**variants.TUNED["block_attention"], ("sm90", "bs1-8"): "k64s3w4"})
    monkeypatch.setitem(variants._ANY_TUNED, "block_attention", True)
    monkeypatch.setattr(variants, "gpu_class", lambda device: "sm90")
    monkeypatch.setattr(variants, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(variants, "using_variant", lambda op, name: used.append((op, name)) or contextlib.nullcontext())
    cuda = torch.device("cuda", 0)
    variants.for_call("block_attention", cuda, 4)
    assert used == [("block_attention", "k64s3w4")]
    assert isinstance(variants.for_call("block_attention", cuda, 9), contextlib.nullcontext)  # bs9-32: default
    assert isinstance(variants.for_call("block_attention", torch.device("cpu"), 4), contextlib.nullcontext)
    monkeypatch.setattr(variants, "selected_variant", lambda op: "k32s4w4")  # the thread chose: it wins
    assert isinstance(variants.for_call("block_attention", cuda, 4), contextlib.nullcontext)
    assert used == [("block_attention", "k64s3w4")]
