"""GPU-only tools that bench/gpu_check.sh runs: the smoke test, the sanitizer driver, the profiler target."""
