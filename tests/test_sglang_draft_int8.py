"""The served drafter's weights in int8 (sglang_dflash/serving/draft_int8.py) and the batch-invariant
linear hook that runs them (sglang_dflash/serving/cpu.py), on the CPU. The linear layers are
stand-ins carrying SGLang's own `UnquantizedLinearMethod` (SGLang's parallel linear classes need
its tensor-parallel state); the served path end to end is tests/test_sglang_smollm2_server.py.

Skipped when SGLang is not installed."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang_cpu.sh VENV installs it beside the package)",
                allow_module_level=True)

# SGLang picks its platform when first imported: the CPU one, as the other SGLang unit tests need
# it (its RoPE, not vllm's), whichever test file imports SGLang first.
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod  # noqa: E402

from sglang_dflash.models.skinny import Int8Linear  # noqa: E402
from sglang_dflash.ops.testing import skinny_linear_error_ratio  # noqa: E402
from sglang_dflash.serving.cpu import _unquantized_linear_around  # noqa: E402
from sglang_dflash.serving.draft_int8 import ATTR, int8_wanted, int8_weight, quantize_draft_linears  # noqa: E402
from tests.dflash_testlib import int8_linear_is_right  # noqa: E402


class _Linear(nn.Module):
    """What the hook and quantize_draft_linears read of SGLang's linear layers."""

    def __init__(self, n, k, dtype, gen):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, k, generator=gen).to(dtype), requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()


def _drafter(dtype):
    gen = torch.Generator().manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(nn.ModuleDict({"qkv_proj": _Linear(48, 32, dtype, gen),
                                                "down_proj": _Linear(32, 40, dtype, gen),
                                                "norm": nn.LayerNorm(32)}) for _ in range(2))
    model.fc = nn.Linear(96, 32, bias=False).to(dtype)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_draft_linears_get_int8_copies_that_the_linear_hook_runs(dtype):
    model = _drafter(dtype)
    floats = {name: m.weight.clone() for name, m in model.layers.named_modules() if isinstance(m, _Linear)}
    assert quantize_draft_linears(model) == 2 * 2 + 1
    assert isinstance(model.fc, Int8Linear) and model.fc.in_features == 96
    layer = model.layers[0]["qkv_proj"]
    q, scale = int8_weight(layer)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    for name, m in model.layers.named_modules():  # the float weights stay (context K/V reads them)
        if isinstance(m, _Linear):
            assert torch.equal(m.weight, floats[name])
    assert int8_weight(model.layers[0]["norm"]) is None

    calls = []

    def original(method, layer, x, bias=None, *args, **kwargs):
        calls.append(args)
        return torch.nn.functional.linear(x, layer.weight, bias)

    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = _unquantized_linear_around(original, layer.quant_method, layer, x)
    assert not calls and out.dtype == dtype and out.shape == (3, 48)
    assert int8_linear_is_right(out, x, q, None, scale)  # the int8 weight, not the float one
    plain = _Linear(8, 32, dtype, torch.Generator().manual_seed(2))
    out = _unquantized_linear_around(original, plain.quant_method, plain, x)
    assert not calls and skinny_linear_error_ratio(out, x, plain.weight, None).max() <= 1  # no copy: float
    _unquantized_linear_around(original, layer.quant_method, layer, x, None, "extra")
    assert calls == [("extra",)]  # arguments the hook does not know: SGLang's path


def test_int8_is_on_by_default_on_the_cpu_only(monkeypatch):
    monkeypatch.delenv("SGLANG_DFLASH_DRAFT_INT8", raising=False)
    assert int8_wanted(torch.device("cpu")) and not int8_wanted(torch.device("meta"))
    monkeypatch.setenv("SGLANG_DFLASH_DRAFT_INT8", "0")
    assert not int8_wanted(torch.device("cpu"))
    assert ATTR == "sglang_dflash_int8"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hook_runs_bf16_prefills_in_bounded_row_counts_and_leaves_fp32_to_sglang(monkeypatch, dtype):
    layer = _Linear(40, 32, dtype, torch.Generator().manual_seed(3))
    x = torch.randn(77, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    calls, rows = [], []
    real = torch.nn.functional.linear

    def original(method, layer, x, bias=None, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, layer.weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: rows.append(x.shape[0]) or real(x, w, b))
    out = _unquantized_linear_around(original, layer.quant_method, layer, x)
    expected = real(x.float(), layer.weight.float())
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=2 ** -7 * expected.abs().max().item())
    if dtype == torch.bfloat16:
        assert not calls and rows == [96]  # 77 rows, padded to 96
    else:
        assert calls == [77]  # fp32 prefill: SGLang's own F.linear (MKL keeps no memory per shape)
