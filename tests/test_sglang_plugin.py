"""The SGLang plugin and worker, against a real SGLang 0.5.23 (no mocks of SGLang).

Skipped when SGLang is not installed (install it with `scripts/install_sglang_cpu.sh VENV`).
The plugin is loaded through SGLang's own `load_plugins()`; when the package's entry point is not
installed (a checkout on PYTHONPATH), a temporary distribution that declares it is put on
sys.path. SGLang's global plugin state is saved and restored around every test.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
import types
from importlib import metadata
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "SGLang is not installed (scripts/install_sglang_cpu.sh VENV installs it beside the package)",
        allow_module_level=True,
    )

import torch  # noqa: E402
from scipy import stats  # noqa: E402

from sglang_dflash import settings  # noqa: E402
from sglang_dflash.ops import reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EP_GROUP = "sglang.srt.plugins"
EP_VALUE = "sglang_dflash.serving.plugin:register"
LOGGER = "sglang_dflash.serving.plugin"


# -- the plugin module is import-light -------------------------------------------------------


def test_plugin_module_imports_nothing_heavy():
    code = (
        "import sys, sglang_dflash.serving, sglang_dflash.serving.plugin as p\n"
        "assert callable(p.register)\n"
        "heavy = sorted(m for m in ('torch', 'sglang', 'sglang_dflash._C', 'sglang_dflash.serving.worker')"
        " if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


# -- registration through load_plugins() ----------------------------------------------------


def _entry_point_installed() -> bool:
    return any(ep.value == EP_VALUE for ep in metadata.entry_points(group=EP_GROUP))


@pytest.fixture
def sglang_plugins(tmp_path, monkeypatch):
    """SGLang's plugin machinery with our entry point discoverable, restored afterwards."""
    import sglang.srt.plugins as sgl_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    import sglang_dflash.serving.plugin as plugin

    if not _entry_point_installed():
        dist = tmp_path / "sglang_dflash_entry_point-0.0.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-dflash-entry-point\nVersion: 0.0.0\n")
        (dist / "entry_points.txt").write_text(f"[{EP_GROUP}]\nsglang_dflash = {EP_VALUE}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    for var in (settings.DISABLE.name, settings.STRICT.name, "SGLANG_PLUGINS", "SGLANG_USE_CPU_ENGINE"):
        monkeypatch.delenv(var, raising=False)

    import pkgutil

    from sglang_dflash.serving import cpu, request_checks

    saved_attrs = []
    for target in [plugin.HOOK_TARGET, request_checks.HOOK_TARGET] + [t for t, _ in cpu.HOOKS]:
        owner_path, name = target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_path)
        saved_attrs.append((owner, name, owner.__dict__[name]))
    saved_hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    saved_loaded = sgl_plugins._plugins_loaded
    saved_plugin = (plugin._registered, plugin.SUPPORTED_SGLANG_VERSIONS)
    sgl_plugins._plugins_loaded = False
    HookRegistry.reset()
    plugin._registered = False
    try:
        yield types.SimpleNamespace(
            load_plugins=sgl_plugins.load_plugins,
            HookRegistry=HookRegistry,
            SpeculativeAlgorithm=SpeculativeAlgorithm,
            plugin=plugin,
        )
    finally:
        for owner, name, value in saved_attrs:
            setattr(owner, name, value)
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)
        sgl_plugins._plugins_loaded = saved_loaded
        plugin._registered, plugin.SUPPORTED_SGLANG_VERSIONS = saved_plugin


def _our_hooks(registry):
    from sglang_dflash.serving.plugin import HOOK_TARGET, _create_worker_around

    return [h for _, h, _ in registry._hooks.get(HOOK_TARGET, []) if h is _create_worker_around]


def _server_args():
    return types.SimpleNamespace(device="cpu")


def test_load_plugins_makes_dflash_use_our_worker(sglang_plugins):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dflash.serving.worker import DFlashKernelWorker

    s = sglang_plugins
    original = s.SpeculativeAlgorithm.create_worker
    s.load_plugins()
    assert len(_our_hooks(s.HookRegistry)) == 1
    cls = s.SpeculativeAlgorithm.DFLASH.create_worker(_server_args())
    assert cls is DFlashKernelWorker and issubclass(cls, DFlashWorkerV2)
    # The CLI name goes through the same enum member.
    assert s.SpeculativeAlgorithm.from_string("dflash").create_worker(_server_args()) is DFlashKernelWorker
    # Other algorithms get exactly what SGLang gives them.
    for name in ("NGRAM", "STANDALONE"):
        algo = s.SpeculativeAlgorithm.from_string(name)
        assert algo.create_worker(_server_args()) is original(algo, _server_args())


def test_disabled_registers_nothing(sglang_plugins, monkeypatch):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    s = sglang_plugins
    monkeypatch.setenv(settings.DISABLE.name, "1")
    s.load_plugins()
    assert _our_hooks(s.HookRegistry) == []
    assert s.SpeculativeAlgorithm.DFLASH.create_worker(_server_args()) is DFlashWorkerV2


def test_disabled_at_worker_creation(sglang_plugins, monkeypatch):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    s = sglang_plugins
    s.load_plugins()
    monkeypatch.setenv(settings.DISABLE.name, "1")
    assert s.SpeculativeAlgorithm.DFLASH.create_worker(_server_args()) is DFlashWorkerV2


def test_version_mismatch_falls_back_with_a_warning(sglang_plugins, caplog):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    s = sglang_plugins
    s.plugin.SUPPORTED_SGLANG_VERSIONS = ("0.0.1",)
    with caplog.at_level(logging.WARNING):
        s.load_plugins()
    assert _our_hooks(s.HookRegistry) == []
    assert s.SpeculativeAlgorithm.DFLASH.create_worker(_server_args()) is DFlashWorkerV2
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not a version sglang-dflash was checked against (0.0.1)" in warnings[0]
    assert "built-in worker" in warnings[0]


def test_version_mismatch_found_at_worker_creation_falls_back(sglang_plugins, caplog):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    s = sglang_plugins
    s.load_plugins()
    s.plugin.SUPPORTED_SGLANG_VERSIONS = ("0.0.1",)
    with caplog.at_level(logging.WARNING):
        assert s.SpeculativeAlgorithm.DFLASH.create_worker(_server_args()) is DFlashWorkerV2
    assert any("falls back to SGLang's built-in worker" in r.getMessage() for r in caplog.records)


def test_strict_version_mismatch_raises_at_worker_creation(sglang_plugins, monkeypatch):
    s = sglang_plugins
    monkeypatch.setenv(settings.STRICT.name, "1")
    s.plugin.SUPPORTED_SGLANG_VERSIONS = ("0.0.1",)
    s.load_plugins()  # SGLang swallows errors raised here, so strict mode still registers the hook
    assert len(_our_hooks(s.HookRegistry)) == 1
    with pytest.raises(s.plugin.IncompatibleSGLangError, match=r"not a version .* \(0\.0\.1\)"):
        s.SpeculativeAlgorithm.DFLASH.create_worker(_server_args())
    # Other algorithms are unaffected.
    ngram = s.SpeculativeAlgorithm.from_string("NGRAM")
    assert ngram.create_worker(_server_args()) is not None


def test_strict_with_a_compatible_sglang_uses_our_worker(sglang_plugins, monkeypatch):
    from sglang_dflash.serving.worker import DFlashKernelWorker

    s = sglang_plugins
    monkeypatch.setenv(settings.STRICT.name, "1")
    s.load_plugins()
    assert s.SpeculativeAlgorithm.DFLASH.create_worker(_server_args()) is DFlashKernelWorker


def _hooked(target):
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [h for _, h, _ in HookRegistry._hooks.get(target, [])]


def test_on_cpu_every_speculative_algorithm_gets_sgl_kernels_missing_ops(sglang_plugins, monkeypatch):
    """The create_worker hook supplies the ops before any worker of the algorithm is built; with
    the plugin disabled (at start-up or by the time the worker is created) it supplies nothing."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dflash.serving import sgl_kernel_ops

    s = sglang_plugins
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    calls = []
    monkeypatch.setattr(sgl_kernel_ops, "register_missing", lambda: calls.append(1) or ["copy_all_layer_kv_cache_cpu"])
    original = s.SpeculativeAlgorithm.create_worker
    s.load_plugins()
    ngram = s.SpeculativeAlgorithm.from_string("NGRAM")
    assert ngram.create_worker(_server_args()) is original(ngram, _server_args())
    assert calls == [1]
    monkeypatch.setenv(settings.DISABLE.name, "1")
    assert ngram.create_worker(_server_args()) is original(ngram, _server_args())
    assert s.SpeculativeAlgorithm.DFLASH.create_worker(_server_args()) is DFlashWorkerV2
    assert calls == [1]


def test_disabled_on_cpu_registers_nothing(sglang_plugins, monkeypatch):
    from sglang_dflash.serving import cpu

    s = sglang_plugins
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.setenv(settings.DISABLE.name, "1")
    s.load_plugins()
    assert _our_hooks(s.HookRegistry) == []
    assert all(_hooked(t) == [] for t, _ in cpu.HOOKS)


def test_cpu_hooks_only_with_sglangs_cpu_engine(sglang_plugins, monkeypatch):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sglang_dflash.serving import cpu

    s = sglang_plugins
    s.load_plugins()
    assert all(_hooked(t) == [] for t, _ in cpu.HOOKS)
    assert not hasattr(TorchNativeAttnBackend.forward_extend, "__wrapped__")


def test_cpu_hooks_are_installed_with_sglangs_cpu_engine(sglang_plugins, monkeypatch):
    import pkgutil

    from sglang_dflash.serving import cpu

    s = sglang_plugins
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    s.load_plugins()
    for target, hook in cpu.HOOKS:
        assert _hooked(target) == [hook]
        owner_path, name = target.rsplit(".", 1)
        assert getattr(pkgutil.resolve_name(owner_path), name).__wrapped__ is not None


def test_seams_are_present_in_this_sglang():
    from sglang_dflash.serving import plugin, worker

    assert plugin.version_problem() is None
    assert worker.compatibility_problems() == []


def test_plugin_runs_in_a_fresh_process_through_load_plugins(tmp_path):
    """End to end in a new interpreter, as in every SGLang process: the entry point is found."""
    path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    if not _entry_point_installed():
        dist = tmp_path / "sglang_dflash_entry_point-0.0.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-dflash-entry-point\nVersion: 0.0.0\n")
        (dist / "entry_points.txt").write_text(f"[{EP_GROUP}]\nsglang_dflash = {EP_VALUE}\n")
        path.insert(0, str(tmp_path))
    code = textwrap.dedent(
        """
        import logging, sys, types
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
        from sglang.srt.plugins import load_plugins
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        load_plugins()
        cls = SpeculativeAlgorithm.from_string("dflash").create_worker(types.SimpleNamespace(device="cpu"))
        print("WORKER", cls.__module__ + "." + cls.__qualname__)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    for var in ("SGLANG_DFLASH_DISABLE", "SGLANG_DFLASH_STRICT", "SGLANG_PLUGINS"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WORKER sglang_dflash.serving.worker.DFlashKernelWorker" in proc.stdout


# -- _accept_block: ours against SGLang's own torch path -------------------------------------


def _bare_worker(cls, block_size, *, random_seed=1234, device="cpu",
                 kernel_ops=("verify_block", "verify_block_from_ids")):
    """An instance with just the state `_accept_block` reads (the full __init__ needs a model).

    Every attribute set here is one DFlashWorkerV2.__init__ sets; everything else is SGLang's.
    """
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    from sglang_dflash.serving.worker import DFlashKernelWorker

    w = object.__new__(cls)
    w._dflash_device = torch.device(device)
    w._target_worker = types.SimpleNamespace(random_seed=random_seed)  # TpModelWorker's resolved seed
    w.device = device
    w.block_size = block_size
    w._accept_bonus_buffer_cap = 0
    w._accept_bonus_buffer_slot = 0
    w._accept_len_buf = None
    w._selector_sample = None
    w.selector = None
    w.lilicorr = None
    w._use_triton_accept_bonus = False  # what __init__ decides without a GPU
    w._warned_sampling_fallback = False
    w._tp_sync = SpecTpSync(types.SimpleNamespace(world_size=1, rank_in_group=0))
    if issubclass(cls, DFlashKernelWorker):
        w._init_dflash_kernels(_spec(), kernel_ops)
        w._trees = None  # as _init_trees leaves it without SGLANG_DFLASH_TREE_BUDGET
    return w


def _spec(single=1.0, acc=1.0):
    """SGLang's resolved speculative settings (get_spec()) as far as the worker reads them."""
    return types.SimpleNamespace(speculative_accept_threshold_single=single, speculative_accept_threshold_acc=acc)


def _sampling_info(temperature, top_k, top_p, *, seeds=None):
    """A real SamplingBatchInfo, filled as SamplingBatchInfo.from_schedule_batch would."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    bs = len(temperature)
    # SamplingParams turns temperature 0 into (temperature 1, top_k 1).
    t = [1.0 if x == 0 else x for x in temperature]
    k = [1 if x == 0 else kk for x, kk in zip(temperature, top_k, strict=True)]
    return SamplingBatchInfo(
        temperatures=torch.tensor(t, dtype=torch.float).view(-1, 1),
        top_ps=torch.tensor(top_p, dtype=torch.float),
        top_ks=torch.tensor(k, dtype=torch.int32),
        min_ps=torch.zeros(bs),
        is_all_greedy=all(x == 1 for x in k),
        is_any_greedy=any(x == 1 for x in k),
        need_top_p_sampling=any(p != 1.0 for p in top_p),
        need_top_k_sampling=any(x != 1 << 30 for x in k),
        need_min_p_sampling=False,
        vocab_size=0,
        sampling_seed=None if seeds is None else torch.tensor(seeds, dtype=torch.int64),
    )


def _greedy_case(bs, block, vocab, seed, logits_dtype=torch.float32):
    """Logits, their argmax, and candidates that agree with it for a chosen number of rows."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs * block, vocab, generator=gen).to(logits_dtype)
    top1 = logits.float().argmax(-1).view(bs, block)
    candidates = torch.randint(0, vocab, (bs, block), generator=gen)
    for b in range(bs):
        n = b % block  # every accept length 0 .. block-1 appears
        candidates[b, 1 : n + 1] = top1[b, :n]
        if n + 1 < block:
            candidates[b, n + 1] = (top1[b, n] + 1) % vocab  # first mismatch
    prefix_lens = torch.randint(1, 500, (bs,), generator=gen)
    return logits, candidates, prefix_lens


def _call(worker, **kw):
    kw.setdefault("draft_input", None)
    kw.setdefault("sampling_info", None)
    kw.setdefault("target_predict", None)
    return worker._accept_block(**kw)


def _assert_same_decisions(ours, theirs, prefix_lens):
    acc, commit, bonus, out, new_seq = ours
    t_acc, t_commit, t_bonus, t_out, t_new_seq = theirs
    assert acc.dtype == torch.int32 and commit.dtype == torch.int32 and bonus.dtype == torch.int64
    assert out.dtype == torch.int64
    assert torch.equal(acc, t_acc)
    assert torch.equal(commit, t_commit)
    assert torch.equal(bonus, t_bonus)
    if t_new_seq is None:  # SGLang's torch path leaves it to the caller: prefix + commit
        t_new_seq = prefix_lens + t_commit.to(prefix_lens.dtype)
    assert torch.equal(new_seq.to(torch.int64), t_new_seq.to(torch.int64))
    for b in range(acc.numel()):
        c = int(commit[b])
        assert torch.equal(out[b, :c], t_out[b, :c])
        assert not out[b, c:].any()  # zeros past the commit, as SGLang's Triton kernel leaves them


@pytest.mark.parametrize("bs,block,vocab", [(1, 16, 1000), (7, 4, 97), (16, 16, 4096), (33, 8, 50)])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_greedy_accept_equals_sglang_torch_path(bs, block, vocab, logits_dtype):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dflash.serving.worker import DFlashKernelWorker

    logits, candidates, prefix_lens = _greedy_case(bs, block, vocab, seed=bs * 1000 + block, logits_dtype=logits_dtype)
    ours_w, theirs_w = _bare_worker(DFlashKernelWorker, block), _bare_worker(DFlashWorkerV2, block)
    for info in (None, _sampling_info([0.0] * bs, [1] * bs, [1.0] * bs)):
        kw = dict(candidates=candidates, next_token_logits=logits, prefix_lens=prefix_lens, bs=bs, sampling_info=info)
        ours = _call(ours_w, **kw)
        theirs = _call(theirs_w, **kw)
        _assert_same_decisions(ours, theirs, prefix_lens)
        assert sorted(set(ours[0].tolist())) == sorted(set(range(block)) & set(b % block for b in range(bs)))


@pytest.mark.parametrize("ids_shape", ["flat", "2d"])
def test_deferred_argmax_ids_equal_sglang_torch_path(ids_shape):
    """SGLang's all-greedy fast path hands over argmax ids and no logits."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dflash.serving.worker import DFlashKernelWorker

    bs, block, vocab = 9, 16, 300
    logits, candidates, prefix_lens = _greedy_case(bs, block, vocab, seed=7)
    ids = logits.argmax(-1)
    ids = ids if ids_shape == "flat" else ids.view(bs, block)
    kw = dict(candidates=candidates, next_token_logits=None, prefix_lens=prefix_lens, bs=bs, target_predict=ids)
    ours = _call(_bare_worker(DFlashKernelWorker, block), **kw)
    theirs = _call(_bare_worker(DFlashWorkerV2, block), **dict(kw, target_predict=ids.clone()))
    _assert_same_decisions(ours, theirs, prefix_lens)


def test_results_live_in_sglangs_double_buffers():
    """Two consecutive steps return different storage (overlap scheduling reads step n while n+1 runs)."""
    from sglang_dflash.serving.worker import DFlashKernelWorker

    bs, block, vocab = 4, 8, 64
    w = _bare_worker(DFlashKernelWorker, block)
    logits, candidates, prefix_lens = _greedy_case(bs, block, vocab, seed=3)
    first = _call(w, candidates=candidates, next_token_logits=logits, prefix_lens=prefix_lens, bs=bs)
    kept = [t.clone() for t in first]
    second = _call(w, candidates=candidates, next_token_logits=logits, prefix_lens=prefix_lens, bs=bs)
    slot0 = w._commit_lens_bufs[0].data_ptr(), w._out_tokens_bufs[0].data_ptr()
    assert (first[1].data_ptr(), first[3].data_ptr()) == slot0
    assert second[1].data_ptr() != first[1].data_ptr() and second[3].data_ptr() != first[3].data_ptr()
    for a, b in zip(first[1:], kept[1:], strict=True):
        assert torch.equal(a, b)  # the second step did not overwrite the first step's results


def test_simulated_acceptance_goes_to_sglang(monkeypatch):
    """SGLANG_SIMULATE_ACC_LEN (a benchmark knob SGLang reads at import) is SGLang's business: with
    it set, SGLang's own path forces the lengths and fixed tokens, exactly as the parent does."""
    import sglang.srt.speculative.dflash_worker_v2 as sgl_worker
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dflash.serving.worker import DFlashKernelWorker

    bs, block, vocab = 3, 8, 64
    logits, candidates, prefix_lens = _greedy_case(bs, block, vocab, seed=11)
    monkeypatch.setattr(sgl_worker, "SIMULATE_ACC_LEN", 5)
    monkeypatch.setattr(sgl_worker, "SIMULATE_ACC_METHOD", "match-expected")
    monkeypatch.setattr(sgl_worker, "SIMULATE_ACC_TOKEN_MODE", "fixed")
    kw = dict(candidates=candidates, next_token_logits=logits, prefix_lens=prefix_lens, bs=bs)
    ours = _call(_bare_worker(DFlashKernelWorker, block), **kw)
    theirs = _call(_bare_worker(DFlashWorkerV2, block), **kw)
    assert ours[0].tolist() == [4] * bs and ours[1].tolist() == [5] * bs  # forced: commit 5
    for a, b in zip(ours, theirs, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


# -- sampling ---------------------------------------------------------------------------------


def test_sampled_accept_matches_the_reference_op():
    """Per-request temperature / top-k / top-p reach verify_block as the op's spec defines them."""
    from sglang_dflash.serving.worker import DFlashKernelWorker, unseeded_offsets

    bs, block, vocab, seed = 6, 8, 40, 99
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(bs * block, vocab, generator=gen) * 2
    temps, top_ks, top_ps = [0.0, 0.7, 1.0, 1.3, 0.0, 0.9], [0, 5, 1 << 30, 20, 0, 3], [1.0, 0.9, 0.8, 1.0, 1.0, 1.0]
    info = _sampling_info(temps, top_ks, top_ps)
    w = _bare_worker(DFlashKernelWorker, block, random_seed=seed)
    for step in range(3):
        # Candidates that follow the reference's own samples for a while, so lengths vary.
        offsets = unseeded_offsets(step, bs, "cpu")
        eff_t = torch.tensor([0.0 if t == 0 else t for t in temps])
        y = reference.target_samples(logits, eff_t, torch.tensor(top_ks, dtype=torch.int32),
                                     torch.tensor(top_ps), seed, offsets, block)
        candidates = torch.randint(0, vocab, (bs, block), generator=gen)
        for b in range(bs):
            n = (b + step) % block
            candidates[b, 1 : n + 1] = y[b, :n]
        prefix_lens = torch.randint(1, 100, (bs,), generator=gen)
        acc, commit, bonus, out, new_seq = _call(
            w, candidates=candidates, next_token_logits=logits, prefix_lens=prefix_lens, bs=bs, sampling_info=info
        )
        r_acc, r_bonus, r_out = reference.verify_block_from_ids(candidates, y)
        assert torch.equal(acc, r_acc) and torch.equal(bonus, r_bonus)
        assert torch.equal(out, r_out.clamp(min=0)) and torch.equal(commit, r_acc + 1)
        assert torch.equal(new_seq, prefix_lens + commit)
        assert (acc >= torch.tensor([(b + step) % block for b in range(bs)])).all()


def test_deterministic_inference_offsets_follow_request_seed_and_length():
    """With per-request sampling seeds, the same request state gives the same sample."""
    from sglang_dflash.serving.worker import DFlashKernelWorker

    bs, block, vocab = 4, 4, 500
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(bs * block, vocab, generator=gen)
    candidates = torch.randint(0, vocab, (bs, block), generator=gen)
    info = _sampling_info([1.0] * bs, [1 << 30] * bs, [1.0] * bs, seeds=[7, 7, 8, 7])
    prefix = torch.tensor([10, 10, 10, 11])
    w = _bare_worker(DFlashKernelWorker, block)
    kw = dict(candidates=candidates, next_token_logits=logits, prefix_lens=prefix, bs=bs, sampling_info=info)
    runs = [_call(w, **kw)[2].clone() for _ in range(2)]
    assert torch.equal(runs[0], runs[1])  # reproducible across steps for the same state


def test_sampled_bonus_follows_the_target_distribution():
    """Chi-square: with no draft accepted, the bonus is a sample of softmax(logits / T) over the
    top-k / top-p set, independently for every request row."""
    from sglang_dflash.serving.worker import DFlashKernelWorker

    bs, block, vocab = 6000, 2, 12
    temperature, top_k, top_p = 0.8, 9, 0.9
    gen = torch.Generator().manual_seed(21)
    row = torch.randn(vocab, generator=gen) * 1.5
    logits = row.repeat(bs * block, 1)
    x = row / temperature
    keep = reference.sampling_mask(x, top_k, top_p)
    probs = torch.softmax(x.masked_fill(~keep, float("-inf")), 0)
    candidates = torch.zeros(bs, block, dtype=torch.int64)
    candidates[:, 1] = int(torch.argmin(row))  # never sampled (outside top-k): accept_len 0
    info = _sampling_info([temperature] * bs, [top_k] * bs, [top_p] * bs)
    w = _bare_worker(DFlashKernelWorker, block, random_seed=3)
    acc, _, bonus, _, _ = _call(
        w, candidates=candidates, next_token_logits=logits, prefix_lens=torch.ones(bs, dtype=torch.int64),
        bs=bs, sampling_info=info,
    )
    assert not acc.any()
    counts = torch.bincount(bonus, minlength=vocab).double()
    assert counts[~keep].sum() == 0
    support = keep.nonzero().flatten()
    expected = probs[support].double()
    expected = expected / expected.sum() * counts[support].sum()
    pvalue = stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue
    assert pvalue > 1e-3, (counts, probs * bs)


def test_sampling_on_cpu_does_not_warn_about_a_greedy_fallback(caplog):
    """SGLang has no sampled verify op on CPU and warns it verifies greedily; ours samples."""
    from sglang_dflash.serving.worker import DFlashKernelWorker

    w = _bare_worker(DFlashKernelWorker, 4)
    batch = types.SimpleNamespace(sampling_info=_sampling_info([0.9], [1 << 30], [1.0]))
    with caplog.at_level(logging.WARNING):
        w._validate_phase1_sampling_support(batch)
    assert not [r for r in caplog.records if "falling back to greedy" in r.getMessage()]


# -- attention: TARGET_VERIFY on block_attention, over SGLang's own KV pool -------------------


def _verify_attention_case(attn_type, sliding_window_size, seed=0):
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    gen = torch.Generator().manual_seed(seed)
    hq, hkv, dim, block, ctx = 4, 2, 16, 4, [5, 9, 0]
    bs = len(ctx)
    pool = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float32, head_num=hkv, head_dim=dim, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    pool.get_key_buffer(0).copy_(torch.randn(pool.get_key_buffer(0).shape, generator=gen))
    pool.get_value_buffer(0).copy_(torch.randn(pool.get_value_buffer(0).shape, generator=gen))
    slots = torch.randperm(60, generator=gen) + 1
    table = torch.zeros(bs + 1, 32, dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    out_loc, used = [], 0
    for b in range(bs):
        table[rows[b], : ctx[b] + block] = slots[used : used + ctx[b] + block].int()
        out_loc.append(table[rows[b], ctx[b] : ctx[b] + block])
        used += ctx[b] + block
    layer = RadixAttention(hq, dim, 0.3, hkv, layer_id=0, attn_type=attn_type,
                           sliding_window_size=sliding_window_size)
    fb = types.SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=None,
        req_pool_indices=rows, seq_lens=torch.tensor(ctx), out_cache_loc=torch.cat(out_loc).long(),
    )
    n = bs * block
    q, k, v = (torch.randn(n, h * dim, generator=gen) for h in (hq, hkv, hkv))
    return layer, pool, table, fb, q, k, v, block


@pytest.mark.parametrize("kind", ["draft", "verify", "draft_sliding", "verify_sliding"])
def test_paged_block_attention_over_sglangs_pool(kind):
    from sglang.srt.layers.radix_attention import AttentionType

    from sglang_dflash.serving.attention import covers, paged_block_attention

    attn_type = AttentionType.ENCODER_ONLY if kind.startswith("draft") else AttentionType.DECODER
    sws = 3 if kind.endswith("sliding") else -1
    layer, pool, table, fb, q, k, v, block = _verify_attention_case(attn_type, sws)
    context_k = pool.get_key_buffer(0).clone()
    context_v = pool.get_value_buffer(0).clone()
    assert covers(layer, fb, q, pool.get_key_buffer(0))
    out = paged_block_attention(q, k, v, layer, fb, kv_pool=pool, req_to_token=table)
    hq, hkv, dim = 4, 2, 16
    ref = reference.block_attention(
        q.view(-1, hq, dim), k.view(-1, hkv, dim), v.view(-1, hkv, dim), context_k, context_v, table,
        fb.req_pool_indices, fb.seq_lens, block, sm_scale=0.3, window=sws + 1 if sws > -1 else -1,
        causal_block=attn_type != AttentionType.ENCODER_ONLY,
    )
    torch.testing.assert_close(out, ref.reshape(out.shape), rtol=1e-5, atol=1e-5)
    # The block's K/V were written to its slots, as SGLang's backends do.
    assert torch.equal(pool.get_key_buffer(0)[fb.out_cache_loc], k.view(-1, hkv, dim))
    assert torch.equal(pool.get_value_buffer(0)[fb.out_cache_loc], v.view(-1, hkv, dim))


def test_ngram_tree_verify_runs_block_attention_over_its_trees():
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dflash.serving.attention import covers, paged_block_attention

    layer, pool, table, fb, q, k, v, block = _verify_attention_case(AttentionType.DECODER, -1)
    bs = fb.req_pool_indices.shape[0]
    parents = torch.tensor([[-1] + [max(i - 2, 0) for i in range(1, block)] for _ in range(bs)])
    parents[0, 1:] = 0  # a star
    mask = reference.tree_ancestors(parents)
    fb.spec_algorithm = SpeculativeAlgorithm.from_string("NGRAM")
    fb.spec_info = types.SimpleNamespace(custom_mask=mask.flatten(), draft_token_num=block)
    context_k, context_v = pool.get_key_buffer(0).clone(), pool.get_value_buffer(0).clone()
    assert covers(layer, fb, q, pool.get_key_buffer(0))
    out = paged_block_attention(q, k, v, layer, fb, kv_pool=pool, req_to_token=table)
    hq, hkv, dim = 4, 2, 16
    ref = reference.block_attention(
        q.view(-1, hq, dim), k.view(-1, hkv, dim), v.view(-1, hkv, dim), context_k, context_v, table,
        fb.req_pool_indices, fb.seq_lens, block, sm_scale=0.3, tree_parents=parents,
    )
    torch.testing.assert_close(out, ref.reshape(out.shape), rtol=1e-5, atol=1e-5)
    # A mask that is no tree (a node not seeing itself) stays with SGLang.
    broken = mask.clone()
    broken[1, 2, 2] = False
    fb.spec_info = types.SimpleNamespace(custom_mask=broken.flatten(), draft_token_num=block)
    assert not covers(layer, fb, q, pool.get_key_buffer(0))


WIDTH = 160  # table columns per request in the prefill tests


def _prefill(pool, table, layer, q, k, v, requests, new_tokens, prefixes, mode=None):
    """paged_prefill_attention of one EXTEND batch: requests[i] gets new_tokens[i] rows after its
    prefixes[i] cached ones; q/k/v hold every request's whole prompt, the new rows are cut out."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_dflash.serving.attention import covers_prefill, paged_prefill_attention

    pick = torch.cat([torch.arange(p, p + n) + WIDTH * r
                      for r, n, p in zip(requests, new_tokens, prefixes, strict=True)])
    fb = types.SimpleNamespace(
        forward_mode=mode or ForwardMode.EXTEND, encoder_lens=None, req_pool_indices=torch.tensor(requests),
        extend_seq_lens_cpu=list(new_tokens), extend_prefix_lens=torch.tensor(prefixes),
        out_cache_loc=torch.cat([table[r, p:p + n] for r, n, p in zip(requests, new_tokens, prefixes,
                                                                          strict=True)]).long(),
    )
    assert covers_prefill(layer, fb, q, pool.get_key_buffer(0))
    return paged_prefill_attention(q[pick], k[pick], v[pick], layer, fb, kv_pool=pool, req_to_token=table), pick


@pytest.mark.parametrize("dtype, window", [(torch.float32, -1), (torch.bfloat16, -1), (torch.float32, 5)])
def test_prefill_attention_is_the_same_bits_however_the_prefix_cache_split_the_prompt(dtype, window):
    """A prompt prefilled in one go, in two parts (the first cached), or decoded token by token: every
    row's attention is the same bits, and equals the reference within rounding."""
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_dflash.serving.attention import paged_block_attention

    gen = torch.Generator().manual_seed(7)
    hq, hkv, dim, lengths = 6, 2, 32, [150, 1, 70]  # blocks of PREFILL_BLOCK_ROWS, and a rest
    requests = [0, 1, 2]
    layer = RadixAttention(hq, dim, 0.2, hkv, layer_id=0, attn_type=AttentionType.DECODER, sliding_window_size=window)
    q, k, v = (torch.randn(WIDTH * len(requests), h * dim, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    table = (torch.arange(WIDTH * len(requests)).view(len(requests), WIDTH) + 1).int()

    def fresh_pool():
        pool = MHATokenToKVPool(size=WIDTH * len(requests) + 8, page_size=1, dtype=dtype, head_num=hkv,
                                head_dim=dim, layer_num=1, device="cpu", enable_memory_saver=False)
        pool.get_key_buffer(0).fill_(float("nan"))  # slots not written yet must never be read
        pool.get_value_buffer(0).fill_(float("nan"))
        return pool

    pool = fresh_pool()
    whole, _ = _prefill(pool, table, layer, q, k, v, requests, lengths, [0, 0, 0])
    by_request = dict(zip(requests, whole.split(lengths), strict=True))
    for r, n in zip(requests, lengths, strict=True):  # the reference, one request at a time
        rows = slice(WIDTH * r, WIDTH * r + n)
        expected = reference.block_attention(
            q[rows].view(-1, hq, dim).float(), k[rows].view(-1, hkv, dim).float(), v[rows].view(-1, hkv, dim).float(),
            pool.get_key_buffer(0).float(), pool.get_value_buffer(0).float(), table, torch.tensor([r]),
            torch.tensor([0]), n, sm_scale=0.2, window=window + 1 if window > -1 else -1, causal_block=True,
        )
        torch.testing.assert_close(by_request[r].float(), expected.reshape(n, -1), rtol=2e-2, atol=2e-2)

    split = fresh_pool()
    cut = [41, 0, 64]
    first, _ = _prefill(split, table, layer, q, k, v, requests, cut, [0, 0, 0])
    remaining = [n - c for n, c in zip(lengths, cut, strict=True)]
    rest, _ = _prefill(split, table, layer, q, k, v, requests, remaining, cut, mode=ForwardMode.MIXED)
    for r, (head, tail) in enumerate(zip(first.split(cut), rest.split(remaining), strict=True)):
        assert torch.equal(torch.cat([head, tail]), by_request[r]), r

    decoded = fresh_pool()
    _prefill(decoded, table, layer, q, k, v, [0], [1], [0])
    for i in range(1, lengths[0]):  # request 0 decoded token by token after its first
        fb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, encoder_lens=None,
                                   req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([i + 1]),
                                   out_cache_loc=table[0, i:i + 1].long())
        row = paged_block_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], layer, fb, kv_pool=decoded,
                                    req_to_token=table, decode=True)
        assert torch.equal(row[0], by_request[0][i]), i


def test_attention_swap_leaves_other_calls_to_sglang():
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dflash.serving.attention import covers

    layer, pool, _, fb, q, _, _, _ = _verify_attention_case(AttentionType.ENCODER_ONLY, -1)
    kbuf = pool.get_key_buffer(0)
    assert covers(layer, fb, q, kbuf)
    for change in (
        dict(forward_mode=ForwardMode.EXTEND),
        dict(forward_mode=ForwardMode.DECODE),
        dict(spec_algorithm=SpeculativeAlgorithm.from_string("NGRAM")),
        dict(spec_info=types.SimpleNamespace(custom_mask=torch.ones(4, dtype=torch.bool))),
    ):
        assert not covers(layer, types.SimpleNamespace(**dict(vars(fb), **change)), q, kbuf), change
    layer.logit_cap = 30.0
    assert not covers(layer, fb, q, kbuf)
    layer.logit_cap = 0.0
    assert not covers(layer, fb, q.half(), kbuf)  # KV pool in another dtype


# -- seed, thresholds, device, and the start-up self-test (no server) ---------------------------


def test_sampling_seed_is_sglangs_resolved_seed():
    """The noise seed is what the target worker resolved (SGLang draws one when --random-seed is not
    given; server_args.random_seed then stays None), not a fixed 0."""
    from sglang_dflash.serving.worker import DFlashKernelWorker

    w = _bare_worker(DFlashKernelWorker, 4, random_seed=987654)
    assert w._dflash_seed == 987654


@pytest.mark.parametrize("single,acc", [(0.0, 1.0), (1.0, 0.0), (0.5, 0.9)])
def test_non_default_accept_thresholds_go_to_sglang(monkeypatch, single, acc):
    """An explicit threshold, 0.0 included, is SGLang's (relaxed) acceptance rule: sampled batches
    run the parent's _accept_block and its sampling-support check; greedy ones stay ours."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dflash.serving.worker import DFlashKernelWorker

    calls = []
    monkeypatch.setattr(DFlashWorkerV2, "_accept_block", lambda self, **kw: calls.append("accept") or "parent")
    monkeypatch.setattr(DFlashWorkerV2, "_validate_phase1_sampling_support", lambda self, b: calls.append("validate"))
    w = _bare_worker(DFlashKernelWorker, 4)
    w._init_dflash_kernels(_spec(single, acc), ["verify_block", "verify_block_from_ids"])
    assert w._dflash_thresholds == (single, acc)
    bs, block, vocab = 2, 4, 50
    logits, candidates, prefix_lens = _greedy_case(bs, block, vocab, seed=4)
    kw = dict(candidates=candidates, next_token_logits=logits, prefix_lens=prefix_lens, bs=bs)
    assert _call(w, sampling_info=_sampling_info([0.8] * bs, [1 << 30] * bs, [1.0] * bs), **kw) == "parent"
    w._validate_phase1_sampling_support(types.SimpleNamespace())
    assert calls == ["accept", "validate"]
    assert _call(w, **kw)[0].dtype == torch.int32  # greedy: our kernel's decisions
    assert calls == ["accept", "validate"]


@pytest.mark.parametrize("drafter", ["selector", "lilicorr"])
def test_dflash2_drafts_are_verified_by_our_kernels_unless_sglang_sampled_the_proposal(monkeypatch, drafter):
    """A selector's (or LiLiCorr's) drafted chain is verified like any other: greedy and sampled
    batches run our kernels (exact whatever drafted). Only a proposal SGLang sampled against its own
    q (`_selector_sample`, GPUs only) goes to SGLang's accept rule, which needs that q."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dflash.serving.worker import DFlashKernelWorker

    monkeypatch.setattr(DFlashWorkerV2, "_accept_block", lambda self, **kw: "parent")
    w = _bare_worker(DFlashKernelWorker, 4, kernel_ops=["verify_block", "verify_block_from_ids"])
    setattr(w, drafter, object())
    bs, block, vocab = 2, 4, 50
    logits, candidates, prefix_lens = _greedy_case(bs, block, vocab, seed=6)
    kw = dict(candidates=candidates, next_token_logits=logits, prefix_lens=prefix_lens, bs=bs)
    sampled = _sampling_info([0.8] * bs, [1 << 30] * bs, [1.0] * bs)
    assert w._kernel_sampling_ok()
    assert _call(w, **kw)[0].dtype == torch.int32 and _call(w, sampling_info=sampled, **kw)[0].dtype == torch.int32
    w._selector_sample = (torch.zeros(bs, block - 1, 4, dtype=torch.int64), torch.ones(bs, block - 1, 4))
    assert not w._kernel_sampling_ok() and _call(w, sampling_info=sampled, **kw) == "parent"


@pytest.mark.parametrize("device,gpu_id,expected", [("cpu", 0, "cpu"), ("cuda", 3, "cuda:3"), ("cuda:1", 3, "cuda:1")])
def test_runner_device_names_the_index(device, gpu_id, expected):
    from sglang_dflash.serving.worker import runner_device

    assert runner_device(types.SimpleNamespace(device=device, gpu_id=gpu_id)) == torch.device(expected)


@pytest.fixture
def fresh_kernels(monkeypatch):
    """No cached self-test results or fallbacks (restored afterwards); defaults for the switches."""
    from sglang_dflash import ops
    from sglang_dflash.ops import self_test

    monkeypatch.setattr(self_test, "_RESULTS", {})
    monkeypatch.setattr(ops, "_REFERENCE_ON", set())
    for var in ("SGLANG_DFLASH_STRICT", "SGLANG_DFLASH_DRAFT_ATTENTION"):
        monkeypatch.delenv(var, raising=False)


def _self_tested_worker(monkeypatch, break_op=None):
    """A bare worker whose drafter is one real RadixAttention layer over a real KV pool, after
    `_self_test_kernels("cpu")`, with `break_op`'s compiled kernel raising what a GPU without an
    image for its compute capability raises."""
    from sglang.srt.layers.radix_attention import AttentionType

    from sglang_dflash import _extension
    from sglang_dflash.serving.context_kv import ContextKVWriter
    from sglang_dflash.serving.worker import DFlashKernelWorker

    def broken(*args):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    if break_op is not None:
        monkeypatch.setattr(_extension.ops(), break_op, broken)
    monkeypatch.setattr(ContextKVWriter, "for_worker", classmethod(lambda cls, worker: None))
    layer, pool, table, fb, q, k, v, block = _verify_attention_case(AttentionType.ENCODER_ONLY, -1)
    w = _bare_worker(DFlashKernelWorker, block)
    w.model_runner = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float32))
    w.draft_model = types.SimpleNamespace(layers=[types.SimpleNamespace(self_attn=types.SimpleNamespace(attn=layer))])
    w.draft_model_runner = types.SimpleNamespace(token_to_kv_pool=pool,
                                                 req_to_token_pool=types.SimpleNamespace(req_to_token=table))
    w.use_compact_draft_cache = False
    w._init_dflash_kernels(_spec(), w._self_test_kernels(torch.device("cpu")))
    return w, layer, pool, fb, q


def test_self_test_switches_on_every_op_that_passes(fresh_kernels, monkeypatch, caplog):
    from sglang_dflash.ops import self_test
    from sglang_dflash.ops.self_test import Attention
    from sglang_dflash.serving.attention import _ORIGINAL, covers

    with caplog.at_level(logging.WARNING):
        w, layer, pool, fb, q = _self_tested_worker(monkeypatch)
    assert not caplog.records
    assert w._dflash_ops == {"verify_block", "verify_block_from_ids", "block_attention", "skinny_linear",
                            "rms_norm_rope", "w8a8_linear", "verify_tree", "move_slots", "top_k_logprobs"}
    assert getattr(layer, _ORIGINAL, None) is not None  # the draft layer runs block_attention
    assert covers(layer, fb, q, pool.get_key_buffer(0))
    # The draft layer's own configuration was tested: its heads, pool dtype, mask, B and 1.
    for block in (4, 1):
        assert ("block_attention", torch.device("cpu"), Attention(4, 2, 16, torch.float32, block)) in self_test._RESULTS


def test_a_failed_attention_self_test_gives_attention_to_sglang(fresh_kernels, monkeypatch, caplog):
    from sglang_dflash.serving.attention import _ORIGINAL, covers

    with caplog.at_level(logging.WARNING):
        w, layer, pool, fb, q = _self_tested_worker(monkeypatch, break_op="block_attention")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("sglang-dflash: self-test of block_attention on cpu failed (Attention(")
    assert "raised RuntimeError: CUDA error: no kernel image is available" in warnings[0]
    assert warnings[0].endswith("; block_attention runs SGLang's own path there")
    assert w._dflash_ops == {"verify_block", "verify_block_from_ids", "skinny_linear", "rms_norm_rope",
                            "w8a8_linear", "verify_tree", "move_slots", "top_k_logprobs"}
    assert getattr(layer, _ORIGINAL, None) is None  # SGLang's attention backend
    assert not covers(layer, fb, q, pool.get_key_buffer(0))  # nor through SGLang's CPU-engine hooks


def test_a_failed_verify_self_test_gives_verification_to_sglang(fresh_kernels, monkeypatch, caplog):
    """Greedy and sampled verification with logits are SGLang's then, with SGLang's results."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    calls = []
    parent = DFlashWorkerV2._accept_block
    monkeypatch.setattr(DFlashWorkerV2, "_accept_block", lambda self, **kw: calls.append(1) or parent(self, **kw))
    with caplog.at_level(logging.WARNING):
        w, *_ = _self_tested_worker(monkeypatch, break_op="verify_block")
    [warning] = [r.getMessage() for r in caplog.records]
    assert "self-test of verify_block on cpu failed (torch.float32: raised RuntimeError" in warning
    assert "verify_block" not in w._dflash_ops and not w._kernel_sampling_ok()
    bs, block, vocab = 3, 4, 64
    logits, candidates, prefix_lens = _greedy_case(bs, block, vocab, seed=2)
    kw = dict(candidates=candidates, next_token_logits=logits, prefix_lens=prefix_lens, bs=bs)
    for a, b in zip(_call(w, **kw), _call(_bare_worker(DFlashWorkerV2, block), **kw), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert len(calls) == 2  # ours went to the parent too
    _call(w, sampling_info=_sampling_info([0.8] * bs, [1 << 30] * bs, [1.0] * bs), **kw)
    assert len(calls) == 3
    # The argmax ids still go through verify_block_from_ids, which passed.
    _call(w, **dict(kw, next_token_logits=None, target_predict=logits.argmax(-1)))
    assert len(calls) == 3


def test_strict_self_test_failure_stops_the_worker(fresh_kernels, monkeypatch):
    from sglang_dflash.ops.self_test import SelfTestError

    monkeypatch.setenv("SGLANG_DFLASH_STRICT", "1")
    with pytest.raises(SelfTestError, match=r"self-test failed on cpu: verify_block_from_ids \(torch\.int64: raised"):
        _self_tested_worker(monkeypatch, break_op="verify_block_from_ids")


def test_prompts_that_would_crash_the_scheduler_are_refused_in_the_tokenizer(sglang_plugins):
    """Empty and out-of-vocabulary prompts raise the ValueError SGLang answers with HTTP 400 (the
    real server's answer is in test_sglang_cpu_server.py); multimodal and input_embeds requests
    pass through untouched."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sglang_dflash.serving import request_checks

    sglang_plugins.load_plugins()
    hooks = sglang_plugins.HookRegistry._hooks.get(request_checks.HOOK_TARGET, [])
    assert [h for _, h, _ in hooks] == [request_checks._before_validate]
    assert TokenizerManager._validate_one_request is not None
    manager = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=100))
    text = types.SimpleNamespace(image_data=None, video_data=None, audio_data=None)
    with pytest.raises(ValueError, match=r"^the prompt is empty: it must have at least one token$"):
        request_checks._before_validate(manager, text, [])
    for ids, bad in (([5, 100], 100), ([-1, 3], -1), ([7, 10**9], 10**9)):
        with pytest.raises(ValueError, match=rf"^prompt token id {bad} is outside the vocabulary \[0, 100\)$"):
            request_checks._before_validate(manager, text, ids)
    request_checks._before_validate(manager, text, [0, 99])
    request_checks._before_validate(manager, text, None)  # input_embeds
    request_checks._before_validate(manager, types.SimpleNamespace(image_data=["x"]), [500])


class _RecordingReq:
    """Stands in for SGLang's Req, recording set_finish_with_abort (the real one needs a batch)."""

    def __init__(self):
        self.aborted = None
        self.done = False

    def finished(self):
        return self.done

    def set_finish_with_abort(self, error_msg, status_code, err_type):
        self.aborted = (error_msg, int(status_code), err_type)


def test_a_device_index_error_aborts_the_steps_requests_and_the_server_serves_on(monkeypatch):
    """A CUDA kernel's recorded out-of-range index ends the requests of the step it was found after
    with HTTP 500 naming it, instead of killing the scheduler, and without a host sync per step: the
    record is snapshotted per step and step N's snapshot is read after step N + 1 is queued (overlap
    scheduling). No GPU here: the worker's device is named "cuda" and the extension's two snapshot
    ops are a stand-in stream (tests/test_ops_error_watch.py); the real ops run in gpu_check."""
    from sglang_dflash import ops
    from sglang_dflash.ops.error_watch import DeviceErrorWatch
    from sglang_dflash.serving.worker import DFlashKernelWorker
    from tests.test_ops_error_watch import StandInStream

    def no_sync(*args):
        raise AssertionError("the served step must not call the syncing check_device_errors")

    monkeypatch.setattr(ops, "check_device_errors", no_sync)
    error = "sglang_dflash.verify_block: candidates[1, 3] = 99999 is outside the vocabulary [0, 64)"
    stream = StandInStream(errors_after_step={1: error})
    w = _bare_worker(DFlashKernelWorker, 8)
    w._device_errors = DeviceErrorWatch(torch.device("cuda", 0), lag=1, backend=stream)
    steps = [[_RecordingReq(), _RecordingReq()] for _ in range(4)]
    finished = _RecordingReq()
    finished.done = True
    steps[1].append(finished)
    for i, reqs in enumerate(steps):
        w._abort_on_device_errors(reqs)
        stream.run_one_step()
        if i == 1:  # step 1's error is not read before step 2 is queued
            assert all(req.aborted is None for req in reqs)
    assert stream.snapshots == len(steps) and stream.waits_on_newest == 0
    for i, reqs in enumerate(steps):
        for req in reqs:
            if i == 1 and req is not finished:
                message, status, _ = req.aborted
                assert status == 500 and error in message and "not valid" in message
            else:
                assert req.aborted is None  # other steps, and a request that had finished already


def test_no_device_error_watch_where_nothing_of_ours_can_record_one():
    """On CPU our kernels raise at the call, and a CUDA worker that runs none of our kernels has
    nothing to read: no watch, no snapshot, no sync."""
    from sglang_dflash.serving.worker import DFlashKernelWorker

    assert _bare_worker(DFlashKernelWorker, 8)._device_errors is None
    assert _bare_worker(DFlashKernelWorker, 8, device="cuda:0", kernel_ops=())._device_errors is None
