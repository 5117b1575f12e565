"""The pure parts of bench/soak_serving.py: the request mix it builds and the checks it applies to
each answer, on synthetic answers (the soak itself drives real servers: `make soak`)."""

from __future__ import annotations

import json

import pytest

from bench import soak_serving as soak

EOS = 2
CONTEXT = 2048


def _spec(**params) -> soak.Spec:
    body = {"rid": "r", "text": "Q", "sampling_params": {"max_new_tokens": 8, "temperature": 0, **params}}
    return soak.Spec("r", "generate", body, greedy=True)


def _answer(ids, text="a b", finish=None, prompt_tokens=5, **meta):
    finish = finish or {"type": "length", "length": len(ids)}
    return {"status": 200, "answer": {"text": text, "output_ids": ids, "meta_info": {
        "completion_tokens": len(ids), "prompt_tokens": prompt_tokens, "finish_reason": finish, **meta}}}


def _decode(ids):
    """A stand-in tokenizer: id 3 is ".", 4 is a newline, EOS a special token, others one letter each."""
    return "".join({3: ".", 4: "\n", EOS: "<eos>"}.get(i, chr(ord("a") + i % 26)) for i in ids)


def _check(spec, result, eos_ids):
    return soak.check(spec, result, soak.Rules(eos_ids, CONTEXT, _decode))


def test_a_well_formed_answer_passes():
    assert _check(_spec(), _answer([5, 6, 7, 8, 9, 10, 11, 12]), {EOS}) == []
    assert _check(_spec(), _answer([5, 6, EOS], finish={"type": "stop", "matched": EOS}), {EOS}) == []


@pytest.mark.parametrize("ids, finish, params, text, want", [
    ([5, EOS, 7], {"type": "stop", "matched": 7}, {}, "a", "tokens after a stop token"),
    ([5, 9, 7], {"type": "stop", "matched": 7}, {"stop_token_ids": [9]}, "a", "tokens after a stop token"),
    ([5, 6], {"type": "length", "length": 2}, {}, "a", "finish length after 2 of 8"),
    (list(range(3, 12)), None, {}, "a", "9 tokens for a budget of 8"),
    ([5, 6], {"type": "stop", "matched": "."}, {"stop": ["."]}, "a.", "stop string '.' left"),
    ([5, 3, 6, 3], {"type": "stop", "matched": "."}, {"stop": ["."]}, "f", "stop string '.' inside the answer"),
    ([5, 4, 4, 6], None, {"stop": ["\n\n"]}, "f\n\ng", "inside the answer, before its last token"),
    ([5], {"type": "abort"}, {}, "a", "finish reason"),
])
def test_each_defect_of_an_answer_is_named(ids, finish, params, text, want):
    problems = _check(_spec(**params), _answer(ids, text=text, finish=finish), {EOS})
    assert any(want in p for p in problems), problems


def test_a_stop_string_spanning_a_special_token_ends_nothing_as_in_sglang():
    """SGLang matches stop strings on the decode that keeps special tokens, and returns text that skips
    them: "\n<eos>\n" does not stop on "\n\n", yet its text holds "\n\n" (plain servers do the same)."""
    ids = [5, 4, EOS, 4, 6, 7, 8, 9]
    assert _check(_spec(stop=["\n\n"], ignore_eos=True), _answer(ids, text="f\n\nghij"), {EOS}) == []


def test_ignore_eos_allows_eos_and_stop_ids_inside_the_answer():
    """As SGLang's Req._check_token_based_finish: ignore_eos turns off stop_token_ids too."""
    ids = [5, EOS, 7, 8, 9, 10, 11, 12]
    assert _check(_spec(ignore_eos=True), _answer(ids), {EOS}) == []
    assert _check(_spec(ignore_eos=True, stop_token_ids=[7]), _answer(ids), {EOS}) == []


def test_the_token_budget_is_capped_by_the_context_length_as_sglang_does():
    """SGLang caps max_new_tokens at context_length - 2 - prompt tokens: a request right at the limit
    ends one token short of its max_new_tokens, with finish length, on plain servers too."""
    assert soak.token_budget(8, 5, CONTEXT) == 8
    assert soak.token_budget(8, CONTEXT - 9, CONTEXT) == 7
    ids = list(range(3, 10))
    at_limit = _answer(ids, finish={"type": "length", "length": 7}, prompt_tokens=CONTEXT - 9)
    assert _check(_spec(), at_limit, {EOS}) == []
    assert any("finish length after 7 of 8" in p for p in _check(_spec(), _answer(ids), {EOS}))


def test_logprobs_must_cover_every_token_and_be_log_probabilities():
    spec = _spec()
    spec.body["return_logprob"] = True
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    good = _answer(ids, output_token_logprobs=[[-0.5, t, None] for t in ids])
    assert _check(spec, good, {EOS}) == []
    short = _answer(ids, output_token_logprobs=[[-0.5, t, None] for t in ids[:-1]])
    positive = _answer(ids, output_token_logprobs=[[0.5, t, None] for t in ids])
    for bad in (short, positive):
        assert _check(spec, bad, {EOS}) != []


def test_constrained_answers_are_checked_against_their_constraint():
    spec = _spec(json_schema=json.dumps(soak.JSON_SCHEMA))
    stop = {"type": "stop", "matched": EOS}
    assert _check(spec, _answer([5, EOS], text='{"name": "a", "age": 3}', finish=stop), {EOS}) == []
    assert _check(spec, _answer([5, EOS], text='{"name": "a"}', finish=stop), {EOS}) != []
    spec = _spec(regex=soak.REGEX)
    assert _check(spec, _answer([5, EOS], text="1, 2, 3", finish=stop), {EOS}) == []
    assert _check(spec, _answer([5, EOS], text="1, x", finish=stop), {EOS}) != []


def test_n_answers_are_counted_and_malformed_requests_must_be_refused():
    spec = _spec(n=2, temperature=0.9)
    one = _answer([5] * 8)
    assert _check(spec, {"status": 200, "answer": [one["answer"]] * 2}, {EOS}) == []
    assert any("1 answers for n=2" in p for p in _check(spec, one, {EOS}))
    bad = soak.Spec("m", "malformed/empty prompt", {"text": ""})
    assert _check(bad, {"status": 400, "answer": None}, {EOS}) == []
    assert _check(bad, _answer([5]), {EOS}) != []
    assert _check(bad, {"status": None, "answer": None, "error": "ConnectionResetError"}, {EOS}) != []


def test_the_request_mix_covers_every_feature_and_stays_inside_the_context():
    from transformers import AutoTokenizer

    from sglang_dflash.engine.packaged import packaged_model_dir

    tokenizer = AutoTokenizer.from_pretrained(packaged_model_dir("smollm2-135m"))
    specs = soak.build_requests(5000, 0, tokenizer, context_length=2048)
    assert specs == soak.build_requests(5000, 0, tokenizer, context_length=2048)  # seeded
    kinds = {s.kind.split("/")[0] for s in specs}
    assert kinds == {"generate", "malformed", "disconnect", "abort"}
    bodies = [s.body for s in specs if isinstance(s.body, dict) and "rid" in s.body]
    params = [b["sampling_params"] for b in bodies]
    lengths = [len(b["input_ids"]) for b in bodies if "input_ids" in b]
    assert min(lengths) == 1 and max(lengths) > 1800
    # SGLang refuses prompt + max_new_tokens past the context, and a prompt of 2048 - 6 tokens or more
    # (its input limit); the soak's faults raise max_new_tokens after the prompt is drawn, so the 5,000
    # requests include prompts right at both limits.
    totals = [len(b.get("input_ids", ())) + b["sampling_params"]["max_new_tokens"] for b in bodies]
    assert max(totals) == 2047 and max(lengths) == 2041
    for key in ("stop", "stop_token_ids", "ignore_eos", "json_schema", "regex", "top_k", "top_p", "min_p", "n",
                "sampling_seed"):
        assert any(key in p for p in params), key
    assert any(b.get("return_logprob") for b in bodies) and any(s.stream for s in specs)
    assert min(p["max_new_tokens"] for p in params) == 1 and max(p["max_new_tokens"] for p in params) > 200


def test_an_answer_missing_fields_is_a_finding_and_an_abort_while_queued_is_fine():
    abort = soak.Spec("a", "abort", {"sampling_params": {"max_new_tokens": 64}})
    queued = {"status": 200, "answer": {"text": "", "meta_info": {"id": "a", "finish_reason": {"type": "abort"}}}}
    assert _check(abort, queued, {EOS}) == []
    no_prompt_tokens = {"status": 200, "answer": {"text": "", "output_ids": [5], "meta_info": {
        "completion_tokens": 1, "finish_reason": {"type": "length", "length": 1}}}}
    assert any("without prompt_tokens" in p for p in _check(_spec(), no_prompt_tokens, {EOS}))
    summary = soak.summarize([_spec()], [{"status": 200, "answer": "not a dict"}], soak.Rules({EOS}, CONTEXT, _decode))
    assert summary["requests_with_problems"] == 1 and "unreadable answer" in summary["problems"][0]["problems"][0]


def test_the_step_mix_counts_each_decode_token_by_its_step():
    # Prefill token (0), plain step, a chain of 4 committing 2, a tree of 7 committing 3; an n > 1
    # answer (a list) and a lost request count too, an answer without the lists adds nothing.
    one = _answer([1, 2, 3, 4, 5, 6, 7], dflash_block_size=[0, 1, 4, 4, 8, 8, 8],
                  dflash_tree_nodes=[0, 0, 0, 0, 7, 7, 7])
    chains_only = _answer([1, 2], dflash_block_size=[0, 3])["answer"]
    results = [one, {"status": 200, "answer": [chains_only, chains_only]}, None, _answer([9])]
    assert soak.step_mix(results) == {"tokens_by_step": {"plain": 1, "chain": 4, "tree": 3},
                                      "tree_tokens_by_nodes": {7: 3}}


def _proc(root, pid, argv0, rss_kb):
    d = root / str(pid)
    d.mkdir()
    (d / "cmdline").write_bytes(argv0.encode() + b"\0-m\0sglang.launch_server\0")
    status = "Name:\tpython\n" + (f"VmRSS:\t{rss_kb} kB\n" if rss_kb is not None else "")
    (d / "status").write_text(status)


def test_each_server_process_is_sampled_by_its_title(tmp_path):
    _proc(tmp_path, 10, "/venv/bin/python", 1024)
    _proc(tmp_path, 11, "sglang::scheduler", 2048)
    _proc(tmp_path, 12, "sglang::detokenizer", 512)
    _proc(tmp_path, 13, "sglang::scheduler", 4096)  # a second data-parallel rank
    _proc(tmp_path, 14, "sglang::scheduler", None)  # a zombie: no VmRSS
    got = soak.process_memory([10, 11, 12, 13, 14, 99], proc=tmp_path)  # 99: gone
    assert got == {"http_server": 2**20, "sglang::scheduler": 2 * 2**20, "sglang::detokenizer": 2**19,
                   "sglang::scheduler #2": 4 * 2**20}


def _samples(per_250: dict[str, list[float]]) -> list[dict]:
    count = len(next(iter(per_250.values())))
    return [{"requests": 250 * i, "mb": {name: mbs[i] for name, mbs in per_250.items()}} for i in range(count)]


def test_memory_growth_after_warm_up_and_over_the_second_half():
    # 2,000 requests: the scheduler grows 5 MB per 250 throughout, the detokenizer only while warming
    # up (then it swings around 80 MB), the HTTP server swings by 15 MB but its trend is flat.
    samples = _samples({"sglang::scheduler": [100 + 5 * i for i in range(9)],
                        "sglang::detokenizer": [50, 60, 70, 80, 80, 81, 79, 80, 80],
                        "http_server": [300, 315, 300, 315, 300, 315, 300, 300, 315]})
    growth = soak.memory_growth(samples)
    assert growth == {"sglang::scheduler": {"growth_after_steady_mb": 20, "mb_per_250_second_half": 5},
                      "sglang::detokenizer": {"growth_after_steady_mb": 0, "mb_per_250_second_half": -0.1},
                      "http_server": {"growth_after_steady_mb": 15, "mb_per_250_second_half": 1.5}}
    # Two samples alone (1,000 and 2,000 requests) would say 15 MB; the line through all five says 1.5.
    args = soak.parse_args([])
    checks = soak.growth_checks(growth, args)
    assert list(checks.values()) == [True, False]  # 20 <= 32 MB, but 5 > 2 MB per 250
    assert soak.growth_checks(soak.memory_growth(samples[:3]), args) == {
        "each process grew <= 2 MB per 250 requests over the second half": False}  # too short for warm-up
    assert soak.memory_growth(samples[:1]) == {name: {"growth_after_steady_mb": None, "mb_per_250_second_half": None}
                                               for name in ("sglang::scheduler", "sglang::detokenizer", "http_server")}
    assert soak.growth_checks(soak.memory_growth(samples[:1]), args) == {}


def test_greedy_parity_must_be_exact_against_the_plugins_plain_server_and_is_only_reported_against_stock():
    args = soak.parse_args([])
    summary = {"sent": args.requests, "requests_with_problems": 0}
    idle = {"num_used_tokens": 0, "num_used_tokens_after_flush": 0, "leak_log_lines": []}
    rss = {"growth_mb": 0, "growth_by_process": {}}
    shutdown = {"processes_left_after_exit": [], "clients_hung": 0}

    def parity(plugin_equal, stock_equal):
        return {"plain-plugin": {"compared": 10, "equal": plugin_equal, "near_ties": 10 - plugin_equal},
                "plain": {"compared": 10, "equal": stock_equal, "near_ties": 10 - stock_equal}}

    name = "greedy equals the plain server with the plugin, exactly"
    assert soak.verdicts(summary, idle, rss, True, shutdown, parity(10, 7), args)[name]
    checks = soak.verdicts(summary, idle, rss, True, shutdown, parity(9, 10), args)
    assert not checks[name]  # a near-tie against the plugin's plain server is a failure
    assert not any("stock" in check or "near-ties" in check for check in checks)


@pytest.mark.parametrize("count", [1, 3, 7, 10])
def test_a_capped_parity_replay_spreads_over_the_whole_run(count):
    items = list(range(10 * count + 3))
    picked = soak.spread(items, count)
    assert len(picked) == len(set(picked)) == count
    assert picked[0] == 0 and picked == sorted(picked)
    assert picked[-1] >= len(items) - len(items) // count - 1  # the run's end is covered too
    assert soak.spread(items[:5], 10) == items[:5] and soak.spread(items, None) == items


def test_records_of_several_servers_merge_into_one_that_keeps_each():
    a = {"in_flight": 6, "clients_hung": 0, "processes_left_after_exit": [], "exit_code": 0, "seconds_to_exit": 2.5,
         "outcomes": [{"outcome": "answered"}]}
    b = {"in_flight": 6, "clients_hung": 1, "processes_left_after_exit": [123], "exit_code": -9,
         "seconds_to_exit": 4.0, "outcomes": [{"outcome": "connection closed"}]}
    assert soak.merged([a], ["dflash"]) is a
    m = soak.merged([a, b], ["dflash-0", "dflash-1"])
    assert m["in_flight"] == 12 and m["clients_hung"] == 1 and m["processes_left_after_exit"] == [123]
    assert m["seconds_to_exit"] == 4.0 and len(m["outcomes"]) == 2 and "exit_code" not in m
    assert m["per_server"] == {"dflash-0": a, "dflash-1": b}


def test_behind_the_router_every_backend_must_serve_and_greedy_must_equal_one_server_alone():
    args = soak.parse_args(["--servers", "2"])
    idle = {"num_used_tokens": 0, "num_used_tokens_after_flush": 0, "leak_log_lines": []}
    rss = {"growth_mb": 0, "growth_by_process": {}}
    shutdown = {"processes_left_after_exit": [], "clients_hung": 0}
    parity = {soak.SINGLE_REFERENCE: {"compared": 10, "equal": 10, "near_ties": 0},
              "plain-plugin": {"compared": 10, "equal": 10, "near_ties": 0}}
    served = "every server behind the router served requests"
    single = "greedy through the router equals one DFLASH server alone, exactly"

    def verdicts(backends, single_equal):
        summary = {"sent": args.requests, "requests_with_problems": 0, "served_by_backend": backends}
        return soak.verdicts(summary, idle, rss, True, shutdown,
                             dict(parity, **{soak.SINGLE_REFERENCE: dict(parity[soak.SINGLE_REFERENCE],
                                                                         equal=single_equal)}), args)

    assert verdicts([480, 520], 10)[served] and verdicts([480, 520], 10)[single]
    assert not verdicts([1000, 0], 10)[served]
    assert not verdicts([480, 520], 9)[single]
    one_server = soak.verdicts({"sent": args.requests, "requests_with_problems": 0}, idle, rss, True, shutdown,
                               None, args)
    assert served not in one_server and single not in one_server
