"""Where function instances run: local processes (`LocalLauncher`) or Kubernetes pods (`KubernetesBackend`), both
behind the `Backend` protocol the node agent drives. The Kubernetes backend needs the `k8s` extra."""

from lorafaas.platform.backends.base import Backend, InstanceRef

__all__ = ["Backend", "InstanceRef"]
