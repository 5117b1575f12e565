"""Compiles csrc/cuda/*.cu against the headers of the GPU machine's torch (2.11.0+cu130), so an API
difference between that torch and the one installed here is found on this CPU machine, not in a
short GPU window.

    python scripts/check_device_build.py [--torch-version 2.11.0] [--arch 90] [--installed-torch] [FILE.cu ...]

Only the wheel's `torch/include/` (plus `version.py` and `utils/cpp_extension.py`) is read, by HTTP
range requests on the ~500 MB wheel on PyPI (about 10 MB travel); when the server refuses ranges
the whole wheel is fetched with `pip download --no-deps`. The headers are cached under
build/torch-headers/VERSION (rebuilt when absent). Each .cu is compiled to an object file (no
link) with the flags setup.py and that torch's CUDAExtension pass, for one architecture: enough to
check the API, quick enough for CI. Exit status 1, with nvcc's first errors, when a file fails.
`--installed-torch` compiles against this Python's torch instead (bench/gpu_check.sh does, to show
each file's own first errors when the extension build fails on a machine without network).
"""

from __future__ import annotations

import argparse
import ast
import bisect
import concurrent.futures
import glob
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEX = "https://pypi.org/simple/torch/"  # PEP 691 JSON; the /pypi/torch/VERSION/json API is not reachable everywhere
WANTED = ("torch/include/", "torch/version.py", "torch/utils/cpp_extension.py")
# setup.py's extensions(): its nvcc flags and include dirs, plus the defines CUDAExtension adds.
SETUP_NVCC_FLAGS = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "-DSGLANG_DFLASH_WITH_CUDA",
                    "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS", "-DTORCH_API_INCLUDE_EXTENSION_H",
                    "-DTORCH_EXTENSION_NAME=_C", "--compiler-options", "-fPIC"]
SETUP_INCLUDE_DIRS = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]


class RemoteFile(io.RawIOBase):
    """A seekable read-only view of a URL that downloads only what is read (HTTP Range requests),
    so zipfile can read a wheel's central directory and a few members without the rest."""

    def __init__(self, url: str):
        super().__init__()
        self.url = url
        self.pos = 0
        self.starts: list[int] = []  # sorted starts of the downloaded chunks
        self.chunks: dict[int, bytes] = {}
        self.size = self._get(0, 1)[1]

    def _get(self, start: int, end: int) -> tuple[bytes, int]:
        """Bytes [start, end) and the file's size; raises OSError when the server ignores the range."""
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end - 1}"})
        for attempt in range(3):
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    if response.status != 206:
                        raise OSError(f"the server answered a range request with HTTP {response.status}")
                    data = response.read()
                    size = int(response.headers["Content-Range"].rsplit("/", 1)[1])
                break
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt == 2:
                    raise OSError(f"range request failed: {exc}") from exc
                time.sleep(2**attempt)
        if len(data) != end - start:
            raise OSError(f"asked for {end - start} bytes at {start}, got {len(data)}")
        return data, size

    def prefetch(self, start: int, end: int) -> None:
        self.chunks[start] = self._get(start, end)[0]
        bisect.insort(self.starts, start)

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.pos + n, self.size)
        if end <= self.pos:
            return b""
        i = bisect.bisect_right(self.starts, self.pos) - 1
        if i < 0 or self.starts[i] + len(self.chunks[self.starts[i]]) < end:
            # not downloaded yet: fetch at least 64 KiB, as zipfile reads a few bytes at a time
            self.prefetch(self.pos, min(max(end, self.pos + (64 << 10)), self.size))
            i = bisect.bisect_right(self.starts, self.pos) - 1
        start = self.starts[i]
        data = self.chunks[start][self.pos - start : end - start]
        self.pos = end
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos


def wheel_url(version: str) -> tuple[str, str]:
    """(file name, URL) of the torch wheel for this Python on manylinux x86-64 (headers do not
    depend on the Python version, but pip's fallback picks this one too)."""
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for f in files:
        name = f["filename"]
        if name.startswith(f"torch-{version}-{tag}-{tag}-manylinux") and name.endswith("_x86_64.whl"):
            return name, f["url"]
    raise RuntimeError(f"PyPI lists no torch {version} wheel for {tag} on manylinux x86_64")


def extract(wheel: zipfile.ZipFile, dest: str, remote: RemoteFile | None = None) -> None:
    """Writes the WANTED members of `wheel` under dest. With a remote wheel, first downloads the
    byte ranges holding them (a member ends where the next one starts), merged when close, so a
    few large requests replace thousands of small ones."""
    members = [m for m in wheel.infolist() if m.filename.startswith(WANTED)]
    if remote is not None:
        offsets = sorted({m.header_offset for m in wheel.infolist()} | {wheel.start_dir})
        spans = []
        for m in sorted(members, key=lambda m: m.header_offset):
            end = offsets[bisect.bisect_right(offsets, m.header_offset)]
            if spans and m.header_offset - spans[-1][1] < (1 << 20):
                spans[-1][1] = end
            else:
                spans.append([m.header_offset, end])
        for start, end in spans:
            remote.prefetch(start, end)
    for m in members:  # zipfile checks each member's CRC-32
        wheel.extract(m, dest)


def fetch_headers(version: str, dest: str) -> str:
    """Fills dest with torch `version`'s headers; returns how they were obtained."""
    staging = dest + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        name, url = wheel_url(version)
        remote = RemoteFile(url)
        extract(zipfile.ZipFile(remote), staging, remote)
        how = f"{name}, torch/include/ by HTTP range requests"
    except (OSError, RuntimeError, zipfile.BadZipFile) as exc:  # pip may still reach a mirror
        print(f"reading the wheel by range requests failed ({exc}); downloading all of it with pip", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp,
                            f"torch=={version}"], check=True)
            (path,) = glob.glob(os.path.join(tmp, "torch-*.whl"))
            shutil.rmtree(staging, ignore_errors=True)
            with zipfile.ZipFile(path) as wheel:
                extract(wheel, staging)
            how = f"{os.path.basename(path)} (pip download)"
    os.replace(staging, dest)  # only a complete extraction lands in the cache
    return how


def assigned(path: str, name: str):
    """The literal a module assigns to `name` at top level, read without running the module."""
    with open(path) as f:
        for node in ast.parse(f.read()).body:
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign) and node.value is not None:  # `cuda: Optional[str] = ...`
                targets = [node.target]
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(node.value)
    raise RuntimeError(f"{name} is not assigned in {path}")


def torch_facts(headers: str) -> tuple[str, list[str]]:
    """The headers' torch version (e.g. 2.11.0+cu130) and the nvcc flags its CUDAExtension adds
    (COMMON_NVCC_FLAGS: its __CUDA_NO_HALF_* defines change what compiles)."""
    return (assigned(os.path.join(headers, "torch", "version.py"), "__version__"),
            assigned(os.path.join(headers, "torch", "utils", "cpp_extension.py"), "COMMON_NVCC_FLAGS"))


def cuda_library_headers(out: str) -> list[str]:
    """ATen/cuda headers include cuBLAS / cuSPARSE / cuSOLVER / cuRAND / cuFFT headers, which a bare
    toolkit lacks: link them from the nvidia pip packages into a private dir, as setup.py does
    (the packages' whole include tree breaks nvcc 13.0)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    os.makedirs(out, exist_ok=True)
    for base in spec.submodule_search_locations:
        for header in glob.glob(os.path.join(base, "cu*", "include", "cu*.h")):
            name = os.path.basename(header)
            link = os.path.join(out, name)
            if name.startswith(("cublas", "cusparse", "cusolver", "curand", "cufft")) and not os.path.exists(link):
                os.symlink(header, link)
    return [out]


def compile_one(source: str, command: list[str], obj: str) -> tuple[str, float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command + ["-c", source, "-o", obj], capture_output=True, text=True)
    return source, time.perf_counter() - start, done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-version", default="2.11.0", help="the GPU machine's torch (default 2.11.0)")
    parser.add_argument("--arch", default="90", help="one compute capability without the dot (default 90)")
    parser.add_argument("--installed-torch", action="store_true",
                        help="this Python's torch instead of a downloaded one (--torch-version is ignored)")
    parser.add_argument("sources", nargs="*", help="the .cu files to compile (default: all of csrc/cuda/*.cu)")
    args = parser.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("check_device_build: nvcc is not on PATH; it is needed to compile the CUDA sources")

    cache = os.path.join(ROOT, "build", "torch-headers")
    if args.installed_torch:
        spec = importlib.util.find_spec("torch")
        if spec is None:
            sys.exit(f"check_device_build: no torch installed in {sys.executable}")
        headers = os.path.dirname(spec.submodule_search_locations[0])  # the directory holding torch/
        how = f"installed in {sys.executable}"
    else:
        headers = os.path.join(cache, args.torch_version)
        if os.path.isdir(headers):
            how = f"cached in {os.path.relpath(headers, ROOT)}"
        else:
            start = time.perf_counter()
            try:
                how = fetch_headers(args.torch_version, headers) + f", {time.perf_counter() - start:.0f} s"
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                sys.exit(f"check_device_build: could not get torch {args.torch_version}'s headers from PyPI: {exc}")
    torch_version, torch_nvcc_flags = torch_facts(headers)
    print(f"torch headers: {torch_version} ({how})", flush=True)
    if not args.installed_torch and not torch_version.startswith(args.torch_version):
        sys.exit(f"check_device_build: wanted torch {args.torch_version}, the headers say {torch_version}")

    include = os.path.join(headers, "torch", "include")
    library_headers = cuda_library_headers(os.path.join(cache, "cuda_lib_headers"))
    if not library_headers:
        print("no nvidia-* pip packages in this Python (a CUDA build of torch brings them): relying on the "
              "CUDA toolkit's own cuBLAS / cuSPARSE / cuSOLVER headers", flush=True)
    include_dirs = SETUP_INCLUDE_DIRS + library_headers + [
        include, os.path.join(include, "torch", "csrc", "api", "include"), sysconfig.get_paths()["include"]]
    arch = f"-gencode=arch=compute_{args.arch},code=sm_{args.arch}"
    command = ["nvcc", *torch_nvcc_flags, *SETUP_NVCC_FLAGS, arch] + [f"-I{d}" for d in include_dirs]
    default_sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    sources = [os.path.abspath(s) for s in args.sources] or default_sources
    if not sources:
        sys.exit("check_device_build: no csrc/cuda/*.cu found")
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    release = next((line.strip() for line in nvcc.splitlines() if "release" in line), "unknown version")
    print(f"compiling {len(sources)} files for sm_{args.arch} with nvcc ({release})", flush=True)

    failed = []
    start = time.perf_counter()
    jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as objs, concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(compile_one, s, command, os.path.join(objs, os.path.basename(s) + ".o"))
                   for s in sources]
        for future in concurrent.futures.as_completed(futures):
            source, seconds, done = future.result()
            name = os.path.relpath(source, ROOT)
            print(f"  {name}: {'ok' if done.returncode == 0 else 'FAILED'} ({seconds:.0f} s)", flush=True)
            if done.returncode != 0:
                failed.append(name)
                # nvcc echoes the macro-expanded line (kilobytes for a dispatch macro): cut long lines
                errors = [line[:300] for line in (done.stderr + done.stdout).splitlines() if line.strip()]
                print("\n".join("    " + line for line in errors[:30]), flush=True)
    if failed:
        print(f"check_device_build: {len(failed)} of {len(sources)} CUDA sources do not compile against torch "
              f"{torch_version}: {', '.join(failed)} (nvcc's first errors above)", file=sys.stderr)
        return 1
    print(f"all {len(sources)} CUDA sources compile against torch {torch_version} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
