"""`sglang-dflash generate` end to end, as a subprocess: ids and per-step commits in --json, text
mode, and one clear error for a bad draft path; the flag checks, which run before anything loads, in
this process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_dflash import cli
from sglang_dflash.models import save_draft
from tests.dflash_testlib import STOP_TOKEN, hf_greedy, random_draft, smollm2, tiny_target


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_dflash.cli", "generate", *args],
                          capture_output=True, text=True, timeout=300)


def strict_json_constant(name: str):
    raise AssertionError(f"--json printed {name}, which is not JSON")


def test_generate_json_matches_hf_greedy(tmp_path):
    target = tiny_target("qwen3")
    target.model.save_pretrained(tmp_path / "target")
    save_draft(random_draft(target, block_size=4), tmp_path / "draft")
    prompts = [[3, 4, 5, 6], [40, 41]]
    proc = run_cli("--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                   "--prompt-ids", "3,4,5,6", "--prompt-ids", "40,41", "--max-new-tokens", "10",
                   "--stop-token-ids", str(STOP_TOKEN), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout, parse_constant=strict_json_constant)
    assert out["block_size"] == 4
    for req, prompt in zip(out["requests"], prompts, strict=True):
        assert req["prompt_ids"] == prompt
        assert req["output_ids"] == hf_greedy(target, prompt, 10, STOP_TOKEN)
        assert [t for step in req["steps"] for t in step] == req["output_ids"][1:]
        assert req["stats"]["steps"] == len(req["steps"])


def test_generate_json_lists_the_adaptive_block_size_decisions(tmp_path):
    target = tiny_target("qwen3")
    target.model.save_pretrained(tmp_path / "target")
    save_draft(random_draft(target, block_size=4), tmp_path / "draft")
    proc = run_cli("--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--adaptive",
                   "--tree-budget", "0", "--prompt-ids", "3,4,5,6", "--max-new-tokens", "24",
                   "--stop-token-ids", str(STOP_TOKEN), "--json", "--cache-dir", str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout, parse_constant=strict_json_constant)
    assert out["tree_budget"] == 0
    (req,) = out["requests"]
    assert req["output_ids"] == hf_greedy(target, [3, 4, 5, 6], 24, STOP_TOKEN)
    assert req["tree_steps"] == []
    decisions = req["block_size_decisions"]
    assert len(decisions) == req["stats"]["steps"] == len(req["steps"])
    # A chain step that drafted past its chosen size verifies the rows its confidences pay for
    # ("verified"); every other step verifies its block.
    verified = [d.get("verified", d["block_size"]) for d in decisions]
    assert sum(verified) == req["stats"]["verified_tokens"]
    assert all(len(step) <= rows for step, rows in zip(req["steps"], verified, strict=True))
    assert decisions[0]["why"] == "first try"
    assert any(len(d.get("expected_tokens", ())) == 4 and len(d["step_ms"]) == 4 for d in decisions)


def test_adaptive_generation_plays_trees_by_default(tmp_path):
    """Trees of up to DEFAULT_TREE_BUDGET (15) nodes beside the chains: budgets 15, 7 and 3 (a tree
    of B - 1 = 3 positions and 4 choices holds up to 84 nodes); greedy output unchanged."""
    target = tiny_target("qwen3")
    target.model.save_pretrained(tmp_path / "target")
    save_draft(random_draft(target, block_size=4), tmp_path / "draft")
    proc = run_cli("--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--adaptive",
                   "--prompt-ids", "3,4,5,6", "--max-new-tokens", "40", "--stop-token-ids", str(STOP_TOKEN), "--json",
                   "--cache-dir", str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout, parse_constant=strict_json_constant)
    assert (out["tree_budget"], out["tree_topk"]) == (15, 4)
    (req,) = out["requests"]
    assert req["output_ids"] == hf_greedy(target, [3, 4, 5, 6], 40, STOP_TOKEN)
    played = [d["tree_budget"] for d in req["block_size_decisions"]]
    assert 3 in played and 0 in played and set(played) <= {0, 3, 7, 15}
    assert len(req["tree_steps"]) == len(played) - played.count(0)


def test_adaptive_runs_start_from_what_the_last_one_learned(tmp_path):
    """The second --adaptive run of the same configuration starts from the state the first saved
    under --cache-dir (no first tries), and the greedy output is the same; --fresh-adaptive learns
    from nothing again and leaves the saved state as it was."""
    target = tiny_target("qwen3")
    target.model.save_pretrained(tmp_path / "target")
    save_draft(random_draft(target, block_size=4), tmp_path / "draft")
    want = hf_greedy(target, [3, 4, 5, 6], 24, STOP_TOKEN)

    def run(*extra: str) -> list[dict]:
        proc = run_cli("--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--adaptive",
                       "--tree-budget", "0", "--prompt-ids", "3,4,5,6", "--max-new-tokens", "24",
                       "--stop-token-ids", str(STOP_TOKEN), "--json", "--cache-dir", str(tmp_path / "cache"), *extra)
        assert proc.returncode == 0, proc.stderr
        (req,) = json.loads(proc.stdout)["requests"]
        assert req["output_ids"] == want
        return req["block_size_decisions"]

    assert run()[0]["why"] == "first try"
    (saved,) = (tmp_path / "cache" / "adaptive").glob("*.pkl")
    learned = saved.read_bytes()
    assert all(d["why"] != "first try" for d in run())
    assert saved.read_bytes() != learned  # the second run saved what it learned on top
    learned = saved.read_bytes()
    assert run("--fresh-adaptive")[0]["why"] == "first try"
    assert saved.read_bytes() == learned


def test_generate_json_lists_the_tree_steps(tmp_path):
    target = tiny_target("qwen3")
    target.model.save_pretrained(tmp_path / "target")
    save_draft(random_draft(target, block_size=6), tmp_path / "draft")
    # --tree-min-prob 0: every tree fills its budget (the random drafter's paths are all unlikely).
    proc = run_cli("--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--tree-budget", "9",
                   "--tree-topk", "3", "--tree-min-prob", "0", "--prompt-ids", "3,4,5,6", "--max-new-tokens", "24",
                   "--stop-token-ids", str(STOP_TOKEN), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout, parse_constant=strict_json_constant)
    assert (out["tree_budget"], out["tree_topk"], out["tree_min_prob"]) == (9, 3, 0)
    (req,) = out["requests"]
    assert req["output_ids"] == hf_greedy(target, [3, 4, 5, 6], 24, STOP_TOKEN)
    trees = req["tree_steps"]
    assert len(trees) == req["stats"]["steps"] == len(req["steps"])
    assert all(t["nodes"] == 10 and t["path"][0] == 0 and len(t["path"]) >= len(step)
               for t, step in zip(trees, req["steps"], strict=True))
    assert req["stats"]["verified_tokens"] == 10 * len(trees)


def test_generate_json_stays_strict_without_verify_steps(tmp_path):
    """One new token: no verify step, so per-step rates have nothing to divide by."""
    tiny_target("llama").model.save_pretrained(tmp_path / "target")
    proc = run_cli("--target", str(tmp_path / "target"), "--prompt-ids", "3,4", "--max-new-tokens", "1",
                   "--temperature", "0.5", "--json")
    assert proc.returncode == 0, proc.stderr
    (req,) = json.loads(proc.stdout, parse_constant=strict_json_constant)["requests"]
    assert len(req["output_ids"]) == 1 and req["steps"] == [] and req["stats"]["tau"] == 0.0


def test_generate_text_on_smollm2(tmp_path):
    target = smollm2()
    save_draft(random_draft(target, layers=1, block_size=3, target_layer_ids=(2, 20), num_target_layers=30),
               tmp_path / "draft")
    proc = run_cli("--target", "smollm2-135m", "--draft", str(tmp_path / "draft"), "--prompt", "What is 2+2?",
                   "--max-new-tokens", "6")
    assert proc.returncode == 0, proc.stderr
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                                  add_generation_prompt=True, tokenize=True)["input_ids"]
    want = target.tokenizer.decode(hf_greedy(target, prompt, 6, target.eos_token_ids[0]), skip_special_tokens=True)
    assert proc.stdout.strip() == want.strip()
    assert "tau" in proc.stderr


def test_bad_draft_path_is_one_clear_error(tmp_path):
    target = tiny_target("llama")
    target.model.save_pretrained(tmp_path / "target")
    proc = run_cli("--target", str(tmp_path / "target"), "--draft", str(tmp_path / "missing"), "--prompt-ids", "1,2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"sglang-dflash: error: draft checkpoint directory not found: {tmp_path / 'missing'}")


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "nan"], "temperature must be finite and >= 0 (0: greedy), got nan"),
    (["--temperature", "-1"], "temperature must be finite and >= 0 (0: greedy), got -1.0"),
    (["--top-k", "-2"], "top_k must be >= 0 (0: off), got -2"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--block-size", "0"], "--block-size must be >= 1, got 0 (omit it for the drafter's)"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--tree-budget", "4"], "--tree-budget needs a drafter (--draft)"),
    (["--draft", "/nonexistent/draft", "--tree-budget", "300"],
     "--tree-budget must be in [1, 256] drafted nodes, got 300"),
    (["--draft", "/nonexistent/draft", "--tree-budget", "-1"],
     "--tree-budget must be in [1, 256] drafted nodes, got -1"),
    (["--draft", "/nonexistent/draft", "--tree-budget", "4", "--tree-topk", "0"],
     "--tree-topk must be in [1, 64] choices per position, got 0"),
    (["--draft", "/nonexistent/draft", "--adaptive", "--tree-topk", "65"],
     "--tree-topk must be in [1, 64] choices per position, got 65"),
    (["--draft", "/nonexistent/draft", "--tree-budget", "4", "--tree-min-prob", "1"],
     "--tree-min-prob must be in [0, 1) (a path probability), got 1.0"),
    (["--draft", "/nonexistent/draft", "--adaptive", "--tree-min-prob", "-0.1"],
     "--tree-min-prob must be in [0, 1) (a path probability), got -0.1"),
    (["--draft", "/nonexistent/draft", "--tree-budget", "4", "--tree-min-prob", "nan"],
     "--tree-min-prob must be in [0, 1) (a path probability), got nan"),
])
def test_bad_generate_flags_are_one_clear_error_before_any_model_loads(flags, message, capsys):
    """In this process (the checks run before anything loads; test_bad_draft_path_is_one_clear_error
    runs the same error path as a subprocess). The target does not exist: a check that ran after
    loading would report that instead."""
    assert cli.main(["generate", "--target", "/nonexistent/target", "--prompt-ids", "1,2", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"sglang-dflash: error: {message}"
