"""A DFlash-2 drafter (grouped convolutions and the path selector) served on the CPU through our
worker (loopback only): greedy answers equal a plain server's, sampled requests are verified by our
kernels (SGLang's sampled selector accept has no CPU path: a sampled request would fail there).
Both servers run bf16, so prompts longer than 16 tokens take the plugin's bounded-row-count prefill
GEMM (`models.skinny.bounded_rows_linear`) in both.

The target is tests/test_sglang_cpu_server.py's tiny dummy-weight model (both servers load the same
dummy weights); the drafter is a random DFlash-2 checkpoint written by our `save_draft` in SGLang's
schema (`DFlash2DraftModel`), loaded by SGLang's own loader. TorchDynamo is off in both servers:
SGLang compiles the drafter's convolution and selector helpers with inductor, which takes minutes
on a 2-core machine and computes the same operations. Needs SGLang; marked slow (~2 minutes).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang_cpu.sh VENV installs it beside the package)",
                allow_module_level=True)

from sglang_dflash.models import DFlashConfig, DFlashDraftModel, save_draft
from sglang_dflash.serving.local_server import LocalServer, all_ready, free_port, launch_args, server_env
from tests.test_sglang_cpu_server import MASK_ID, PROMPTS, VOCAB, make_models

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT = 420
NEW_TOKENS = 24
LONG_PROMPT = " ".join(PROMPTS * 3)  # a prefill of more than 16 rows


def dflash2_drafter(directory, block_size: int = 4) -> None:
    """A random DFlash-2 drafter for make_models' target: one layer, convolutions, selector."""
    torch.manual_seed(0)
    config = DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, block_size=block_size,
                          mask_token_id=MASK_ID, target_layer_ids=(0, 1), num_target_layers=3,
                          max_position_embeddings=4096, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                          selector_top_k=4)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.2)
    save_draft(model, directory)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash2")
    target, _ = make_models(tmp / "models")
    draft = tmp / "models" / "dflash2"
    dflash2_drafter(draft)
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    env = server_env(tmp, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    args = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-total-tokens", "4096",
            "--max-running-requests", "8", "--random-seed", "0"]
    spec = LocalServer("dflash2", launch_args(target, free_port(), draft=draft, extra=args), env, tmp / "dflash2.log")
    base = LocalServer("baseline", launch_args(target, free_port(), extra=args), env, tmp / "baseline.log")
    with all_ready(spec, base, startup_timeout=STARTUP_TIMEOUT):
        yield spec, base


def _generate(server, prompt, **sampling):
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, **sampling}
    return server.post("/generate", {"text": prompt, "sampling_params": params}, timeout=300)


def test_sglang_builds_the_dflash2_drafter_and_our_worker_serves_it(servers):
    spec, _ = servers
    _generate(spec, PROMPTS[0])
    log = spec.text()
    assert "sglang-dflash: speculative algorithm DFLASH runs worker sglang_dflash.serving.worker.DFlashKernelWorker" \
        in log
    assert "sglang-dflash: first verify on cpu ran sglang_dflash kernels" in log


def test_greedy_answers_equal_the_plain_servers(servers):
    spec, base = servers
    prompts = [*PROMPTS, LONG_PROMPT]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        ours = list(pool.map(lambda p: _generate(spec, p), prompts))
    for prompt, answer in zip(prompts, ours, strict=True):
        assert answer["output_ids"] == _generate(base, prompt)["output_ids"], prompt
        assert answer["meta_info"]["spec_accept_length"] >= 1.0


def test_sampled_requests_are_verified_by_our_kernels(servers):
    spec, _ = servers
    cases = [dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.0, sampling_seed=3)]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        outs = list(pool.map(lambda c: _generate(spec, PROMPTS[1], **c), cases))
    for out in outs:
        assert len(out["output_ids"]) == NEW_TOKENS and all(0 <= t < VOCAB for t in out["output_ids"])
    # sampled for real, not greedy in disguise (random weights: 24 tokens at T = 1 all equal to greedy's
    # would be a fluke far below 1e-6)
    assert outs[3]["output_ids"] != _generate(spec, PROMPTS[1])["output_ids"]
    log = spec.text()
    assert "Traceback" not in log and "falling back to greedy" not in log
    assert spec.proc.poll() is None
