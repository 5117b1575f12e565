"""bench_adaptive's record of what an adaptive run's steps verified."""

from types import SimpleNamespace

from bench.bench_adaptive import played, shares
from bench.report import most_played


def test_played_counts_request_steps_by_what_they_verified():
    """A step counts once for every request it ran: a chain by the rows it verified (fewer than its
    block where verify_length cut it), a tree by its budget, a block of 1 as plain."""
    chain = {"block_size": 4, "why": "best", "tree_budget": 0}
    cut = {"block_size": 4, "why": "best", "drafted": 5, "verified": 3, "tree_budget": 0}
    tree = {"block_size": 8, "why": "explore", "tree_budget": 7}
    plain = {"block_size": 1, "why": "best", "tree_budget": 0}
    results = [SimpleNamespace(decisions=[chain, cut, tree, plain, plain]),
               SimpleNamespace(decisions=[chain, cut, tree])]
    counts = played(results)
    assert counts == {"B=4": 2, "B=3": 2, "tree of 7": 2, "plain": 2}
    assert played([SimpleNamespace(decisions=[])]) == {}
    assert shares(counts + played([SimpleNamespace(decisions=[plain])])) == {
        "plain": 0.3333, "B=4": 0.2222, "B=3": 0.2222, "tree of 7": 0.2222}


def test_the_report_names_the_most_played_steps():
    assert most_played({"B=3": 0.52, "plain": 0.301, "B=4": 0.09, "tree of 3": 0.089}) == "B=3 52%, plain 30%, B=4 9%"
    assert most_played(None) == "n/a"
    assert most_played({}) == "n/a"
