"""Linear layers on the CPU through the `skinny_linear` kernel when few rows go through them.

A decode step feeds 1 row per request through every projection and a verify step B rows; there
the kernel reads each weight once instead of BLAS packing it, and it is batch invariant, so a
verify pass computes in its linear layers bit for bit what plain decoding computes token by
token. Larger inputs (prefill, training), other devices and autograd keep torch's own linear,
except inside `batch_invariant()`: the decode and verify steps run there, since BLAS blocks its
rows by their count and a block of more than MAX_ROWS rows (a large tree, a batch of requests)
would not compute what decoding its tokens one at a time computes (fp32: off by ~1e-5).

`bounded_rows_linear` runs torch's GEMM in few row counts, the input zero-padded up to them:
oneDNN's bf16 GEMM keeps memory for every row count it has run, so a server whose prefills come in
every length would grow without end (the plugin's served linear layers use it, serving/cpu.py).

`Int8Linear` holds its weight in int8 with one scale per row: a step that is bound by reading
weights reads half the bytes of bf16. On a CPU with AVX512-VNNI its activations are quantized to
int8 per row as well (`w8a8_linear`), since with fp32 arithmetic the int8 weights' conversions and
FMAs bound the drafter's step, not its bytes; elsewhere it is weight-only (`skinny_linear`). Only
drafts use it (a draft never changes the output, only how often it is accepted).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.ops import int8_dot_isa, runs_ours, skinny_linear, w8a8_linear

MAX_ROWS = 16  # above this the weight is reused enough for BLAS to win (fp32, bf16)
CHUNK_ROWS = 128  # rows of x per kernel call: 128 x 1536 fp32 values still fit in L2
W8A8_MAX_K = 131072  # w8a8_linear's largest K (its int32 sums)
GEMM_MIN_ROWS = 32  # the fewest rows bounded_rows_linear runs a GEMM at

_scope = threading.local()  # .batch_invariant: inside `batch_invariant()` on this thread


@contextlib.contextmanager
def batch_invariant():
    """Within it, inputs of every row count take the kernel (CHUNK_ROWS rows a call), so each
    row's output is bit for bit the one it gets alone: for decode and verify steps, whose rows must
    compute what decoding them one at a time would, however many there are."""
    outer = getattr(_scope, "batch_invariant", False)
    _scope.batch_invariant = True
    try:
        yield
    finally:
        _scope.batch_invariant = outer


def _few_enough_rows(x: torch.Tensor) -> bool:
    # fp16 always takes the kernel: torch's CPU fp16 GEMM has no fp16 arithmetic on AVX2 and is
    # behind skinny_linear at the row counts of decode and verify steps (SmolLM2's shapes in
    # bench/results/cpu_ops.json; at 32 rows there the kernel is the slower).
    return (x.dtype == torch.float16 or x.numel() <= MAX_ROWS * x.shape[-1]
            or getattr(_scope, "batch_invariant", False))


def skinny_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   weight_scale: torch.Tensor | None = None) -> bool:
    """Whether `skinny_linear(x, weight, bias, weight_scale)` may replace F.linear: few rows (any
    number in fp16 or with an int8 weight) on the CPU, one float dtype (or an int8 weight with its
    scales), a weight with contiguous rows, nothing that needs autograd, and a kernel that passed
    its self-test (else F.linear, not the slow float64 reference)."""
    quantized = weight_scale is not None
    return (x.device.type == "cpu" and (quantized or _few_enough_rows(x))
            and weight.dtype == (torch.int8 if quantized else x.dtype)
            and weight.dim() == 2 and weight.stride(-1) == 1 and weight.device.type == "cpu"
            and (bias is None or (bias.dtype == x.dtype and bias.device.type == "cpu"))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and runs_ours("skinny_linear", "cpu"))


def _in_chunks(kernel, x: torch.Tensor, n: int) -> torch.Tensor:
    """kernel(rows of x) -> [rows, n], CHUNK_ROWS rows of x at a time: the kernels keep x (in fp32
    or int8) in cache while they stream the weight, which only holds for a bounded number of rows
    (a prefill)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows <= CHUNK_ROWS:
        return kernel(x)
    flat = x.reshape(rows, x.shape[-1])
    return torch.cat([kernel(chunk) for chunk in flat.split(CHUNK_ROWS)]).view(*x.shape[:-1], n)


def skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """skinny_linear, CHUNK_ROWS rows of x at a time (`_in_chunks`)."""
    return _in_chunks(lambda rows: skinny_linear(rows, weight, bias, weight_scale), x, weight.shape[0])


@functools.cache
def _vnni() -> bool:
    return int8_dot_isa() in ("avx512_vnni", "amx_int8")  # AMX-INT8 CPUs have VNNI too


def w8a8_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None) -> bool:
    """Whether an int8 weight takes `w8a8_linear` (activations quantized per row too): where
    skinny_linear would take it and the CPU has AVX512-VNNI (or AMX-INT8), where it is the faster
    of the two at the drafter's shapes (bench/results/cpu_ops.json). Without VNNI its portable
    loops would be slower than skinny_linear's fp32 path, which the weight keeps there."""
    return (weight_scale is not None and skinny_applies(x, weight, bias, weight_scale)
            and x.shape[-1] <= W8A8_MAX_K and _vnni() and runs_ours("w8a8_linear", "cpu"))


def gemm_rows_bounded(x: torch.Tensor) -> bool:
    """Whether the served linear hook runs F.linear on `x` through bounded_rows_linear: bf16 on the
    CPU, where oneDNN takes it. fp32 goes to MKL, which stayed flat over every row count we tried,
    and fp16 takes skinny_linear."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu"


def gemm_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at in bounded_rows_linear: the smallest of 32, 48,
    64, 96, 128, 192, ... (2^j and 3 * 2^(j-1)) that holds them, so beyond 32 rows less than a third
    of its rows are padding, and inputs of up to N rows meet about 2 log2(N / 32) row counts."""
    if rows <= GEMM_MIN_ROWS:
        return GEMM_MIN_ROWS
    power = 1 << (rows - 1).bit_length()
    return power * 3 // 4 if power * 3 // 4 >= rows else power


def bounded_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) in one GEMM of gemm_rows(rows of x) rows: x zero-padded to that
    many, the padding's output rows dropped. Each output row is still that row's linear; only the
    memory the GEMM library keeps per row count is bounded (bench/linear_memory.py measures it)."""
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // k if k else 0
    if rows == 0:
        return F.linear(x, weight, bias)
    padded = gemm_rows(rows)
    source = x.reshape(rows, k)
    if padded != rows:  # one copy of the rows into a zeroed buffer
        source = x.new_zeros(padded, k)
        source[:rows] = x.reshape(rows, k)
    return F.linear(source, weight, bias)[:rows].view(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through w8a8_linear or skinny_linear where that is faster and allowed; an int8
    weight with its row scales elsewhere is dequantized for F.linear."""
    if w8a8_applies(x, weight, bias, weight_scale):
        return _in_chunks(lambda rows: w8a8_linear(rows, weight, weight_scale, bias), x, weight.shape[0])
    if skinny_applies(x, weight, bias, weight_scale):
        return skinny(x, weight, bias, weight_scale)
    if weight_scale is not None:
        weight = (weight.float() * weight_scale[:, None]).to(x.dtype)
    return F.linear(x, weight, bias)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: scale = max |row| / 127 (1 for an all-zero row), q = round(row / scale).
    Returns (int8 [N, K], float32 [N]); q * scale is within scale / 2 of every weight."""
    w = weight.detach().float()
    if w.dim() != 2 or not bool(torch.isfinite(w).all()):
        raise ValueError(f"quantize_rows: needs a finite 2-D weight, got shape {tuple(w.shape)}")
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight and one fp32 scale per output row (`quantize_rows`), bias
    and activations in a float dtype; inference only. On the CPU every input takes skinny_linear
    (torch has no int8-weight GEMM for float inputs), elsewhere the weight is dequantized."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        weight, scale = quantize_rows(layer.weight)
        self.register_buffer("weight", weight.to(layer.weight.device))
        self.register_buffer("weight_scale", scale.to(layer.weight.device))
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale)


class SkinnyLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_skinny_linear(model: nn.Module) -> int:
    """Turn every plain nn.Linear of `model` into a SkinnyLinear; returns how many.

    The modules change class in place rather than being replaced, so parameters (the LM head
    tied to the embedding included), hooks and every reference to them stay as they were."""
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SkinnyLinear
            swapped += 1
    return swapped
