"""Test-only support code that does not ship in the wheel: the kubelet emulation behind tests/integration/k8s and
scripts/k8s-testenv.sh (`fake_kubelet`, `process_kubelet`, `pod_network`, `pod_volumes`, `service_proxy`,
`k8s_cluster`). Imported as `tests.support.*` with the repository root on sys.path (pytest's `pythonpath`)."""
