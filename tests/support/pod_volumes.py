"""Volumes for the process kubelet: each pod volume made a directory on this machine, and each container's
volumeMounts turned into bind mounts (`sandbox_script`, run in the container's own mount namespace).

    emptyDir               a directory of the pod's (removed with it); medium Memory: a tmpfs of sizeLimit
    hostPath               the path under the node's root, <work>/nodes/<node>/<path>: every node has its own disk
    configMap, secret      their keys (or `items`) written as files with their modes; read-only, as in Kubernetes
    downwardAPI            metadata.name/namespace/uid/labels/annotations as files
    projected              the above, and serviceAccountToken (a token from the TokenRequest API)
    persistentVolumeClaim  its bound PersistentVolume: hostPath or local (under the node's root, like hostPath), or
                           nfs, whose `path` is taken on this machine (the NFS server is this machine): the same
                           directory from every node, which is what a ReadWriteMany volume is

Mount points that do not exist are created (as a container runtime does), on this machine's filesystem: the pods share
its root filesystem, only their mounts are their own.

With `owners` (the pods run as their securityContext's uid: `run_as`), volumes are owned as the kubelet owns them:
an emptyDir is mode 0777; with the pod's fsGroup, configMap, secret, downwardAPI and projected files belong to that
group, and so does a claim's volume (group-writable, setgid), which Kubernetes does for the volume types that support
ownership management (here every claim's).
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

HOST_PATH_CHECKS = {"Directory": Path.is_dir, "File": Path.is_file, "Socket": Path.is_socket}


@dataclass(frozen=True)
class Volume:
    path: Path
    read_only: bool = False


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool


class PodVolumes:
    """The volumes of one pod: `prepare()` makes them, `mounts(container)` lists a container's, `remove()` undoes."""

    def __init__(self, core: k8s.CoreV1Api, pod: k8s.V1Pod, node_root: Path, pod_dir: Path,
                 owners: bool = False) -> None:
        self.core = core
        self.pod = pod
        context = pod.spec.security_context
        self.owners = owners
        self.fs_group: int | None = context.fs_group if owners and context is not None else None
        self.node_root = Path(node_root)
        self.pod_dir = Path(pod_dir)
        self.volumes: dict[str, Volume] = {}
        self._tmpfs: list[Path] = []

    def prepare(self) -> None:
        for volume in self.pod.spec.volumes or []:
            made = self.volumes[volume.name] = self._make(volume)
            if self.fs_group is not None and volume.empty_dir is None and volume.host_path is None:
                self._own(made.path, writable=volume.persistent_volume_claim is not None)

    def _own(self, path: Path, writable: bool) -> None:
        """The pod's fsGroup as the group of the volume's files (and, writable, its directories g+rwx with setgid)."""
        for item in [path, *path.rglob("*")]:
            os.chown(item, -1, self.fs_group, follow_symlinks=False)
            if writable and item.is_dir() and not item.is_symlink():
                item.chmod(item.stat().st_mode | 0o2070)

    def remove(self) -> None:
        for path in self._tmpfs:
            subprocess.run(["umount", "--lazy", str(path)], capture_output=True)
        shutil.rmtree(self.pod_dir / "volumes", ignore_errors=True)

    def mounts(self, container: k8s.V1Container) -> list[Mount]:
        """Parents before children, as a runtime mounts them."""
        mounts = []
        for mount in container.volume_mounts or []:
            volume = self.volumes.get(mount.name)
            if volume is None:
                raise OSError(f"container {container.name}: volumeMount {mount.name!r} names no volume of the pod")
            source = volume.path
            if mount.sub_path:
                source = volume.path / mount.sub_path
                if not source.exists():  # the kubelet creates a missing subPath as a directory
                    source.mkdir(parents=True)
            mounts.append(Mount(source, mount.mount_path, bool(mount.read_only) or volume.read_only))
        return sorted(mounts, key=lambda m: len(PurePosixPath(m.target).parts))

    # -- one volume ----------------------------------------------------------------------------------------------------

    def _make(self, volume: k8s.V1Volume) -> Volume:
        own = self.pod_dir / "volumes" / volume.name
        if volume.empty_dir is not None:
            own.mkdir(parents=True, exist_ok=True)
            if self.owners:
                own.chmod(0o777)  # as the kubelet makes it: any uid of the pod writes there
            if volume.empty_dir.medium == "Memory":
                size = f",size={_bytes(volume.empty_dir.size_limit)}" if volume.empty_dir.size_limit else ""
                _run(["mount", "-t", "tmpfs", "-o", f"mode=1777{size}", "tmpfs", str(own)])
                self._tmpfs.append(own)
            return Volume(own)
        if volume.host_path is not None:
            return Volume(self._host_path(volume.host_path.path, volume.host_path.type or ""))
        if volume.config_map is not None:
            return Volume(self._files(own, self._config_map(volume.config_map.name, volume.config_map.optional),
                                      volume.config_map.items, volume.config_map.default_mode), read_only=True)
        if volume.secret is not None:
            return Volume(self._files(own, self._secret(volume.secret.secret_name, volume.secret.optional),
                                      volume.secret.items, volume.secret.default_mode), read_only=True)
        if volume.downward_api is not None:
            return Volume(self._files(own, self._downward(volume.downward_api.items), None,
                                      volume.downward_api.default_mode), read_only=True)
        if volume.projected is not None:
            return Volume(self._projected(own, volume.projected), read_only=True)
        if volume.persistent_volume_claim is not None:
            claim = volume.persistent_volume_claim
            return Volume(self._claim(claim.claim_name), read_only=bool(claim.read_only))
        kinds = [k for k, v in volume.to_dict().items() if v is not None and k != "name"]
        raise OSError(f"volume {volume.name}: {', '.join(kinds)} volumes are not emulated by the process kubelet")

    def _host_path(self, path: str, kind: str) -> Path:
        on_node = self.node_root / path.lstrip("/")
        if kind == "DirectoryOrCreate":
            on_node.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate":
            on_node.parent.mkdir(parents=True, exist_ok=True)
            on_node.touch()
        elif kind in HOST_PATH_CHECKS and not HOST_PATH_CHECKS[kind](on_node):
            raise OSError(f"hostPath {path} is not a {kind} on this node ({on_node})")
        elif not on_node.exists():
            raise OSError(f"hostPath {path} (type {kind or 'unchecked'}) does not exist on this node ({on_node})")
        return on_node

    def _claim(self, name: str) -> Path:
        namespace = self.pod.metadata.namespace
        claim = self.core.read_namespaced_persistent_volume_claim(name, namespace)
        if not claim.spec.volume_name or (claim.status and claim.status.phase != "Bound"):
            raise OSError(f"persistentVolumeClaim {namespace}/{name} is not bound to a volume")
        volume = self.core.read_persistent_volume(claim.spec.volume_name)
        if volume.spec.host_path is not None:
            return self._host_path(volume.spec.host_path.path, volume.spec.host_path.type or "")
        if volume.spec.local is not None:
            return self._host_path(volume.spec.local.path, "Directory")
        if volume.spec.nfs is not None:
            path = Path(volume.spec.nfs.path)
            if not path.is_dir():
                raise OSError(f"nfs volume {volume.metadata.name}: {path} is no directory on this machine")
            return path
        raise OSError(f"persistentVolume {volume.metadata.name}: only hostPath, local and nfs are emulated")

    def _config_map(self, name: str, optional: bool | None) -> dict[str, bytes]:
        config_map = self._read("configMap", self.core.read_namespaced_config_map, name, optional)
        if config_map is None:
            return {}
        data = {k: v.encode() for k, v in (config_map.data or {}).items()}
        return data | {k: base64.b64decode(v) for k, v in (config_map.binary_data or {}).items()}

    def _secret(self, name: str, optional: bool | None) -> dict[str, bytes]:
        secret = self._read("secret", self.core.read_namespaced_secret, name, optional)
        return {} if secret is None else {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    def _read(self, kind: str, read, name: str, optional: bool | None):
        """The pod's namespace's object, None when it is missing and the volume says it may be."""
        try:
            return read(name, self.pod.metadata.namespace)
        except ApiException as exc:
            if exc.status == 404 and optional:
                return None
            raise OSError(f"{kind} {name}: {exc.status} {exc.reason}") from exc

    def _downward(self, items: list | None) -> dict[str, bytes]:
        files = {}
        for item in items or []:
            if item.field_ref is None:
                raise OSError(f"downwardAPI {item.path}: only fieldRef is emulated")
            files[item.path] = field_value(self.pod, item.field_ref.field_path).encode()
        return files

    def _projected(self, own: Path, projected: k8s.V1ProjectedVolumeSource) -> Path:
        for source in projected.sources or []:
            if source.config_map is not None:
                files = self._config_map(source.config_map.name, source.config_map.optional)
                items = source.config_map.items
            elif source.secret is not None:
                files, items = self._secret(source.secret.name, source.secret.optional), source.secret.items
            elif source.downward_api is not None:
                files, items = self._downward(source.downward_api.items), None
            elif source.service_account_token is not None:
                files, items = {source.service_account_token.path: self._token(source.service_account_token)}, None
            else:
                raise OSError(f"projected source {source.to_dict()} is not emulated")
            self._files(own, files, items, projected.default_mode)
        own.mkdir(parents=True, exist_ok=True)
        return own

    def _token(self, source: k8s.V1ServiceAccountTokenProjection) -> bytes:
        request = {"spec": {"audiences": [source.audience] if source.audience else None,
                            "expirationSeconds": source.expiration_seconds or 3600,
                            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.pod.metadata.name,
                                               "uid": self.pod.metadata.uid}}}
        account = self.pod.spec.service_account_name or "default"
        answer = self.core.create_namespaced_service_account_token(account, self.pod.metadata.namespace, request)
        return answer.status.token.encode()

    @staticmethod
    def _files(own: Path, files: dict[str, bytes], items: list | None, mode: int | None) -> Path:
        own.mkdir(parents=True, exist_ok=True)
        chosen = [(i.key, i.path, i.mode) for i in items] if items else [(k, k, None) for k in files]
        for key, relative, item_mode in chosen:
            if key not in files:
                raise OSError(f"key {key!r} is not in the volume's source")
            path = own / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(files[key])
            path.chmod(item_mode if item_mode is not None else mode if mode is not None else 0o644)
        return own


def field_value(pod: k8s.V1Pod, field_path: str) -> str:
    """The downward API's metadata fields (status fields are the kubelet's: see ProcessRuntime)."""
    meta = pod.metadata
    simple = {"metadata.name": meta.name, "metadata.namespace": meta.namespace, "metadata.uid": meta.uid,
              "spec.nodeName": pod.spec.node_name, "spec.serviceAccountName": pod.spec.service_account_name}
    if field_path in simple:
        return simple[field_path] or ""
    if field_path in ("metadata.labels", "metadata.annotations"):
        pairs = (meta.labels if field_path == "metadata.labels" else meta.annotations) or {}
        return "\n".join(f"{k}={json.dumps(v)}" for k, v in sorted(pairs.items()))
    raise OSError(f"downward API field {field_path!r} is not emulated")


def run_as(pod: k8s.V1Pod, container: k8s.V1Container) -> list[str]:
    """The argv prefix that runs `container` as its securityContext's uid, gid and groups (the container's settings
    over the pod's; the pod's fsGroup and supplementalGroups as supplementary groups); [] for root or none set.

    The process keeps one capability, CAP_DAC_READ_SEARCH: the pods run this machine's interpreter and packages, which
    may lie where only root reads (a Python under /root, mode 0700); what it writes, creates and connects to is
    still decided by its uid and groups."""
    pod_context = pod.spec.security_context or k8s.V1PodSecurityContext()
    context = container.security_context or k8s.V1SecurityContext()
    uid = context.run_as_user if context.run_as_user is not None else pod_context.run_as_user
    if not uid:
        return []
    gid = context.run_as_group if context.run_as_group is not None else pod_context.run_as_group
    groups = [g for g in [pod_context.fs_group, *(pod_context.supplemental_groups or [])] if g is not None]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid if gid is not None else 0}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--"]


def sandbox_script(mounts: list[Mount], hosts: Path | None, working_dir: str | None = None) -> str:
    """A bash script that makes the mounts (in a private mount namespace), then execs its arguments.

    Every source is opened before the first mount (and mounted through /proc/self/fd), since a mount may hide the
    path of a later source: an emptyDir on /tmp hides a kubelet directory under /tmp."""
    mounts = [*mounts, *([Mount(hosts, "/etc/hosts", False)] if hosts else [])]
    fds = range(3, 3 + len(mounts))
    lines = ["set -e"]
    if mounts:
        lines.append("exec " + " ".join(f"{fd}<{shlex.quote(str(m.source))}"
                                        for fd, m in zip(fds, mounts, strict=True)))
    for fd, mount in zip(fds, mounts, strict=True):
        target = shlex.quote(mount.target)
        if mount.source.is_dir():
            lines.append(f"mkdir -p {target}")
        else:
            lines.append(f"mkdir -p {shlex.quote(str(PurePosixPath(mount.target).parent))}; "
                         f"[ -e {target} ] || touch {target}")
        lines.append(f"mount --bind /proc/self/fd/{fd} {target}")
        if mount.read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    if mounts:
        lines.append("exec " + " ".join(f"{fd}<&-" for fd in fds))
    if working_dir:
        lines.append(f"cd {shlex.quote(working_dir)}")
    lines.append('exec "$@"')
    return "\n".join(lines) + "\n"


def _bytes(quantity: str) -> int:
    from kubernetes.utils import parse_quantity

    return int(parse_quantity(quantity))


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {result.stderr.strip()}")
