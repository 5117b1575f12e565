"""End-to-end engine benchmark on the real SmolLM2-135M target (not a test).

Plain autoregressive decoding (block size 1) against speculative decoding with an oracle drafter
that proposes the target's own greedy continuation, so tau = B exactly (tau 4 at B = 4): the
speedup measures the engine's per-step overhead, which must allow >= 2x at tau 4. Also reports
the cost of a random DFlash drafter step (draft vs verify time), since a trained drafter pays it.

    python -m bench.bench_engine [--max-new-tokens 96] [--threads 2] [--out bench/results/engine_cpu.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.provenance import run_info
from sglang_dflash.engine import DFlashDrafter, Generator, HFTarget, OracleDrafter, SamplingParams, encode_prompt
from sglang_dflash.engine.drafters import NoDrafter
from sglang_dflash.engine.packaged import model_dir
from sglang_dflash.models import DFlashConfig, DFlashDraftModel

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain why the sky is blue in three sentences.",
    "List five fruits and one fact about each.",
    "What is the difference between a list and a tuple in Python?",
]


def decode_rate(results) -> float:
    """Decode tokens per second: tokens after the first, over the time after prefill."""
    tokens = sum(len(r.output_ids) - 1 for r in results)
    seconds = max(r.stats.wall_s - r.stats.prefill_s for r in results)
    return tokens / seconds


def run(gen: Generator, prompts, params: SamplingParams, repeats: int):
    best = None
    for _ in range(repeats):
        results = gen.generate(prompts, params)
        if best is None or decode_rate(results) > decode_rate(best):
            best = results
    return best


def random_dflash(target: HFTarget, layers: int, block_size: int) -> DFlashDraftModel:
    n = target.num_layers
    config = DFlashConfig(hidden_size=target.hidden_size, intermediate_size=1536, num_hidden_layers=layers,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=target.vocab_size,
                          block_size=block_size, mask_token_id=0, target_layer_ids=(1, n // 2, n - 3),
                          num_target_layers=n)
    torch.manual_seed(0)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--block-sizes", default="4,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_cpu.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    info = run_info({"target": model_dir(args.target)})  # before the run loads the machine
    target = HFTarget.from_pretrained(args.target)
    prompts = [encode_prompt(target.tokenizer, p) for p in PROMPTS]
    # No stop tokens while timing, so every configuration decodes the same number of tokens.
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=())
    print(f"target {args.target}, {args.max_new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"{target.device}", flush=True)
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        batch = prompts[:bs]
        ar = run(Generator(target, NoDrafter(), 1), batch, params, args.repeats)
        ar_rate = decode_rate(ar)
        print(f"bs {bs}: plain AR {ar_rate:7.1f} tok/s")
        references = [r.prompt_ids + r.output_ids for r in ar]
        for block in [int(b) for b in args.block_sizes.split(",")]:
            spec = run(Generator(target, OracleDrafter(references, target.vocab_size), block), batch, params,
                       args.repeats)
            assert [r.output_ids for r in spec] == [r.output_ids for r in ar], "oracle run is not lossless"
            tau = sum(len(r.output_ids) - 1 for r in spec) / sum(r.stats.steps for r in spec)
            rate = decode_rate(spec)
            print(f"bs {bs}: oracle B={block:2d} tau {tau:5.2f} {rate:7.1f} tok/s  speedup {rate / ar_rate:5.2f}x")
            rows.append({"batch": bs, "block_size": block, "tau": tau, "ar_tok_s": ar_rate, "spec_tok_s": rate,
                         "speedup": rate / ar_rate})
        draft = DFlashDrafter(random_dflash(target, 1, 16), target)
        res = Generator(target, draft, 16).generate(batch, params)
        step = res[0].stats
        print(f"bs {bs}: 1-layer DFlash drafter B=16: draft {1e3 * step.draft_s / step.steps:6.1f} ms/step, "
              f"verify {1e3 * step.verify_s / step.steps:6.1f} ms/step")
        rows.append({"batch": bs, "block_size": 16, "dflash_layers": 1,
                     "draft_ms_per_step": 1e3 * step.draft_s / step.steps,
                     "verify_ms_per_step": 1e3 * step.verify_s / step.steps})
    Path(args.out).write_text(json.dumps({"provenance": info, "target": args.target, "device": str(target.device),
                                          "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
