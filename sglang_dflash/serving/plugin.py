"""The SGLang plugin: makes `--speculative-algorithm dflash` run sglang-dflash's worker.

Entry point (group `sglang.srt.plugins`): `sglang_dflash = "sglang_dflash.serving.plugin:register"`.
SGLang's `load_plugins()` calls `register()` in every SGLang process (launch_server, the HTTP
server, each spawned scheduler, `sgl.Engine`). `register()` adds an AROUND hook on
`SpeculativeAlgorithm.create_worker` through SGLang's `HookRegistry`: when the algorithm is DFLASH
the hook returns `sglang_dflash.serving.worker.DFlashKernelWorker` (a subclass of SGLang's own
`DFlashWorkerV2`), otherwise it calls the original. It also refuses prompts that would crash
SGLang's scheduler (request_checks.py) with a 400 for that request.

On CPU the same hook first supplies, for every speculative algorithm (NGRAM, EAGLE, DFLASH, ...),
the `torch.ops.sgl_kernel` CPU ops that SGLang's speculative path calls and this sgl-kernel lacks
(sgl_kernel_ops.py): it runs in the scheduler, before the workers allocate their KV pools, whose
start-up warm-up calls `copy_all_layer_kv_cache_cpu`. A process that serves without speculation
never reaches it, so it loads nothing of ours for this.

This module imports nothing heavy at import time (no torch, no SGLang, no extension): the worker
module is imported inside the hook, i.e. only in the scheduler process that builds the worker.

Environment:
  SGLANG_DFLASH_DISABLE=1  the plugin registers nothing; DFLASH runs SGLang's built-in worker. Not
                           even sgl-kernel's missing CPU ops: on a stock CPU install a speculative
                           algorithm would then start, but SGLang's torch_native backend has no
                           TARGET_VERIFY path (cpu.py hook 3), so it would die at its first decode
                           step instead of at start-up, as stock SGLang does.
  SGLANG_DFLASH_STRICT=1   an incompatible SGLang (version or a missing seam) or a worker that
                           cannot be loaded raises IncompatibleSGLangError when the DFLASH worker
                           is created (the server refuses to start), instead of falling back to the
                           built-in worker with a warning. SGLang only logs errors raised inside
                           plugins, so the check runs in the hook, where an exception propagates.
                           Likewise a kernel that fails the worker's start-up self-test
                           (ops/self_test.py) raises SelfTestError instead of leaving that op to
                           SGLang's own path.
"""

from __future__ import annotations

import logging
import os

from sglang_dflash import settings
from sglang_dflash.serving import request_checks

logger = logging.getLogger(__name__)

HOOK_TARGET = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker"
# The SGLang releases whose internals the worker was checked against (docs/serving.md lists them).
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)

_registered = False


class IncompatibleSGLangError(RuntimeError):
    """The installed SGLang does not have what sglang-dflash's worker relies on."""


def is_disabled() -> bool:
    return settings.get(settings.DISABLE)


def is_strict() -> bool:
    return settings.get(settings.STRICT)


def sglang_serves_on_cpu() -> bool:
    """SGLang's switch for CPU serving, read as SGLang's `is_cpu()` reads it."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"


def sglang_version() -> str | None:
    """The installed SGLang's version, read from its metadata (imports nothing)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def version_problem() -> str | None:
    """Why the installed SGLang version is not supported, or None when it is."""
    version = sglang_version()
    if version is None:
        return "SGLang is not installed"
    if version.split("+")[0] not in SUPPORTED_SGLANG_VERSIONS:
        return (
            f"SGLang {version} is not a version sglang-dflash was checked against "
            f"({', '.join(SUPPORTED_SGLANG_VERSIONS)})"
        )
    return None


def register() -> None:
    """Entry point: register the AROUND hook on SpeculativeAlgorithm.create_worker."""
    global _registered
    if is_disabled():
        logger.info("sglang-dflash: %s=1, plugin off; DFLASH uses SGLang's built-in worker", settings.DISABLE.name)
        return
    if _registered:
        return
    problem = version_problem()
    if problem is not None and not is_strict():
        logger.warning(
            "sglang-dflash: %s; plugin off, DFLASH uses SGLang's built-in worker "
            "(set %s=1 to make this an error)",
            problem,
            settings.STRICT.name,
        )
        return
    # In strict mode an incompatible SGLang still gets the hook: it raises when the DFLASH worker
    # is created, where SGLang does not swallow the exception.
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, _create_worker_around, HookType.AROUND)
    if problem is None:
        request_checks.register_hooks()
    if sglang_serves_on_cpu() and problem is None:
        from sglang_dflash.serving import cpu

        cpu.register_hooks()
    _registered = True
    logger.debug("sglang-dflash: registered an AROUND hook on %s", HOOK_TARGET)


def select_worker_class():
    """Our DFLASH worker class, after checking the SGLang version and the seams it relies on.

    Raises IncompatibleSGLangError naming every problem found.
    """
    problem = version_problem()
    if problem is not None:
        raise IncompatibleSGLangError(problem)
    try:
        from sglang_dflash.serving import worker
    except Exception as exc:  # an SGLang without the classes we subclass, or no extension
        raise IncompatibleSGLangError(f"cannot import sglang_dflash.serving.worker: {exc!r}") from exc
    problems = worker.compatibility_problems()
    if problems:
        raise IncompatibleSGLangError("; ".join(problems))
    return worker.DFlashKernelWorker


def _is_dflash(algo) -> bool:
    try:
        return bool(algo.is_dflash())
    except Exception:
        return False


def supply_cpu_ops() -> None:
    """Registers the sgl-kernel CPU ops this sgl-kernel lacks (sgl_kernel_ops.py), naming them in
    the log. An extension that does not load leaves SGLang as it would be without us (warned), or
    raises IncompatibleSGLangError in strict mode."""
    from sglang_dflash.serving.sgl_kernel_ops import register_missing

    try:
        registered = register_missing()
    except Exception as exc:  # our extension does not load
        if is_strict():
            raise IncompatibleSGLangError(f"cannot register sgl-kernel's CPU ops: {exc!r}") from exc
        logger.warning("sglang-dflash: cannot supply sgl-kernel's missing CPU ops (%r); SGLang's speculative "
                       "path may fail where it calls them", exc)
        return
    if registered:
        logger.info("sglang-dflash: this sgl-kernel lacks torch.ops.sgl_kernel.%s; ours serve them",
                    ", ".join(registered))


def _create_worker_around(original, algo, *args, **kwargs):
    """AROUND hook on SpeculativeAlgorithm.create_worker(self, server_args)."""
    if sglang_serves_on_cpu() and not is_disabled():  # before any worker is built (module docstring)
        supply_cpu_ops()
    if not _is_dflash(algo) or is_disabled():
        return original(algo, *args, **kwargs)
    # An out-of-tree platform that brings its own DFLASH worker keeps it.
    get_platform_worker_cls = getattr(algo, "get_platform_worker_cls", None)
    if get_platform_worker_cls is not None and get_platform_worker_cls() is not None:
        return original(algo, *args, **kwargs)
    try:
        cls = select_worker_class()
    except IncompatibleSGLangError as exc:
        if is_strict():
            raise
        logger.warning(
            "sglang-dflash: %s; DFLASH falls back to SGLang's built-in worker "
            "(set %s=1 to make this an error)",
            exc,
            settings.STRICT.name,
        )
        return original(algo, *args, **kwargs)
    return cls  # its __init__ logs the line naming it, its device and the kernels it runs
