"""Every environment switch of sglang-dflash, declared once: its name, type, default and effect.

Python reads a switch through `get(name)`, the C++ kernels through `env_flag` in
csrc/include/sglang_dflash/env.h, both with the same words: a boolean is 1, true, yes or on, or
0, false, no or off (any case, surrounding spaces ignored); unset or empty means the default; any
other value is an error naming the variable. setup.py cannot import the package, so it parses
the build-time switches itself; they are listed here so that the table in docs/serving.md, which
this module writes, is complete:

    python -m sglang_dflash.settings --write-docs   rewrite the table in docs/serving.md
    python -m sglang_dflash.settings --check        exit 1 when the table there differs

Standard library only: the SGLang plugin, which must stay import-light, reads its switches here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# When a switch is read: by the Python package at run time, by the C++ kernels once per process
# at their first call, or by setup.py when the extension is built.
RUN, KERNEL, BUILD = "run time", "kernels, once per process", "build (setup.py)"


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    type: type  # bool, int or str
    default: bool | int | str | None  # None: the reader decides, as `default_doc` says
    doc: str  # one line: what it does
    read: str = RUN
    default_doc: str = ""  # the default in words, where it is not a plain value


DISABLE = Setting(
    "SGLANG_DFLASH_DISABLE", bool, False,
    "the plugin registers nothing; DFLASH runs SGLang's own worker (and is refused on CPU), and SGLang's own "
    "speculative algorithms on a stock CPU install fail as without the plugin (docs/serving.md)")
STRICT = Setting(
    "SGLANG_DFLASH_STRICT", bool, False,
    "an SGLang this package was not checked against, a missing seam, or an extension that does not load raises "
    "`IncompatibleSGLangError` when the worker is created, and a kernel that fails its start-up self-test raises "
    "`SelfTestError` (the server refuses to start); off: the plugin warns and SGLang's own worker runs, or that op "
    "runs SGLang's own path")
DRAFT_ATTENTION = Setting(
    "SGLANG_DFLASH_DRAFT_ATTENTION", bool, None,
    "the draft layers' TARGET_VERIFY attention and context-K/V writes run our kernels; off: SGLang's",
    default_doc="on on CPU; on a GPU, each where the committed kernel benchmark of its GPU class shows it "
                "faster than SGLang's path (`ops/gpu_defaults.py`, [gpu](gpu.md))")
ADAPTIVE = Setting(
    "SGLANG_DFLASH_ADAPTIVE", bool, True,
    "each decode step picks its block size B in 1..the server's (`--speculative-dflash-block-size`, else the "
    "drafter's); off pins it (CPU only: on GPUs the CUDA graphs are captured per block size)")
TREE_BUDGET = Setting(
    "SGLANG_DFLASH_TREE_BUDGET", int, None,
    "`n` in 1..B - 1: decode steps may verify a draft tree of n drafted tokens instead of a chain; `0`: chains only",
    default_doc="trees of up to 15 nodes, cut to B - 1, where the block size adapts (CPU); else 0")
TREE_TOPK = Setting(
    "SGLANG_DFLASH_TREE_TOPK", int, 4,
    "the drafter's choices per block position the trees grow from (at most 64)")
BATCH_INVARIANT = Setting(
    "SGLANG_DFLASH_BATCH_INVARIANT", bool, True,
    "CPU linear layers, the LM head, and decode and prefill attention run our batch-invariant kernels, so greedy "
    "DFLASH output equals plain decoding's (plain CPU serving uses them too); off: SGLang's")
DRAFT_INT8 = Setting(
    "SGLANG_DFLASH_DRAFT_INT8", bool, True,
    "on CPU the drafter's linear layers, `fc` and draft LM head run int8 weights with one scale per row (activations "
    "int8 per row too on AVX512-VNNI CPUs; needs the batch-invariant hooks); off: the model's dtype")
CACHE = Setting(
    "SGLANG_DFLASH_CACHE", str, None,
    "where packaged models are converted",
    default_doc="`~/.cache/sglang_dflash`")
NO_AVX512 = Setting(
    "SGLANG_DFLASH_NO_AVX512", bool, False,
    "keeps the CPU kernels on AVX2 where the CPU has AVX-512", read=KERNEL)
NO_VNNI = Setting(
    "SGLANG_DFLASH_NO_VNNI", bool, False,
    "keeps `w8a8_linear` on its portable loops where the CPU has AVX512-VNNI", read=KERNEL)
NO_AMX = Setting(
    "SGLANG_DFLASH_NO_AMX", bool, False,
    "keeps the CPU kernels off AMX tiles (AVX-512 FMA or VNNI instead)", read=KERNEL)
ATTN_SPLITS = Setting(
    "SGLANG_DFLASH_ATTN_SPLITS", int, None,
    "`n` > 0 makes `block_attention`'s CUDA kernel split each request's keys n ways (tuning and tests)",
    read=KERNEL, default_doc="chosen per shape")
CUDA = Setting(
    "SGLANG_DFLASH_CUDA", bool, None,
    "builds the CUDA kernels too (the build fails if it cannot); off: the CPU kernels only",
    read=BUILD, default_doc="on where a GPU is visible and nvcc is found")
DEBUG = Setting(
    "SGLANG_DFLASH_DEBUG", bool, False,
    "a failed device-side index check prints and traps instead of being recorded for `check_device_errors`; "
    "the C++ kernels keep their debug information (-g)",
    read=BUILD)

SETTINGS = (DISABLE, STRICT, DRAFT_ATTENTION, ADAPTIVE, TREE_BUDGET, TREE_TOPK, BATCH_INVARIANT, DRAFT_INT8, CACHE,
            NO_AVX512, NO_VNNI, NO_AMX, ATTN_SPLITS, CUDA, DEBUG)


def parse(spec: Setting, raw: str | None):
    """The value of `spec` for the environment text `raw` (None: unset). Raises ValueError naming
    the variable for a value its type does not take."""
    text = "" if raw is None else raw.strip()
    if text == "":
        return spec.default
    if spec.type is bool:
        if text.lower() in TRUE_WORDS:
            return True
        if text.lower() in FALSE_WORDS:
            return False
        raise ValueError(f"{spec.name}={raw!r}: expected {', '.join(TRUE_WORDS)} (on) or "
                         f"{', '.join(FALSE_WORDS)} (off)")
    if spec.type is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{spec.name}={raw!r}: expected an integer") from None
    return text


def get(spec: Setting):
    """The value of `spec` in this process's environment (its default where unset or empty)."""
    if spec.read == BUILD:
        raise ValueError(f"{spec.name} is read by setup.py when the extension is built, not at run time")
    return parse(spec, os.environ.get(spec.name))


def is_set(spec: Setting) -> bool:
    """Whether the environment gives `spec` a value (it is neither unset nor empty)."""
    return os.environ.get(spec.name, "").strip() != ""


def runtime_names() -> list[str]:
    """The switches read while the package runs (in Python or in the kernels), not when it is built."""
    return [s.name for s in SETTINGS if s.read != BUILD]


# -- the table in docs/serving.md -----------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def _default_cell(spec: Setting) -> str:
    if spec.default is None:
        return spec.default_doc
    if spec.type is bool:
        return "on" if spec.default else "off"
    return f"`{spec.default}`"


def docs_table() -> str:
    """The settings table of docs/serving.md, from SETTINGS."""
    rows = ["| variable | type | default | read at | effect |", "| --- | --- | --- | --- | --- |"]
    for s in SETTINGS:
        kind = "on/off" if s.type is bool else s.type.__name__
        rows.append(f"| `{s.name}` | {kind} | {_default_cell(s)} | {s.read} | {s.doc} |")
    return "\n".join(rows)


def with_table(text: str, path: Path) -> str:
    """`text` with its settings table replaced by `docs_table()`."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{path}: needs exactly one {BEGIN} ... {END} pair, in that order")
    head, rest = text.split(BEGIN)
    return f"{head}{BEGIN}\n{docs_table()}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_dflash.settings", description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write-docs", action="store_true", help=f"rewrite the settings table in {DOCS}")
    action.add_argument("--check", action="store_true", help="exit 1 when the table there differs")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the document holding the table")
    args = parser.parse_args(argv)
    text = args.docs.read_text()
    wanted = with_table(text, args.docs)
    if args.check:
        if wanted != text:
            print(f"{args.docs}: the settings table differs from sglang_dflash/settings.py; run "
                  "python -m sglang_dflash.settings --write-docs", file=sys.stderr)
            return 1
        return 0
    if wanted != text:
        args.docs.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
