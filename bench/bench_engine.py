"""End-to-end engine benchmark on SmolLM2-135M (not a test).

Plain autoregressive decoding (block size 1) against speculative decoding with an oracle drafter
that proposes the target's own greedy continuation, so tau = B exactly (tau 4 at B = 4): the
speedup measures the engine's per-step overhead, which must allow >= 2x at tau 4. Also reports
the cost of a random DFlash drafter step (draft vs verify time), since a trained drafter pays it.
With `--draft`, a real drafter runs too: its greedy output must equal plain decoding token for
token, and its tok/s is reported against plain's from the same run.

    python -m bench.bench_engine [--max-new-tokens 96] [--threads 2] [--out bench/results/engine_cpu.json]
    python -m bench.bench_engine --random-target bench/gpu/smollm2-135m-config.json --device cuda \
        --draft smollm2-135m-dflash-b8 --out engine_gpu.json

`--random-target CONFIG` builds the target from a Hugging Face config with seeded random weights and
prompts of seeded random token ids: the route for a GPU machine, to which SmolLM2's 98 MB GGUF cannot
travel (its working tree is capped at 64 MiB). Same shapes and kernels as the real target, so the
oracle rows and the draft / verify costs carry over; the real drafter's acceptance does not (its
drafts follow the real model), so its row checks losslessness and cost, not its speedup.
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


def committed_per_step(results) -> float:
    """tau: decode tokens (after the prefill's) per verify step."""
    return sum(len(r.output_ids) - 1 for r in results) / sum(r.stats.steps for r in results)


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


def random_target(config_path: Path, device: str, seed: int = 0) -> HFTarget:
    """A target of `config_path`'s architecture with seeded random weights (bf16 on CUDA)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    return HFTarget(model)


def random_prompts(count: int, vocab_size: int, length: int = 48, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=gen).tolist() for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--random-target", type=Path, metavar="CONFIG",
                        help="a Hugging Face config.json: its architecture with seeded random weights "
                             "(instead of --target)")
    parser.add_argument("--draft", help="a drafter directory or shipped drafter name to run next to plain decoding")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--block-sizes", default="4,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON result (default bench/results/engine_<device type>.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out or Path(__file__).parent / "results" / f"engine_{torch.device(device).type}.json")

    if args.random_target is not None:
        info = run_info({})
        info["random_target_config"] = str(args.random_target)
        target = random_target(args.random_target, device)
        prompts = random_prompts(max(int(b) for b in args.batch_sizes.split(",")), target.vocab_size)
        target_name = f"{args.random_target.name} (random weights, seed 0)"
    else:
        info = run_info({"target": model_dir(args.target)})  # before the run loads the machine
        target = HFTarget.from_pretrained(args.target, device=device)
        prompts = [encode_prompt(target.tokenizer, p) for p in PROMPTS]
        target_name = args.target
    # No stop tokens while timing, so every configuration decodes the same number of tokens.
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=())
    print(f"target {target_name}, {args.max_new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"{target.device}", flush=True)
    drafter = None
    if args.draft:
        from sglang_dflash.drafters import resolve_draft
        from sglang_dflash.engine import load_drafter

        drafter = load_drafter(resolve_draft(args.draft), target, "auto", device=device)
    rows = []
    lossless = True
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
            tau = committed_per_step(spec)
            rate = decode_rate(spec)
            print(f"bs {bs}: oracle B={block:2d} tau {tau:5.2f} {rate:7.1f} tok/s  speedup {rate / ar_rate:5.2f}x")
            rows.append({"batch": bs, "drafter": "oracle", "block_size": block, "tau": tau, "ar_tok_s": ar_rate,
                         "spec_tok_s": rate, "speedup": rate / ar_rate})
            if drafter is not None:
                spec = run(Generator(target, drafter, block), batch, params, args.repeats)
                identical = [r.output_ids for r in spec] == [r.output_ids for r in ar]
                lossless &= identical
                tau = committed_per_step(spec)
                rate = decode_rate(spec)
                print(f"bs {bs}: {args.draft} B={block:2d} tau {tau:5.2f} {rate:7.1f} tok/s  "
                      f"speedup {rate / ar_rate:5.2f}x  greedy identical to plain: {identical}")
                rows.append({"batch": bs, "drafter": args.draft, "block_size": block, "tau": tau, "ar_tok_s": ar_rate,
                             "spec_tok_s": rate, "speedup": rate / ar_rate, "identical_to_plain": identical})
        draft = DFlashDrafter(random_dflash(target, 1, 16).to(target.device, target.lm_head_weight.dtype), target)
        res = Generator(target, draft, 16).generate(batch, params)
        step = res[0].stats
        print(f"bs {bs}: 1-layer DFlash drafter B=16: draft {1e3 * step.draft_s / step.steps:6.1f} ms/step, "
              f"verify {1e3 * step.verify_s / step.steps:6.1f} ms/step")
        rows.append({"batch": bs, "drafter": "random-1-layer", "block_size": 16, "dflash_layers": 1,
                     "draft_ms_per_step": 1e3 * step.draft_s / step.steps,
                     "verify_ms_per_step": 1e3 * step.verify_s / step.steps})
    out.write_text(json.dumps({"provenance": info, "target": target_name, "device": str(target.device),
                               "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2))
    print(f"wrote {out}")
    if not lossless:
        raise SystemExit(f"{args.draft}: greedy output differs from plain decoding")

if __name__ == "__main__":
    main()
