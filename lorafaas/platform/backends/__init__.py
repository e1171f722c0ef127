"""Where function instances run: local processes (`LocalLauncher`) or Kubernetes pods (`KubernetesBackend`), both
behind the `Backend` protocol the node agent drives. The Kubernetes backend needs the `k8s` extra."""

from __future__ import annotations

from pathlib import Path

from lorafaas.errors import InvalidInput
from lorafaas.platform.adapter_access import AdapterAccess
from lorafaas.platform.backends.base import Backend, InstanceRef

BACKENDS = ("local", "kubernetes")

__all__ = ["BACKENDS", "Backend", "InstanceRef", "open_backend"]


def open_backend(kind: str, home: Path, devices: tuple[str, ...], adapter_access: AdapterAccess | None = None,
                 host_tier_bytes: int | None = None, standby_workers: int | None = None) -> Backend:
    """`local`: processes on this machine, on every device of `devices`; `kubernetes`: pods, configured from the
    environment the chart sets, on the devices each agent node serves (cpu, or its GPUs: a daemon per GPU),
    fetching their adapters with `adapter_access`'s tokens. `host_tier_bytes`: the local launcher's host tier
    (host_tier.py; None: its default); `standby_workers`: its pre-forked pool processes per backbone and device
    (standby_pool.py; None: its default)."""
    if kind == "local":
        from lorafaas.platform.backends.local import LocalLauncher
        from lorafaas.platform.backends.standby_pool import DEFAULT_STANDBY_WORKERS

        pool_size = DEFAULT_STANDBY_WORKERS if standby_workers is None else standby_workers
        launcher = LocalLauncher(home, devices=devices, host_tier_bytes=host_tier_bytes, standby_workers=pool_size)
        launcher.recover_predecessors()  # a previous platform killed outright: stop its instances, adopt its daemons
        return launcher
    if kind == "kubernetes":
        try:
            from lorafaas.platform.backends.kubernetes import KubernetesBackend, KubernetesConfig
        except ImportError as exc:
            raise InvalidInput("the kubernetes backend needs the k8s extra: pip install 'lorafaas[k8s]'") from exc
        backend = KubernetesBackend(KubernetesConfig.from_env(home, devices), adapter_access=adapter_access)
        backend.start()  # follow the pods; a previous controller's healthy pods wait to be adopted by launches
        return backend
    raise InvalidInput(f"backend {kind!r} is unknown; choose one of {', '.join(BACKENDS)}")
