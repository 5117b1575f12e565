"""HumanEval-style code prompts from the running Python's standard library and its installed
packages, for regenerating code answers with the target (no dataset download needed).

Each prompt is a documented top-level function's signature and docstring, body removed, in the
same wording the end-to-end benchmark uses for HumanEval, so the drafter learns how the target
completes functions without ever seeing a HumanEval problem.
"""

from __future__ import annotations

import ast
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

STDLIB_FUNCTIONS = "python-stdlib-functions"
INSTALLED_FUNCTIONS = "python-installed-functions"


def complete_function_prompt(code: str) -> str:
    """The instruction wrapped around a function stub (also used for HumanEval in bench_e2e)."""
    return f"Complete this Python function.\n```python\n{code}```"


def function_stub(source_lines: list[str], node: ast.FunctionDef) -> str | None:
    """`def ...:` plus its docstring, verbatim; None if the function has no usable docstring."""
    doc = node.body[0] if node.body else None
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        return None
    text = doc.value.value.strip()
    if not 40 <= len(text) <= 800 or len(node.body) < 2:  # a real description, and a body to write
        return None
    return textwrap.dedent("".join(source_lines[node.lineno - 1: doc.end_lineno])) + "\n"


def module_function_stubs(path: Path) -> list[str]:
    """Stubs of a module's documented, undecorated, public top-level functions, in file order."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    stubs = (function_stub(lines, node) for node in tree.body
             if isinstance(node, ast.FunctionDef) and not node.decorator_list and not node.name.startswith("_"))
    return [stub for stub in stubs if stub]


def stdlib_function_prompts() -> Iterator[str]:
    """Prompts for the documented public top-level functions of the stdlib (tests, idlelib and
    site-packages excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if not set(path.relative_to(root).parts) & {"test", "tests", "idlelib", "site-packages", "dist-packages",
                                                      "lib2to3"}:
            yield from map(complete_function_prompt, module_function_stubs(path))


def installed_function_prompts() -> Iterator[str]:
    """Prompts for the documented public top-level functions of the installed third-party
    packages (tests excluded), one from each package in turn, so that the first N mix all of
    them (torch alone holds thousands); files are parsed only as far as the reader goes."""
    root = Path(sysconfig.get_paths()["purelib"])
    streams = []
    for entry in sorted(root.iterdir()):
        files = sorted(entry.rglob("*.py")) if entry.is_dir() else [entry] if entry.suffix == ".py" else []
        files = [f for f in files if not set(f.relative_to(root).parts) & {"test", "tests", "testing"}]
        streams.append(stub for f in files for stub in module_function_stubs(f))
    while streams:
        for stream in list(streams):
            stub = next(stream, None)
            if stub is None:
                streams.remove(stream)
            else:
                yield complete_function_prompt(stub)
