"""Accept lengths of every verify step at a fixed block size, per prompt, and the drafter's
confidence in each draft (its probability, in %): the data the adaptive block size's replay tests
(tests/test_engine_block_size.py, tests/test_engine_draft_confidence.py) run the controller on.

    python -m bench.record_accept_lengths --dataset humaneval --samples 64 --block-size 8 \
        --out tests/data/accept_lengths_humaneval_t0_b8.json

At block size B a step's accept length a also says what any smaller block b would have accepted,
min(a, b - 1), as long as the drafts of a smaller block agree with the first b - 1 of B's (DFlash
drafts the block's positions in one forward pass, so they can differ a little: a replay is an
approximation, not a measurement).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from bench.bench_e2e import DEFAULT_GSM8K, load_prompts
from bench.provenance import run_info
from sglang_dflash.drafters import DRAFT_DTYPES, SHIPPED_DRAFTER, resolve_draft
from sglang_dflash.engine import Generator, HFTarget, SamplingParams, load_drafter
from sglang_dflash.engine.packaged import model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=SHIPPED_DRAFTER)
    parser.add_argument("--draft-dtype", default="auto", choices=DRAFT_DTYPES)
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gsm8k", type=Path, default=DEFAULT_GSM8K)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    target_dir, draft_dir = model_dir(args.target), resolve_draft(args.draft)
    info = run_info({"target": target_dir, "draft": draft_dir})
    target = HFTarget.from_pretrained(target_dir)
    generator = Generator(target, load_drafter(draft_dir, target, args.draft_dtype), args.block_size)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    propose, step_confidences = generator.drafter.propose, []

    def propose_and_record(*args, **kwargs):
        drafts, confidence = propose(*args, **kwargs, confidence=True)
        step_confidences.append([round(100 * q) for q in confidence[0].tolist()])
        return drafts

    generator.drafter.propose = propose_and_record
    accept_lengths, confidences = [], []
    for prompt in tqdm(load_prompts(args.dataset, args.samples, args.gsm8k), desc=args.dataset, unit="prompt"):
        step_confidences.clear()
        result = generator.generate([prompt], params)[0]
        accept_lengths.append([len(tokens) - 1 for tokens in result.steps])  # a step commits a + 1
        confidences.append(list(step_confidences))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "provenance": info, "target": args.target, "draft": args.draft, "draft_dtype": args.draft_dtype,
        "dataset": args.dataset, "block_size": args.block_size, "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens, "accept_lengths": accept_lengths,
        "draft_confidence_percent": confidences}) + "\n")
    steps = sum(map(len, accept_lengths))
    print(f"{args.out}: {len(accept_lengths)} prompts, {steps} steps, "
          f"tau {sum(a + 1 for run in accept_lengths for a in run) / max(steps, 1):.2f}")


if __name__ == "__main__":
    main()
