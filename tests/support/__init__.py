"""Test-only support code that does not ship in the wheel: the kubelet emulation behind tests/integration/k8s and
scripts/k8s-testenv.sh (`fake_kubelet`, `process_kubelet`, `pod_network`, `pod_volumes`, `service_proxy`,
`kubelet_server`, `volume_provisioner`, `k8s_cluster`, `process_cluster`, `helm_cli`). Imported as `tests.support.*`
with the repository root on sys.path (pytest's `pythonpath`)."""
