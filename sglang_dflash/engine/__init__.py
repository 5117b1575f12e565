"""Standalone DFlash speculative generation on Hugging Face targets (CPU and GPU)."""

from sglang_dflash.engine.drafters import DFlashDrafter, DraftSampling, OracleDrafter, load_drafter
from sglang_dflash.engine.generator import GenerationResult, Generator, RequestStats, SamplingParams, encode_prompt
from sglang_dflash.engine.packaged import PACKAGED_MODELS, packaged_model_dir
from sglang_dflash.engine.target import HFTarget

__all__ = [
    "DFlashDrafter", "DraftSampling", "GenerationResult", "Generator", "HFTarget", "OracleDrafter", "PACKAGED_MODELS",
    "RequestStats", "SamplingParams", "encode_prompt", "load_drafter", "packaged_model_dir",
]
