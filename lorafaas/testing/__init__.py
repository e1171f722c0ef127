"""Fixtures shared by the test suite and the benchmarks: tiny seeded backbones and adapters."""
