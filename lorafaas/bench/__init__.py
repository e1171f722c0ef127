"""Benchmarks a user runs against servers from outside (issue 17 gathers the platform's other benchmarks here)."""
