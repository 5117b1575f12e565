#!/usr/bin/env bash
# Lightest install of SGLang 0.5.23 that imports and serves on a CPU-only Linux machine, beside
# sglang-dflash, in the virtualenv given as the first argument (created if missing).
#
#   scripts/install_sglang_cpu.sh VENV
#
# What it does (idempotent: each step is skipped when already done):
#   1. creates VENV if missing; installs torch ($TORCH_SPEC, default torch==2.14.1, the version
#      SGLang 0.5.23 pins and our extension is built against) only when VENV has no torch;
#   2. `pip install --no-deps sglang==0.5.23` (the full dependency set is ~11 GB of CUDA wheels);
#   3. `pip install --no-deps` of a frozen list of the pure runtime dependencies SGLang needs to
#      import and serve on CPU (found by iterating on import errors). A package that
#      VENV already has is kept at its installed version (so the project's own environment is not
#      downgraded), except the few that SGLang pins exactly, which are forced to its pin;
#   4. the torchvision matching the installed torch, `--no-deps` (SGLang imports
#      torchvision.transforms while it loads its model configs);
#   5. a pure-Python stand-in for `sgl_kernel` (the PyPI sglang-kernel is a 373 MB CUDA build that
#      needs libcuda.so.1 to load), for what plain SGLang needs on a box without CUDA: the one
#      `*_cpu` op its allocation calls, in plain torch; the speculative-path ops forward to
#      torch.ops.sgl_kernel as the real wheel does (sglang-dflash's plugin registers them there, as
#      it does on a stock `pip install sglang`); every other name (and every
#      `sgl_kernel.<submodule>`) is a placeholder that raises NotImplementedError when called. A
#      real sgl_kernel already in VENV is left alone.
#   6. `pip install --no-deps sglang-router==0.3.2`, SGLang's router (its dependencies are in the
#      list of step 3), for several servers behind one address.
#
# Nothing of SGLang is edited. The stand-ins are written by this script into VENV only.
# Run SGLang on CPU with SGLANG_USE_CPU_ENGINE=1 (see docs/serving.md). NEVER use this on a GPU
# machine: there, `pip install "sglang==0.5.23"` gives the real CUDA stack.
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 VENV" >&2
  exit 2
fi
VENV=$1
SGLANG_VERSION=0.5.23
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
PYTHON=${PYTHON:-python3}
start=$SECONDS

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install_sglang_cpu] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

# 1. torch
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install_sglang_cpu] installing $TORCH_SPEC"
  "${PIP[@]}" "$TORCH_SPEC"
fi

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    && [ "${SGLANG_DFLASH_FORCE_CPU_INSTALL:-0}" != 1 ]; then
  echo "[install_sglang_cpu] this machine has a CUDA GPU: install SGLang with" \
       "'pip install sglang==0.5.23' instead (SGLANG_DFLASH_FORCE_CPU_INSTALL=1 overrides)" >&2
  exit 1
fi

# 2. sglang itself, without its dependency set
have_sglang=$("$PY" - "$SGLANG_VERSION" <<'EOF'
import sys
from importlib import metadata
try:
    print(int(metadata.version("sglang") == sys.argv[1]))
except metadata.PackageNotFoundError:
    print(0)
EOF
)
if [ "$have_sglang" != 1 ]; then
  echo "[install_sglang_cpu] installing sglang==$SGLANG_VERSION --no-deps (this script usually takes under a minute)"
  "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
fi

# 3. the runtime dependencies (frozen: found by iterating on import errors, then verified by
#    serving a model on CPU)
PINS=$(cat <<'EOF'
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
apache-tvm-ffi==0.1.11
asttokens==3.0.2
attrs==26.1.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
click==8.5.1
compressed-tensors==0.18.0
dill==0.4.1
distro==1.9.0
einops==0.8.2
executing==2.3.0
fastapi==0.165.0
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
gguf==0.19.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpx==0.28.1
huggingface_hub==1.33.0
idna==3.20
ipython==9.18.1
ipython_pygments_lexers==1.1.1
jedi==0.20.1
Jinja2==3.1.6
jiter==0.19.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
loguru==0.7.3
markdown-it-py==4.3.0
MarkupSafe==3.0.4
matplotlib-inline==0.2.2
mdurl==0.1.2
mpmath==1.3.0
msgspec==0.23.0
multidict==7.2.1
networkx==3.6.1
ninja==1.13.2
numpy==2.4.6
openai==2.8.0
opentelemetry-api==1.45.2
orjson==3.13.0
packaging==26.4
parso==0.8.7
partial-json-parser==0.2.1.1.post7
pexpect==4.9.0
pillow==13.0.0
prompt_toolkit==3.0.53
propcache==0.5.4
psutil==7.2.2
ptyprocess==0.7.0
pure_eval==0.2.4
pybase64==1.5.1
pycparser==3.12
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
python-multipart==0.0.34
PyYAML==6.0.4
pyzmq==27.3.0
referencing==0.37.0
regex==2026.11.19
requests==2.34.2
rich==15.0.0
rpds-py==2026.9.1
safetensors==0.8.0
scipy==1.17.1
sentencepiece==0.2.1
setproctitle==1.3.8
shellingham==1.5.4
sniffio==1.3.1
soundfile==0.13.1
stack-data==0.6.3
starlette==1.10.0
sympy==1.14.0
tokenizers==0.23.2
tqdm==4.70.1
traitlets==5.16.1
transformers==5.19.0
triton==3.8.0
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
uvicorn==0.54.0
uvloop==0.23.0
wcwidth==0.9.4
xgrammar==0.2.7
yarl==1.25.1
EOF
)
# SGLang 0.5.23 pins these exactly (its METADATA); they are installed at the pin even when VENV has
# another version.
EXACT="apache-tvm-ffi compressed-tensors openai sentencepiece soundfile tokenizers transformers xgrammar"

todo=$(PINS="$PINS" EXACT="$EXACT" "$PY" - <<'EOF'
import os
import re
import sys
from importlib import metadata

exact = set(os.environ["EXACT"].split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
exact = {norm(n) for n in exact}
kept = []
for line in os.environ["PINS"].split():
    name, _, want = line.partition("==")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        print(line)
        continue
    if have == want:
        continue
    if norm(name) in exact:
        print(line)
    else:
        kept.append(f"{name} {have} (list: {want})")
if kept:
    print("[install_sglang_cpu] kept installed versions: " + ", ".join(kept), file=sys.stderr)
EOF
)
if [ -n "$todo" ]; then
  echo "[install_sglang_cpu] installing $(printf '%s\n' "$todo" | wc -l) pinned packages --no-deps"
  # shellcheck disable=SC2086
  "${PIP[@]}" --no-deps $todo
fi

# 4. torchvision matching torch (a CUDA torch gets its CUDA torchvision; both load without a GPU)
tv=$("$PY" - <<'EOF'
import torch
from importlib import metadata
match = {"2.14": "0.29.1", "2.13": "0.28.0", "2.12": "0.27.0"}
want = match.get(".".join(torch.__version__.split("+")[0].split(".")[:2]))
try:
    have = metadata.version("torchvision")
except metadata.PackageNotFoundError:
    have = None
print("" if (want is None or (have or "").split("+")[0] == want) else want)
EOF
)
if [ -n "$tv" ]; then
  echo "[install_sglang_cpu] installing torchvision==$tv --no-deps"
  "${PIP[@]}" --no-deps "torchvision==$tv"
fi

# 5. the sgl_kernel stand-in
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ -d "$SITE/sgl_kernel" ] && ! grep -q SGLANG_DFLASH_STANDIN "$SITE/sgl_kernel/__init__.py" 2>/dev/null; then
  echo "[install_sglang_cpu] a real sgl_kernel is installed; leaving it alone"
else
  mkdir -p "$SITE/sgl_kernel"
  cat > "$SITE/sgl_kernel/__init__.py" <<'EOF'
"""Stand-in for sgl_kernel on a CPU-only machine (written by sglang-dflash's
scripts/install_sglang_cpu.sh; SGLANG_DFLASH_STANDIN). Not SGLang code.

SGLang's CPU path imports a few `*_cpu` ops from `sgl_kernel` (a CPU build of sgl-kernel provides
them as C++ kernels). This module gives plain SGLang what it calls (assign_req_to_token_pool_cpu,
in plain torch); the speculative-path ops forward to torch.ops.sgl_kernel as the real wheel's
wrappers do, where sglang-dflash's plugin registers them. Any other name, and any
`sgl_kernel.<submodule>`, resolves to a placeholder that raises NotImplementedError when called,
so that modules which merely import it still load.
"""

import importlib.abc
import importlib.machinery
import sys
import types

import torch

__version__ = "0.0.0+sglang-dflash-standin"
SGLANG_DFLASH_STANDIN = True


def _forward(name):
    """As the real sgl_kernel wrappers do: call torch.ops.sgl_kernel.<name>. sglang-dflash's plugin
    registers these speculative-path ops there on CPU servers (sglang_dflash/serving/sgl_kernel_ops.py);
    without the plugin SGLang refuses DFLASH on CPU anyway."""

    def op(*args, **kwargs):
        return getattr(torch.ops.sgl_kernel, name)(*args, **kwargs)

    op.__name__ = name
    return op


copy_all_layer_kv_cache_cpu = _forward("copy_all_layer_kv_cache_cpu")
assign_extend_cache_locs_cpu = _forward("assign_extend_cache_locs_cpu")
verify_tree_greedy_cpu = _forward("verify_tree_greedy_cpu")
fill_accept_out_cache_loc_cpu = _forward("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _forward("fill_bonus_tokens_cpu")
# Wrappers of the real wheel's submodules that forward the same way (NGRAM calls this one on CPU).
_SUBMODULE_FORWARDS = {"speculative": ("reconstruct_indices_from_tree_mask",)}


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len=None):
    """req_to_token[req[i], start[i]:end[i]] = out_cache_loc[packed range of request i] (plain
    SGLang's allocation calls this one, so it works without the plugin)."""
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        if e > s:
            req_to_token[r, s:e] = out_cache_loc[pos : pos + e - s].to(req_to_token.dtype)
            pos += e - s


class _Missing:
    """What any name the stand-in lacks resolves to: attribute access gives another placeholder
    (module-level code such as `scalar_types.uint4b8` still loads), calling it raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._name} is not available: this is sglang-dflash's CPU stand-in for "
            "sgl_kernel (scripts/install_sglang_cpu.sh), not the real package"
        )

    def __repr__(self):
        return f"<sgl_kernel stand-in placeholder {self._name}>"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"sgl_kernel.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any `sgl_kernel.<sub>` module: its _SUBMODULE_FORWARDS, every other name a placeholder."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr, _n=spec.name: (
            _Missing(f"{_n}.{attr}") if not attr.startswith("__") else _raise_attribute_error(attr)
        )
        for name in _SUBMODULE_FORWARDS.get(spec.name[len(__name__) + 1:], ()):
            setattr(module, name, _forward(name))
        return module

    def exec_module(self, module):
        pass


def _raise_attribute_error(attr):
    raise AttributeError(attr)


if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.append(_SubmoduleFinder())
EOF
fi

# 6. SGLang's router, for several servers behind one address (pure dependencies: in the list above)
ROUTER_SPEC=sglang-router==0.3.2
if ! "$PY" -c "import sglang_router" >/dev/null 2>&1; then
  echo "[install_sglang_cpu] installing $ROUTER_SPEC --no-deps"
  "${PIP[@]}" --no-deps "$ROUTER_SPEC"
fi

# check
"$PY" - <<'EOF'
import sglang
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: F401
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: F401
print(f"[install_sglang_cpu] sglang {sglang.__version__} imports")
EOF
echo "[install_sglang_cpu] done in $((SECONDS - start)) s; $VENV is $(du -sh "$VENV" | cut -f1)"
