#!/usr/bin/env bash
# The non-editable route: builds a wheel of this checkout (`pip wheel`, the extension compiled
# against the torch of the build environment, which the wheel then pins), installs it into a fresh
# virtualenv with its dependencies, and smoke-tests it from outside the source tree: the extension
# loads, its CPU kernels agree with the pure-PyTorch reference, the shipped drafter and the GSM8K
# data are inside the package, and the CLI starts.
#
#   scripts/wheel_smoke.sh [BUILD_PYTHON]     (default: .venv/bin/python, which has torch and ninja)
#
# `make wheel-check` runs it. The wheel lands in dist/.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_PY=${1:-.venv/bin/python}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/wheel_smoke.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS

echo "[wheel_smoke] building the wheel with $BUILD_PY"
rm -f dist/sglang_dflash-*.whl
"$BUILD_PY" -m pip wheel --no-deps --no-build-isolation -q -w dist .
wheel=$(ls dist/sglang_dflash-*.whl)
echo "[wheel_smoke] $wheel ($(du -h "$wheel" | cut -f1)), $((SECONDS - start)) s"

python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
echo "[wheel_smoke] installed into a fresh virtualenv, $((SECONDS - start)) s"

cd "$WORK"  # not the checkout: the installed package must stand alone
"$WORK/venv/bin/python" - <<'EOF'
import torch

import sglang_dflash
from sglang_dflash import ops
from sglang_dflash.data import gsm8k_path
from sglang_dflash.drafters import SHIPPED_DRAFTER, resolve_draft
from sglang_dflash.ops import reference

assert "site-packages" in sglang_dflash.__file__, sglang_dflash.__file__
gen = torch.Generator().manual_seed(0)
q, kv = torch.randn(4, 2, 64, generator=gen), torch.randn(4, 1, 64, generator=gen)
cache = torch.randn(10, 1, 64, generator=gen)
args = (q, kv, kv, cache, cache, torch.tensor([[0, 1, 2, 0]]), torch.tensor([0]), torch.tensor([3]), 4)
torch.testing.assert_close(ops.block_attention(*args), reference.block_attention(*args))
draft = resolve_draft(SHIPPED_DRAFTER)
assert (draft / "model.safetensors").is_file() and (draft / "config.json").is_file(), draft
assert gsm8k_path("test").is_file()
print(f"[wheel_smoke] block_attention equals its reference; drafter and data shipped; torch {torch.__version__}")
EOF
"$WORK/venv/bin/sglang-dflash" --help >/dev/null
echo "[wheel_smoke] passed in $((SECONDS - start)) s"
