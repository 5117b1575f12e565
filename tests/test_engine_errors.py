"""Bad inputs to the engine give one clear error each."""

from __future__ import annotations

import pytest

from sglang_dflash.engine import DFlashDrafter, Generator, HFTarget, SamplingParams, load_drafter
from sglang_dflash.models import ConfigError
from tests.dflash_testlib import random_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def test_drafter_target_mismatch(target):
    with pytest.raises(ValueError, match="hidden_size 32 != target hidden size 64"):
        DFlashDrafter(random_draft(target, hidden_size=32), target)
    with pytest.raises(ValueError, match="vocab_size 200 != target vocab size 96"):
        DFlashDrafter(random_draft(target, vocab_size=200, mask_token_id=150), target)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashDrafter(random_draft(target, target_layer_ids=(1, 4), num_target_layers=None), target)
    with pytest.raises(ValueError, match="num_target_layers 36"):
        DFlashDrafter(random_draft(target, num_target_layers=36), target)
    with pytest.raises(ConfigError, match="mask_token_id"):
        random_draft(target, mask_token_id=96)


def test_unknown_draft_dtype_names_the_choices(target, tmp_path):
    with pytest.raises(ValueError, match="draft dtype 'int4': expected one of auto, bfloat16, float32, int8"):
        load_drafter(tmp_path, target, "int4")


def test_bad_generation_inputs(target):
    gen = Generator(target, DFlashDrafter(random_draft(target, block_size=4), target), 4)
    with pytest.raises(ValueError, match="block_size must be in \\[1, 4\\]"):
        Generator(target, DFlashDrafter(random_draft(target, block_size=4), target), 5)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        gen.generate([[1, 2], []])
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        gen.generate([[1, 96]])
    with pytest.raises(ValueError, match="prompts is empty"):
        gen.generate([])
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize("fields,message", [
    (dict(temperature=float("nan")), "temperature must be finite and >= 0"),
    (dict(temperature=float("inf")), "temperature must be finite and >= 0"),
    (dict(temperature=-1.0), "temperature must be finite and >= 0"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_p=float("nan")), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
])
def test_sampling_params_refuse_values_that_would_decode_silently_wrong(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9)  # and take good ones


def test_missing_target_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        HFTarget.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="nor is it a packaged model: .*smollm2-135m"):
        HFTarget.from_pretrained("smollm2-13m")  # a typo of a packaged name
