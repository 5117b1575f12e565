"""The settings registry (sglang_dflash/settings.py): one parser whose words the C++ kernels share,
every switch the source reads declared there and read through it, and the docs table written
from it."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_dflash import settings
from sglang_dflash.control.tree import DEFAULT_TREE_BUDGET, MAX_TREE_TOPK

ROOT = Path(__file__).resolve().parents[1]
SWITCH = re.compile(r"\bSGLANG_DFLASH_[A-Z0-9_]*[A-Z0-9]\b")
# Compile-time macros of the extension, not environment switches.
MACROS = {"SGLANG_DFLASH_WITH_CUDA", "SGLANG_DFLASH_DEVICE_TRAP"}
FLAG = settings.NO_AMX  # a kernel switch, for the words both parsers take
WORDS = ["1", "true", "TRUE", " Yes ", "on", "0", "false", "No", " off\n", "", "   ", "2", "y", "enabled", "-1", "0x1"]


def source_files() -> list[Path]:
    files = [ROOT / "setup.py", *sorted((ROOT / "sglang_dflash").rglob("*.py"))]
    return files + sorted(p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh"))


def python_value(raw: str | None) -> str:
    try:
        return repr(settings.parse(FLAG, raw))
    except ValueError as exc:
        return f"error: {exc}"


def test_booleans_take_the_same_words_in_every_case_and_nothing_else():
    for raw in ("1", "true", "TRUE", " Yes ", "on"):
        assert settings.parse(FLAG, raw) is True, raw
    for raw in ("0", "false", "No", " off\n"):
        assert settings.parse(FLAG, raw) is False, raw
    for raw in (None, "", "   "):
        assert settings.parse(FLAG, raw) is FLAG.default
    assert settings.parse(settings.ADAPTIVE, None) is True
    for raw in ("2", "y", "enabled"):
        with pytest.raises(ValueError, match=rf"SGLANG_DFLASH_NO_AMX='{raw}': expected 1, true, yes, on \(on\) "
                                             r"or 0, false, no, off \(off\)"):
            settings.parse(FLAG, raw)


def test_integers_and_the_environment(monkeypatch):
    assert settings.parse(settings.TREE_TOPK, " 7 ") == 7 and settings.parse(settings.TREE_TOPK, None) == 4
    assert settings.parse(settings.TREE_BUDGET, "") is None  # the reader decides
    with pytest.raises(ValueError, match=r"SGLANG_DFLASH_TREE_TOPK='4.5': expected an integer"):
        settings.parse(settings.TREE_TOPK, "4.5")
    monkeypatch.setenv(settings.DRAFT_INT8.name, "off")
    assert settings.get(settings.DRAFT_INT8) is False and settings.is_set(settings.DRAFT_INT8)
    monkeypatch.setenv(settings.DRAFT_INT8.name, " ")
    assert settings.get(settings.DRAFT_INT8) is True and not settings.is_set(settings.DRAFT_INT8)
    monkeypatch.setenv(settings.CACHE.name, "/tmp/x")
    assert settings.get(settings.CACHE) == "/tmp/x"
    with pytest.raises(ValueError, match="SGLANG_DFLASH_CUDA is read by setup.py"):
        settings.get(settings.CUDA)


def test_the_kernels_read_booleans_with_the_same_words(tmp_path):
    """csrc/include/sglang_dflash/env.h's env_flag, compiled alone, against the Python parser on
    every word (unset too): the same value, or an error for the same inputs."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    program = tmp_path / "flag.cpp"
    program.write_text(
        '#include <cstdio>\n#include <stdexcept>\n#include "sglang_dflash/env.h"\n'
        "int main() {\n"
        "  try {\n"
        f'    std::printf("%s", sglang_dflash::env_flag("{FLAG.name}", false) ? "True" : "False");\n'
        '  } catch (const std::invalid_argument& e) { std::printf("error: %s", e.what()); }\n'
        "}\n")
    binary = tmp_path / "flag"
    subprocess.run([cxx, "-std=c++17", "-I", str(ROOT / "csrc" / "include"), str(program), "-o", str(binary)],
                   check=True)
    env = {k: v for k, v in os.environ.items() if k != FLAG.name}
    for raw in [None, *WORDS]:
        run_env = env if raw is None else dict(env, **{FLAG.name: raw})
        got = subprocess.run([str(binary)], env=run_env, capture_output=True, text=True, check=True).stdout
        want = python_value(raw)
        if want.startswith("error"):
            assert got.startswith(f"error: {FLAG.name}='{raw}': expected 1, true, yes, on (on)"), (raw, got)
        else:
            assert got == want, (raw, got)


def test_every_switch_the_source_names_is_declared_and_every_declared_one_is_read():
    named: dict[str, set[str]] = {}  # switch -> the files naming it
    for path in source_files():
        for name in SWITCH.findall(path.read_text(errors="replace")):
            named.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    declared = {s.name for s in settings.SETTINGS}
    undeclared = {name: sorted(paths) for name, paths in named.items() if name not in declared | MACROS}
    assert not undeclared, f"switches missing from sglang_dflash/settings.py: {undeclared}"
    unread = sorted(name for name in declared if not named.get(name, set()) - {"sglang_dflash/settings.py"})
    assert not unread, f"declared but read nowhere: {unread}"


def test_python_reads_our_switches_only_through_the_registry():
    """No os.environ / os.getenv access to an SGLANG_DFLASH_ name outside settings.py (setup.py,
    which cannot import the package, parses its build switches itself)."""
    wrong = []
    for path in (ROOT / "sglang_dflash").rglob("*.py"):
        if path.name == "settings.py" and path.parent.name == "sglang_dflash":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = ast.unparse(node) if isinstance(node, (ast.Call, ast.Subscript)) else ""
            if ("environ" in text or "getenv" in text) and SWITCH.search(text):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert not wrong, wrong


def test_the_registry_states_the_tree_defaults_the_code_uses():
    assert f"at most {MAX_TREE_TOPK}" in settings.TREE_TOPK.doc
    assert f"up to {DEFAULT_TREE_BUDGET} nodes" in settings.TREE_BUDGET.default_doc


def test_the_docs_table_is_the_registrys(tmp_path):
    docs = settings.DOCS.read_text()
    assert settings.with_table(docs, settings.DOCS) == docs, (
        "docs/serving.md's settings table differs from sglang_dflash/settings.py: "
        "run python -m sglang_dflash.settings --write-docs")
    for spec in settings.SETTINGS:
        assert f"| `{spec.name}` |" in docs

    stale = tmp_path / "serving.md"
    stale.write_text(docs.replace(settings.STRICT.doc, "an old description"))
    assert settings.main(["--check", "--docs", str(stale)]) == 1
    assert settings.main(["--write-docs", "--docs", str(stale)]) == 0
    assert stale.read_text() == docs and settings.main(["--check", "--docs", str(stale)]) == 0
    stale.write_text("no markers")
    with pytest.raises(ValueError, match="needs exactly one <!-- settings:begin --> ... <!-- settings:end -->"):
        settings.main(["--check", "--docs", str(stale)])
