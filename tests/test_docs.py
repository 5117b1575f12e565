"""The repository's documents link only to what the repository holds, and nothing in it points
outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Built from parts, so that this file does not name what it looks for.
OUTSIDE = ("../" + "shared", "/work/" + "shared")
# Documents the code once cited, which are now docs/design.md and docs/serving.md.
OLD_DOCS = re.compile(r"\b" + "DESIGN" + r"\.md\b|dflash-" + "reference" + r"\.md|docs/" + "sglang" + r"\.md")
# Recorded results: their provenance lists the files of the commit they were made at, as they were.
RECORDS = ("tests/data/", "bench/results/")


def tracked_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in names.splitlines() if (ROOT / name).is_file()]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "sglang_dflash" / "drafters").glob("*/README.md"))]


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_at_files_and_headings_that_exist(doc):
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", doc.read_text(), flags=re.S))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists() or ROOT not in (path, *path.parents):
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to nothing in the repository: {broken}"


def test_nothing_refers_to_a_folder_outside_the_repository():
    found = [f"{path.relative_to(ROOT)}: {needle}" for path in tracked_files()
             for needle in OUTSIDE if needle in path.read_text(errors="ignore")]
    assert not found


def test_code_cites_the_documents_in_docs():
    found = [name for name, path in ((str(p.relative_to(ROOT)), p) for p in tracked_files())
             if not name.startswith(RECORDS) and OLD_DOCS.search(path.read_text(errors="ignore"))]
    assert not found, f"cite docs/design.md (or docs/serving.md) instead: {found}"
