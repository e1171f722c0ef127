"""What the test suite and the benchmarks start: tiny seeded backbones and adapters, the platform process, probes,
fakes (completions server, CUDA guard, kubelets) and hostile inputs."""
