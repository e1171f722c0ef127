"""A dynamic provisioner for test clusters: each pending PersistentVolumeClaim gets a hostPath PersistentVolume made
for it (bound through its claimRef), as a local-path provisioner does, so that a StatefulSet's volumeClaimTemplates
(the chart's Redis) work without a storage backend. The process kubelet puts a hostPath under the pod's node's own
root, so the data lives on the node the pod first runs on; the volumes are kept (Retain) until the cluster goes.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

VOLUME_ROOT = "/var/lib/lorafaas-test-volumes"


class HostPathProvisioner:
    def __init__(self, api: k8s.ApiClient, interval_s: float = 1.0) -> None:
        self.core = k8s.CoreV1Api(api)
        self.interval_s = interval_s
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="volume-provisioner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    def provision_pending(self) -> list[str]:
        """A volume for every claim that has none; returns the volumes made."""
        made = []
        for claim in self.core.list_persistent_volume_claim_for_all_namespaces().items:
            if claim.spec.volume_name or (claim.status and claim.status.phase != "Pending"):
                continue
            namespace, name = claim.metadata.namespace, claim.metadata.name
            volume = f"pvc-{claim.metadata.uid}"
            body = {"metadata": {"name": volume, "labels": {"lorafaas.io/provisioned-for": f"{namespace}.{name}"}},
                    "spec": {"capacity": {"storage": claim.spec.resources.requests["storage"]},
                             "accessModes": claim.spec.access_modes, "persistentVolumeReclaimPolicy": "Retain",
                             "storageClassName": claim.spec.storage_class_name or "",
                             "claimRef": {"namespace": namespace, "name": name, "uid": claim.metadata.uid},
                             "hostPath": {"path": f"{VOLUME_ROOT}/{namespace}/{name}", "type": "DirectoryOrCreate"}}}
            try:
                self.core.create_persistent_volume(body)
            except ApiException as exc:
                if exc.status != 409:  # 409: made on an earlier pass, not bound yet
                    raise
                continue
            made.append(volume)
            log.info("provisioned %s for %s/%s", volume, namespace, name)
        return made

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            with contextlib.suppress(ApiException, OSError):
                self.provision_pending()
