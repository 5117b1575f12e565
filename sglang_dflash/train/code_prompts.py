"""HumanEval-style code prompts from the running Python's standard library, for regenerating
code answers with the target (no dataset download needed).

Each prompt is a documented top-level function's signature and docstring, body removed, in the
same wording the end-to-end benchmark uses for HumanEval, so the drafter learns how the target
completes functions without ever seeing a HumanEval problem.
"""

from __future__ import annotations

import ast
import sysconfig
import textwrap
from pathlib import Path

STDLIB_FUNCTIONS = "python-stdlib-functions"


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


def stdlib_function_prompts(limit: int | None = None) -> list[str]:
    """Prompts for the documented, undecorated, public top-level functions of the stdlib
    (tests, idlelib and site-packages excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3"}:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.decorator_list and not node.name.startswith("_"):
                stub = function_stub(lines, node)
                if stub:
                    prompts.append(complete_function_prompt(stub))
                    if limit is not None and len(prompts) >= limit:
                        return prompts
    return prompts
