"""Benchmarks (run as `python -m bench.NAME`), their shared helpers and their results (bench/results/)."""
