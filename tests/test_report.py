"""The generated tables in README.md and docs/ are what bench/report.py writes from bench/results/,
and the generator refuses result files it cannot vouch for."""

from __future__ import annotations

import json
import shutil

import pytest

from bench import report


def test_generated_sections_match_the_result_files():
    differ = report.differing_sections()
    assert not differ, f"generated sections differ from bench/results/ (run `python -m bench.report`): {differ}"


def test_every_section_has_a_document_and_reads_listed_files():
    for section in report.SECTIONS:
        assert (report.ROOT / section.doc).is_file(), section.doc
        assert set(section.files) <= set(report.MANIFEST), section.name


@pytest.fixture
def results_copy(tmp_path):
    directory = tmp_path / "results"
    shutil.copytree(report.RESULTS, directory)
    return directory


def render(directory):
    return report.render_sections(report.Results(directory))


def edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_missing_result_file_is_named(results_copy):
    (results_copy / "soak_smollm2-135m.json").unlink()
    with pytest.raises(report.ReportError, match=r"soak_smollm2-135m\.json: missing"):
        render(results_copy)


def test_a_file_that_is_not_json_is_named(results_copy):
    (results_copy / "cpu_ops.json").write_text('{"provenance": ')
    with pytest.raises(report.ReportError, match=r"cpu_ops\.json: not valid JSON"):
        render(results_copy)


@pytest.mark.parametrize("name, change", [
    ("e2e_smollm2-135m.json", lambda d: d.pop("cases")),
    ("e2e_smollm2-135m_trees_bf16.json", lambda d: d["cases"][3].pop("speedup")),
    ("serving_smollm2-135m.json", lambda d: d["levels"][0].update(output_tok_s=None)),
    ("serving_smollm2-135m_load.json", lambda d: d["levels"][-1].update(completed=0)),
    ("engine_cpu.json", lambda d: d["provenance"].pop("git")),
    ("gpu_check_h200.json", lambda d: d.pop("stages")),
    ("bench_kernels_h200.json", lambda d: d["cases"][0]["ours"].update(median_ms="fast")),
])
def test_a_malformed_result_file_is_named(results_copy, name, change):
    edit(results_copy / name, change)
    with pytest.raises(report.ReportError, match=rf"{name.replace('.', '[.]')}.*malformed"):
        render(results_copy)


def test_an_unlisted_result_file_is_refused(results_copy):
    shutil.copy(results_copy / "cpu_ops.json", results_copy / "cpu_ops_run2.json")
    with pytest.raises(report.ReportError, match=r"cpu_ops_run2\.json"):
        render(results_copy)


def test_a_missing_plot_is_named(results_copy):
    (results_copy / "serving_smollm2-135m.png").unlink()
    with pytest.raises(report.ReportError, match=r"serving_smollm2-135m\.png: missing"):
        render(results_copy)


def test_a_server_run_at_an_unknown_commit_is_not_labelled_by_guess(results_copy):
    edit(results_copy / "serving_smollm2-135m.json", lambda d: d["provenance"]["git"].update(commit="f" * 40))
    with pytest.raises(report.ReportError, match="SERVED_DEFAULTS"):
        render(results_copy)


def test_a_changed_number_is_found_and_rewritten(tmp_path):
    docs = {s.doc for s in report.SECTIONS}
    for doc in docs:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(report.ROOT / doc, tmp_path / doc)
    readme = tmp_path / "README.md"
    original = readme.read_text()
    begin, end = report.markers("summary")
    body = original.split(begin)[1].split(end)[0]
    soak = json.loads((report.RESULTS / "soak_smollm2-135m.json").read_text())["checks"]
    passed = f"{sum(soak.values())} of {len(soak)} checks pass"
    assert passed in body  # the soak row, from soak_smollm2-135m.json
    readme.write_text(original.replace(passed, f"{len(soak) + 1} of {len(soak)} checks pass"))
    assert report.differing_sections(tmp_path, report.RESULTS) == ["README.md: summary"]
    rewritten = report.generated_documents(tmp_path, report.RESULTS)
    assert rewritten["README.md"][1] == original


def test_missing_markers_are_named(tmp_path):
    with pytest.raises(report.ReportError, match="README.md: needs exactly one"):
        report.replace_section("no markers here", "README.md", "summary", "body")
