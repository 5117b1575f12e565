"""`sglang-dflash` command line.

    sglang-dflash generate --target DIR|smollm2-135m [--draft DIR] --prompt TEXT [--json] ...
    sglang-dflash train --target DIR|smollm2-135m --data FILE|DIR --out DIR [--block-size --layers --steps ...]
    sglang-dflash demo [--max-new-tokens N]          (an SGLang server with and without DFLASH, on the CPU)
    sglang-dflash demo-engine [--block-size B]       (the standalone engine, with and without the drafter)
    sglang-dflash regenerate --target DIR|smollm2-135m --data FILE --out DIR --target-layer-ids 1,8,14,20,27

Without --draft the target decodes alone through the same engine (block size 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from sglang_dflash import settings
from sglang_dflash.drafters import DRAFT_DTYPES, SHIPPED_DRAFTER

PACKAGED_HELP = "a Hugging Face model directory, or a packaged model name: smollm2-135m, qwen2.5-coder-0.5b"


def _int_list(flag: str):
    """argparse type: integers separated by commas and/or spaces, e.g. "1,2,3"."""
    def parse(text: str) -> list[int]:
        try:
            return [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} wants integers separated by commas, got {text!r}") from None
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-dflash", description="DFlash speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with DFlash speculative decoding")
    g.add_argument("--target", required=True, help=PACKAGED_HELP)
    g.add_argument("--draft", help="z-lab DFlash checkpoint directory or shipped drafter name "
                                   f"({SHIPPED_DRAFTER}); omit for target-only decoding")
    g.add_argument("--prompt", action="append", default=[], help="text prompt (repeat for a batch)")
    g.add_argument("--prompt-ids", action="append", default=[], type=_int_list("--prompt-ids"),
                   help="prompt as token ids, e.g. 1,2,3 (repeat for a batch)")
    g.add_argument("--no-chat-template", action="store_true", help="tokenize text prompts as they are")
    g.add_argument("--block-size", type=int, help="block size B (default: the drafter's)")
    g.add_argument("--adaptive", action="store_true",
                   help="choose each step's block size (up to B) from measured acceptance and step times, "
                        "starting from what the last --adaptive run of the same target, drafter, options and "
                        "machine learned (kept under --cache-dir)")
    g.add_argument("--fresh-adaptive", action="store_true",
                   help="with --adaptive: learn from nothing, and keep nothing for the next run")
    g.add_argument("--tree-budget", type=int, metavar="N",
                   help="verify a tree of N drafted tokens a step instead of a chain (the drafter's --tree-topk "
                        "best tokens at each of the B - 1 positions, grown best first; 0: a chain); with --adaptive, "
                        "each step a chain of up to B or a tree of N, N/2 or N/4, whichever is expected to be "
                        "fastest (default with --adaptive and a drafter: 15, cut to what a tree of B - 1 positions "
                        "and --tree-topk choices holds; the server plays up to B - 1; else 0)")
    g.add_argument("--tree-topk", type=int, default=settings.TREE_TOPK.default, metavar="K",
                   help=f"choices per position of a tree (default {settings.TREE_TOPK.default}, as the server's "
                        f"{settings.TREE_TOPK.name})")
    g.add_argument("--tree-min-prob", type=float, metavar="P",
                   help="leave out of a greedy tree the nodes whose path probability (the product of the draft "
                        "probabilities on it) is below P, so an unsure step verifies fewer rows (default: the "
                        "engine's, DEFAULT_TREE_MIN_PROB in control/tree.py; 0: every tree fills its budget; "
                        "sampled trees always do)")
    g.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto",
                   help="dtype the draft model runs in (int8: int8 weights with a scale per row, bf16 activations, "
                        "half the bytes a CPU draft step reads; default auto: int8 on CPU, else bfloat16; drafts "
                        "never change the output)")
    g.add_argument("--target-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype the target runs in (bfloat16: half the bytes a step reads, and on a CPU with AMX "
                        "a verify of up to 16 rows costs about what one row costs; the output equals plain "
                        "decoding of the target in that dtype)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop-token-ids", type=_int_list("--stop-token-ids"), help="default: the target's EOS ids")
    g.add_argument("--cache-dir", help="where packaged models are converted and --adaptive keeps what it learned "
                                       "(default: $SGLANG_DFLASH_CACHE or ~/.cache/sglang_dflash)")
    _add_torch_options(g)
    g.add_argument("--json", action="store_true",
                   help="print one JSON object: per request prompt_ids, output_ids (the prefill token, then "
                        "every step's commits), steps (tokens committed by each verify pass, bonus included) "
                        "and stats")
    add_train_parser(sub)
    add_regenerate_parser(sub)
    s = sub.add_parser("demo", help="an SGLang server with plain decoding, then one with DFLASH and the shipped "
                                    "drafter, on 127.0.0.1 (needs SGLang: make install-sglang-cpu): the same "
                                    "prompts, tok/s, the ratio and whether the greedy text is identical")
    s.add_argument("--max-new-tokens", type=int, default=96)
    d = sub.add_parser("demo-engine", help="a few prompts through the standalone DFlash engine with the shipped "
                                           "drafter, next to plain decoding")
    d.add_argument("--target", default="smollm2-135m", help=PACKAGED_HELP)
    d.add_argument("--draft", default=SHIPPED_DRAFTER, help="drafter directory or shipped drafter name")
    d.add_argument("--block-size", type=int, help="block size B (default 4, the shipped drafter's fastest on CPU)")
    d.add_argument("--max-new-tokens", type=int, default=128)
    _add_torch_options(d)
    return parser


def _add_torch_options(parser: argparse.ArgumentParser) -> None:
    """--device and --threads, which _torch_setup applies."""
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")


def _torch_setup(args: argparse.Namespace) -> str:
    """Applies --threads (>= 1) and returns the device (--device, else cuda when available)."""
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def demo(args: argparse.Namespace) -> int:
    from sglang_dflash.served_demo import run_served_demo

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return run_served_demo(args.max_new_tokens)


def demo_engine(args: argparse.Namespace) -> int:
    from sglang_dflash.demo import run_demo

    device = _torch_setup(args)
    return run_demo(args.target, args.draft, args.block_size, args.max_new_tokens, device)


def add_regenerate_parser(sub) -> None:
    r = sub.add_parser("regenerate", help="have the target answer training prompts itself and capture the "
                                          "drafter's context features (a feature dataset for train --data)")
    r.add_argument("--target", required=True, help=PACKAGED_HELP)
    r.add_argument("--data", action="append", required=True,
                   help="jsonl/json prompts or conversations (answers are replaced), python-stdlib-functions or "
                        "python-installed-functions (code prompts from this Python's stdlib / packages); "
                        "repeat for several")
    r.add_argument("--out", required=True, help="feature dataset directory to write")
    r.add_argument("--target-layer-ids", type=_int_list("--target-layer-ids"), required=True,
                   help="tapped target layers, e.g. 1,8,14,20,27 (the drafter's target_layer_ids)")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--limit", type=int, help="records read from each source")
    r.add_argument("--skip", type=int, default=0, help="records of each source skipped before reading (to continue "
                                                         "where an earlier regeneration's --limit stopped)")
    r.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--teacher-topk", type=int, default=0, metavar="K",
                   help="also keep the target's K most likely next tokens and their log-probabilities for every "
                        "answer token, so `train --kl-weight` distils from them without running the target")
    r.add_argument("--batch-size", type=int, default=64)
    r.add_argument("--max-batch-tokens", type=int, default=None,
                   help="padded tokens per batch, rows x (longest prompt + max new tokens); fewer rows for long "
                        "prompts (default 49152)")
    _add_torch_options(r)


def regenerate(args: argparse.Namespace) -> int:
    from sglang_dflash.engine import HFTarget
    from sglang_dflash.train.regenerate import MAX_BATCH_TOKENS, regenerate_dataset

    device = _torch_setup(args)
    target = HFTarget.from_pretrained(args.target, device=device)
    count = regenerate_dataset(target, args.data, args.out, tuple(args.target_layer_ids), args.max_new_tokens,
                               args.limit, args.temperature, args.seed, args.batch_size, args.skip,
                               args.max_batch_tokens or MAX_BATCH_TOKENS, args.teacher_topk)
    print(f"wrote {count} regenerated examples to {args.out}")
    return 0


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a DFlash drafter for a target (resumes from --out)")
    t.add_argument("--target", required=True, help=PACKAGED_HELP)
    t.add_argument("--data", action="append", required=True,
                   help="jsonl/json file (chat, ShareGPT, GSM8K, prompt/response, text) or a directory of "
                        ".py files; repeat for several")
    t.add_argument("--out", required=True, help="checkpoint directory (z-lab format); training resumes from it")
    # Unset tunables keep TrainConfig's defaults (sglang_dflash/train/trainer.py).
    for flag, kind, text in [
        ("--block-size", int, "block size B (default 16)"),
        ("--layers", int, "draft layers (default 2; also the number of tapped layers without --target-layer-ids)"),
        ("--steps", int, "optimizer steps (default 1000)"),
        ("--lr", float, "peak learning rate (default 6e-4)"),
        ("--warmup", float, "warmup fraction of the steps (default 0.04)"),
        ("--accumulation", int, "sequences per step (default 1)"),
        ("--num-anchors", int, "blocks per sequence (default 32)"),
        ("--gamma", float, "loss decay (default 7 for B 16, 4 for B 8)"),
        ("--kl-weight", float, "weight of KL(target || draft) (default 0): from the target's top-k kept by "
                               "`regenerate --teacher-topk`, else from a target forward per sequence"),
        ("--eval-every", int, "steps between held-out tau estimates (default 100)"),
        ("--save-every", int, "steps between checkpoints (default 100)"),
        ("--seed", int, "seed of data order and anchors (default 0)"),
    ]:
        t.add_argument(flag, type=kind, help=text)
    t.add_argument("--arch", choices=["dflash", "dflash2"],
                   help="dflash (default) or dflash2: DFlash-2's grouped convolutions and path selector (a "
                        "resumed run keeps its drafter's)")
    t.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="float32 (default) or bfloat16 mixed precision (fp32 master weights)")
    t.add_argument("--target-layer-ids", type=_int_list("--target-layer-ids"),
                   help="tapped target layers, e.g. 1,8,14,20,27 (default: --layers ids spread z-lab's way)")
    t.add_argument("--max-len", type=int, default=512, help="tokens per training sequence")
    t.add_argument("--limit", type=int, help="records read from each data source")
    t.add_argument("--held-out", type=int, default=16, help="examples kept for the tau estimate")
    t.add_argument("--held-out-data", action="append",
                   help="data for the tau estimate instead of --held-out examples of --data (repeat for several)")
    t.add_argument("--regenerate", action="store_true",
                   help="have the target answer the prompts itself first (or use `sglang-dflash regenerate`)")
    t.add_argument("--regen-temperature", type=float, default=0.0)
    t.add_argument("--feature-cache", help="directory to cache the target's features in")
    t.add_argument("--draft-vocab", type=int, default=0, metavar="K",
                   help="also write a draft vocabulary of the K most frequent trained-on tokens: drafts "
                        "only take those ids, so the draft LM head reads K rows instead of the vocabulary")
    _add_torch_options(t)


def train(args: argparse.Namespace) -> int:
    from sglang_dflash.train.run import train_drafter
    from sglang_dflash.train.trainer import TrainConfig

    device = _torch_setup(args)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    cfg = TrainConfig(**overrides)
    history = train_drafter(args.target, args.data, cfg, max_len=args.max_len, limit=args.limit,
                            held_out=args.held_out, regenerate_answers=args.regenerate,
                            regen_temperature=args.regen_temperature, feature_cache=args.feature_cache,
                            device=device, draft_vocab_size=args.draft_vocab, held_out_data=args.held_out_data)
    print(f"trained to step {cfg.steps}: {history[-1] if history else {}}; checkpoint in {args.out}")
    return 0


def generate(args: argparse.Namespace) -> int:
    import torch

    from sglang_dflash.control.tree import (
        DEFAULT_TREE_MIN_PROB,
        check_tree_options,
        default_tree_budget,
        most_tree_nodes,
    )
    from sglang_dflash.drafters import resolve_draft
    from sglang_dflash.engine import Generator, HFTarget, SamplingParams, load_drafter
    from sglang_dflash.engine.drafters import NoDrafter
    from sglang_dflash.engine.packaged import default_cache_dir

    if not args.prompt and not args.prompt_ids:
        raise ValueError("give at least one --prompt or --prompt-ids")
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size} (omit it for the drafter's)")
    # Checked before any model loads.
    tree_min_prob = DEFAULT_TREE_MIN_PROB if args.tree_min_prob is None else args.tree_min_prob
    if args.tree_budget:  # asked for (None: the default once the block size is known)
        if not args.draft:
            raise ValueError("--tree-budget needs a drafter (--draft)")
        check_tree_options(args.tree_budget, args.tree_topk, tree_min_prob)
    else:  # the options of the trees --adaptive plays by default
        check_tree_options(1, args.tree_topk, tree_min_prob)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens,
                            stop_token_ids=None if args.stop_token_ids is None else tuple(args.stop_token_ids))
    device = _torch_setup(args)
    target = HFTarget.from_pretrained(args.target, dtype=getattr(torch, args.target_dtype), device=device,
                                      cache_dir=args.cache_dir)
    if args.draft:
        drafter = load_drafter(resolve_draft(args.draft), target, args.draft_dtype, device=device)
        block_size = args.block_size or drafter.max_block_size
    else:
        drafter, block_size = NoDrafter(), args.block_size or 1
    tree_budget = args.tree_budget
    if tree_budget is None:
        adaptive_trees = args.adaptive and args.draft
        tree_budget = default_tree_budget(most_tree_nodes(block_size, args.tree_topk)) if adaptive_trees else 0
    state_dir = None if args.fresh_adaptive else (args.cache_dir or default_cache_dir())
    results = Generator(target, drafter, block_size, adaptive=args.adaptive, tree_budget=tree_budget,
                        tree_topk=args.tree_topk, tree_min_prob=tree_min_prob,
                        adaptive_state_dir=state_dir if args.adaptive and args.draft else None).generate(
        args.prompt + args.prompt_ids, params, chat=not args.no_chat_template)

    if args.json:
        print(json.dumps({
            "target": args.target, "draft": args.draft, "block_size": block_size, "adaptive": args.adaptive,
            "tree_budget": tree_budget, "tree_topk": args.tree_topk if tree_budget else None,
            "tree_min_prob": tree_min_prob if tree_budget else None,
            "sampling": dataclasses.asdict(params),
            "torch_threads": torch.get_num_threads(), "device": device,
            "requests": [{"prompt_ids": r.prompt_ids, "output_ids": r.output_ids, "steps": r.steps,
                          "text": r.text, "stats": r.stats.to_dict(), "block_size_decisions": r.decisions,
                          "tree_steps": r.trees}
                         for r in results],
        }, allow_nan=False))  # strict JSON: a NaN / Infinity would be a bug, so it raises instead
        return 0
    for i, r in enumerate(results):
        s = r.stats
        if len(results) > 1:
            print(f"--- request {i}")
        print(r.text if r.text is not None else r.output_ids)
        print(f"[{s.tokens} tokens, {s.steps} steps, tau {s.tau:.2f}, mean block {s.mean_block_size:.2f}, "
              f"accepted-drafts histogram {s.accept_hist}, "
              f"{s.tokens_per_s:.1f} tok/s, prefill {s.prefill_s:.2f}s, draft {s.draft_s:.2f}s, "
              f"verify {s.verify_s:.2f}s]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"generate": generate, "train": train, "regenerate": regenerate, "demo": demo,
                    "demo-engine": demo_engine}
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError, RuntimeError, KeyError) as e:
        print(f"sglang-dflash: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
