"""`sglang-dflash demo` (`make demo`): a few prompts through DFlash on the packaged SmolLM2-135M
target with the shipped drafter, next to plain decoding of the same target in the same engine:
the text, tau and the speedup, and a check that greedy output is unchanged."""

from __future__ import annotations

import textwrap

from sglang_dflash.train.code_prompts import complete_function_prompt

# Among the shipped drafter's fastest fixed block sizes on a small CPU: longer blocks verify more
# tokens than get accepted (fixed B = 2, 3 and 4 in bench/results/e2e_smollm2-135m.json).
DEMO_BLOCK_SIZE = 4

DEMO_PROMPTS = [
    "A baker makes 24 muffins in the morning and twice as many in the afternoon. She sells 50 of them. "
    "How many muffins does she have left?",
    complete_function_prompt('def count_vowels(text: str) -> int:\n    """Return the number of vowels '
                             '(a, e, i, o, u, either case) in text.\n    >>> count_vowels("Hello World")\n'
                             '    3\n    """\n'),
    "Tom has 3 boxes with 12 pencils each. He gives 9 pencils to his sister. How many pencils does he have now?",
    complete_function_prompt('def running_max(values: list[int]) -> list[int]:\n    """Return the list whose '
                             'i-th item is the largest of values[0..i].\n    >>> running_max([1, 3, 2, 5])\n'
                             '    [1, 3, 3, 5]\n    """\n'),
]


def run_demo(target_name: str, draft_name: str, block_size: int | None, max_new_tokens: int, device: str) -> int:
    from sglang_dflash.drafters import resolve_draft
    from sglang_dflash.engine import HFTarget, SamplingParams, load_drafter
    from sglang_dflash.engine.compare import compare, decode_rate
    from sglang_dflash.models import DFlashConfig

    draft_dir = resolve_draft(draft_name)

    def new_target():
        return HFTarget.from_pretrained(target_name, device=device)

    def new_drafter(target):  # int8 weights on CPU, bf16 elsewhere; drafts never change the output
        return load_drafter(draft_dir, target, "auto", device=device)

    block_size = block_size or min(DEMO_BLOCK_SIZE, DFlashConfig.from_file(draft_dir / "config.json").block_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    print(f"DFlash demo: target {target_name}, drafter {draft_name}, block size {block_size}, greedy, "
          f"{max_new_tokens} new tokens, batch size 1\n")
    (result,) = compare(new_target, new_drafter, DEMO_PROMPTS, [block_size], params)
    spec, plain = result.spec, result.plain
    identical = bool(result.summary()["identical_to_plain"])
    for i, (prompt, out, base) in enumerate(zip(DEMO_PROMPTS, spec, plain, strict=True), 1):
        same = out.output_ids == base.output_ids
        spec_rate, plain_rate = decode_rate([out]), decode_rate([base])
        print(f"--- prompt {i}: {textwrap.shorten(prompt, 100)}")
        print(textwrap.indent(out.text.strip(), "    "))
        print(f"    tau {out.stats.tau:.2f} tokens per target pass | {spec_rate:.1f} tok/s with "
              f"DFlash vs {plain_rate:.1f} plain | speedup {spec_rate / plain_rate:.2f}x | "
              f"same text as plain decoding: {same}\n")
    print(f"overall decode speedup {decode_rate(spec) / decode_rate(plain):.2f}x; "
          f"output identical to plain greedy decoding: {identical}")
    return 0 if identical else 1
