"""The pure parts of bench/bench_serving.py on synthetic data: per-request and per-level metrics,
tok/s ratios, output comparison and the logit margin. No server is started (the script's real
runs take minutes); tests/test_sglang_cpu_server.py covers the servers."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (the benchmark drives SGLang servers)", allow_module_level=True)

from bench import bench_serving as bs  # noqa: E402  (after the skip: it imports what SGLang brings)


def _final(ids, prompt_tokens=10, **meta):
    return {"output_ids": ids, "meta_info": {"completion_tokens": len(ids), "prompt_tokens": prompt_tokens, **meta}}


def _level(server, tok_s, temperature=0.0, concurrency=1, outcomes=()):
    return {"server": server, "temperature": temperature, "concurrency": concurrency, "output_tok_s": tok_s,
            "outcomes": list(outcomes)}


def test_outcome_times_from_stream_chunks():
    # The first chunk carries no token yet (TTFT is the first one that does), the last has all 5.
    arrivals = [(0.05, 0), (0.2, 1), (0.3, 3), (0.6, 5)]
    out = bs.outcome("gsm8k/0", _final([1, 2, 3, 4, 5], spec_accept_length=2.5, spec_verify_ct=2), arrivals)
    assert out["ttft_s"] == 0.2
    assert out["latency_s"] == 0.6
    assert out["tpot_s"] == pytest.approx((0.6 - 0.2) / 4)  # 4 tokens after the first, not 5
    assert out["spec_accept_length"] == 2.5 and out["spec_verify_ct"] == 2
    assert bs.tpot(1.0, 0.5, 1) is None


def test_level_metrics_throughput_is_total_tokens_over_wall_time():
    done = [
        {"prompt": "a", "completion_tokens": 100, "ttft_s": 0.1, "latency_s": 2.0, "tpot_s": 0.01,
         "spec_accept_length": 2.0, "spec_verify_ct": 50},
        {"prompt": "b", "completion_tokens": 10, "ttft_s": 0.3, "latency_s": 0.5, "tpot_s": 0.03,
         "spec_accept_length": 4.0, "spec_verify_ct": 3},
        {"prompt": "c", "completion_tokens": 1, "ttft_s": 0.2, "latency_s": 0.2, "tpot_s": None,
         "spec_accept_length": None, "spec_verify_ct": None},
    ]
    m = bs.level_metrics([*done, {"error": "HTTPError: 500"}, None], wall_s=2.5)
    # 111 tokens in 2.5 s; the mean of per-request rates (50, 20, 5 tok/s) would be 25.
    assert m["output_tok_s"] == pytest.approx(111 / 2.5)
    assert (m["requests"], m["completed"], m["cut"], m["errors"]) == (5, 3, 1, ["HTTPError: 500"])
    # Percentiles over the two requests with a TPOT, linearly interpolated.
    assert m["tpot_p50_ms"] == pytest.approx(20.0)
    assert m["tpot_p99_ms"] == pytest.approx(29.8)
    assert m["ttft_mean_ms"] == pytest.approx(200.0)
    assert m["spec_accept_length_mean"] == pytest.approx(3.0)
    assert m["spec_verify_ct_mean"] == pytest.approx(26.5)


def test_level_metrics_of_a_level_that_ran_nothing():
    m = bs.level_metrics([None, None], wall_s=0.0)
    assert m["output_tok_s"] is None and m["tpot_p50_ms"] is None and m["cut"] == 2


def test_speedups_divide_by_the_same_temperature_and_concurrency():
    levels = [
        _level("plain", 100.0), _level("plain", 200.0, concurrency=4), _level("plain", 90.0, temperature=0.7),
        _level("plain-plugin", 125.0),
        _level("dflash", 150.0), _level("dflash", 300.0, concurrency=4), _level("dflash-b4", 45.0, temperature=0.7),
    ]
    bs.add_speedups(levels)
    by = {(lv["server"], lv["temperature"], lv["concurrency"]): lv for lv in levels}
    assert by["dflash", 0.0, 1]["speedup_vs_plain"] == pytest.approx(1.5)
    assert by["dflash", 0.0, 1]["speedup_vs_plain_plugin"] == pytest.approx(1.2)
    assert by["dflash", 0.0, 4]["speedup_vs_plain"] == pytest.approx(1.5)
    assert "speedup_vs_plain_plugin" not in by["dflash", 0.0, 4]  # no plain-plugin level there
    assert by["dflash-b4", 0.7, 1]["speedup_vs_plain"] == pytest.approx(0.5)
    assert by["plain-plugin", 0.0, 1]["speedup_vs_plain"] == pytest.approx(1.25)
    assert "speedup_vs_plain" not in by["plain", 0.0, 1]


def test_server_configurations():
    draft = Path("/d")
    assert bs.server_config("plain", draft).env == {"SGLANG_DFLASH_DISABLE": "1"}
    assert bs.server_config("plain-plugin", draft) == bs.ServerConfig("plain-plugin", None)
    assert bs.server_config("dflash", draft) == bs.ServerConfig("dflash", draft)
    assert bs.server_config("dflash-b4", draft).extra == ("--speculative-dflash-block-size", "4")
    assert bs.server_config("dflash-b4", draft).env == {}
    pinned = bs.server_config("dflash-fixed-b4", draft)
    assert pinned.extra == ("--speculative-dflash-block-size", "4") and pinned.env == {"SGLANG_DFLASH_ADAPTIVE": "0"}
    assert bs.server_config("dflash-fixed", draft).extra == ()
    trees = bs.server_config("dflash-fixed-b8-tree7", draft)
    assert trees.extra == ("--speculative-dflash-block-size", "8")
    assert trees.env == {"SGLANG_DFLASH_ADAPTIVE": "0", "SGLANG_DFLASH_TREE_BUDGET": "7"}
    assert bs.server_config("dflash-tree7", draft).env == {"SGLANG_DFLASH_TREE_BUDGET": "7"}
    assert bs.server_config("dflash-floatdraft", draft).env == {"SGLANG_DFLASH_DRAFT_INT8": "0"}
    assert bs.server_config("dflash-fixed-b4-floatdraft", draft).env == {"SGLANG_DFLASH_ADAPTIVE": "0",
                                                                         "SGLANG_DFLASH_DRAFT_INT8": "0"}
    ngram = bs.server_config("ngram", draft)
    assert ngram == bs.ServerConfig("ngram", None, ("--speculative-algorithm", "NGRAM"))  # plugin active
    assert bs.server_config("ngram-d8", draft).extra == ("--speculative-algorithm", "NGRAM",
                                                          "--speculative-num-draft-tokens", "8")
    assert bs.baselines("ngram") == bs.baselines("dflash") == ["plain", "plain-plugin"]
    for unknown in ("eagle", "ngram-b4", "ngram-d"):
        with pytest.raises(SystemExit):
            bs.server_config(unknown, draft)


def test_step_time_counts_the_decode_steps_after_the_first_token():
    plain = {"spec_verify_ct": None, "completion_tokens": 11, "ttft_s": 0.5, "latency_s": 1.5}
    assert bs.step_ms(plain) == pytest.approx(100.0)  # 10 steps after the prefill's token
    dflash = {"spec_verify_ct": 4, "completion_tokens": 11, "ttft_s": 0.5, "latency_s": 1.5}
    assert bs.step_ms(dflash) == pytest.approx(250.0)
    assert bs.step_ms(dict(plain, completion_tokens=1)) is None


def test_request_body_seeds_only_sampled_requests():
    prompt = bs.Prompt("gsm8k/0", "text", 1003)
    assert bs.request_body(prompt, 0.0, 16)["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.0}
    assert bs.request_body(prompt, 0.7, 16)["sampling_params"]["sampling_seed"] == 1003


def test_first_divergence():
    assert bs.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bs.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bs.first_divergence([1, 2, 3], [1, 2]) == 2  # one stopped early
    assert bs.first_divergence([], [7]) == 0


def test_comparisons_count_equal_outputs_and_record_divergences():
    def rec(prompt, ids):
        return {"prompt": prompt, "output_ids": ids, "prompt_tokens": 10}

    plain = [rec("a", [1, 2, 3]), rec("b", [4, 5, 6]), rec("c", [7, 8]), {"error": "x"}]
    dflash = [rec("a", [1, 2, 3]), rec("b", [4, 9, 6]), rec("c", [7, 8, 2]), rec("d", [1])]
    levels = [_level("plain", 1.0, outcomes=plain), _level("dflash", 1.0, outcomes=dflash),
              _level("plain", 1.0, temperature=0.7, outcomes=plain),
              _level("dflash", 1.0, temperature=0.7, outcomes=dflash)]
    found = bs.comparisons(levels, sampled_too=False)
    assert len(found) == 1  # sampled outputs are not compared without deterministic inference
    c = found[0]
    assert (c["server"], c["temperature"], c["compared"], c["equal"]) == ("dflash", 0.0, 3, 1)
    assert c["divergences"] == [
        {"prompt": "b", "position": 1, "reference_token": 5, "token": 9},
        {"prompt": "c", "position": 2, "reference_token": None, "token": 2},
    ]
    assert len(bs.comparisons(levels, sampled_too=True)) == 2


def test_greedy_parity_is_reported_against_the_plugins_plain_server_and_stock_plain():
    def rec(prompt, ids):
        return {"prompt": prompt, "output_ids": ids, "prompt_tokens": 10}

    stock = [rec("a", [1, 2, 3]), rec("b", [4, 5, 6])]
    plugin = [rec("a", [1, 2, 3]), rec("b", [4, 7, 6])]  # batch-invariant decoding flips a near-tie
    dflash = [rec("a", [1, 2, 3]), rec("b", [4, 7, 6])]
    levels = [_level("plain", 1.0, outcomes=stock), _level("plain-plugin", 1.0, outcomes=plugin),
              _level("dflash", 1.0, outcomes=dflash), _level("ngram", 1.0, outcomes=plugin)]
    found = {(c["server"], c["reference"]): c for c in bs.comparisons(levels, sampled_too=False)}
    assert sorted(found) == [("dflash", "plain"), ("dflash", "plain-plugin"), ("ngram", "plain"),
                             ("ngram", "plain-plugin"), ("plain-plugin", "plain")]
    exact = found[("dflash", "plain-plugin")]
    assert exact["must_be_exact"] and (exact["compared"], exact["equal"], exact["divergences"]) == (2, 2, [])
    stock_parity = found[("dflash", "plain")]
    assert not stock_parity["must_be_exact"]
    assert stock_parity["divergences"] == [{"prompt": "b", "position": 1, "reference_token": 5, "token": 7}]
    assert found[("plain-plugin", "plain")]["equal"] == 1


def test_logit_margin_is_reference_minus_other():
    import torch

    logits = torch.tensor([0.0, 3.0, 2.5, -1.0])
    m = bs.logit_margin(logits, reference_token=2, token=1)
    assert m == {"reference_logit": 2.5, "logit": 3.0, "margin": -0.5, "fp32_argmax": 1}


def test_run_level_bounds_concurrency_and_stops_at_the_deadline():
    lock, in_flight, peak = threading.Lock(), [0], [0]

    def send(item):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.05)
        with lock:
            in_flight[0] -= 1
        if item == 3:
            raise ValueError("bad")
        return {"item": item}

    results, wall = bs.run_level(send, list(range(8)), concurrency=3, deadline=time.time() + 60)
    assert peak[0] == 3 and wall >= 0.05 * 3
    assert results[0] == {"item": 0} and results[3] == {"error": "ValueError: bad"}
    results, _ = bs.run_level(send, list(range(4)), concurrency=2, deadline=time.time() - 1)
    assert results == [None] * 4


def test_a_level_past_the_prompt_count_repeats_prompts_to_fill_its_concurrency():
    prompts = ["a", "b", "c"]
    assert bs.level_prompts(prompts, 1) == prompts and bs.level_prompts(prompts, 3) == prompts
    eight = bs.level_prompts(prompts, 8)
    assert eight == ["a", "b", "c", "a", "b", "c", "a", "b"]
    assert [chunk for chunk, _ in bs.rounds(eight, 8, ["plain"])] == [eight]  # one round of 8 at once


def test_rounds_give_every_server_each_chunk_and_rotate_who_goes_first():
    servers = ["plain", "dflash", "tree"]
    got = bs.rounds(list(range(7)), 3, servers)
    assert [chunk for chunk, _ in got] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [order for _, order in got] == [servers, ["dflash", "tree", "plain"], ["tree", "plain", "dflash"]]
    assert bs.rounds([], 2, servers) == []
