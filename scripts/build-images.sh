#!/usr/bin/env bash
# Build the container images under manifests/images with buildah (daemonless; Debian's package) and run each image's
# entrypoint once, on a machine with no Docker daemon and possibly no Docker Hub:
#
#   bash scripts/build-images.sh [function|node-agent|gateway ...]     # default: all three
#
# The base image: python:3.11-slim when it can be pulled; else a stand-in made by debootstrap from Debian's archive
# (bookworm, python3.11: the distribution and Python of python:3.11-slim, though not its build of Python), given to
# buildah with --from. torch: the Dockerfiles' default index (download.pytorch.org); with LORAFAAS_TORCH_WHEELS=DIR, a
# torch 2.13.0 CPU wheel from DIR instead (PyPI for its dependencies), mounted at build time only.
#   LORAFAAS_TORCH_WHEELS=/opt/wheels LORAFAAS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt bash scripts/build-images.sh
# buildah runs steps with --isolation chroot (no user namespaces needed) and stores under $LORAFAAS_IMAGE_WORK.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${LORAFAAS_IMAGE_WORK:-$HOME/.cache/lorafaas-images}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)
STANDIN=localhost/lorafaas-base:bookworm-python3.11
IMAGES=("$@")
[ ${#IMAGES[@]} -gt 0 ] || IMAGES=(function node-agent gateway)
mkdir -p "$WORK"
bah() { buildah --storage-driver vfs --root "$WORK/storage" --runroot "$WORK/run" "$@"; }

command -v buildah >/dev/null || { echo "buildah is not installed: apt-get install buildah" >&2; exit 2; }

base=python:3.11-slim
if ! bah pull --quiet "docker.io/library/$base" >/dev/null 2>"$WORK/pull.log"; then
    echo "cannot pull $base ($(tail -1 "$WORK/pull.log")); using $STANDIN" >&2
    base=$STANDIN
    if ! bah inspect --type image "$base" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || { echo "debootstrap is not installed: apt-get install debootstrap" >&2; exit 2; }
        if [ ! -f "$WORK/rootfs.done" ]; then
            rm -rf "$WORK/rootfs"
            debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,python-is-python3,passwd \
                bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log"
            touch "$WORK/rootfs.done"
        fi
        rm -f "$WORK"/rootfs/usr/lib/python3*/EXTERNALLY-MANAGED  # python:3.11-slim's pip installs system-wide
        rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
        container=$(bah from scratch)
        mount=$(bah mount "$container")
        (cd "$WORK/rootfs" && tar --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* -cf - .) | tar -C "$mount" -xf -
        bah umount "$container" >/dev/null
        bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd python3 "$container"
        bah commit --quiet "$container" "$base" >/dev/null
        bah rm "$container" >/dev/null
    fi
fi

# build-time only (mounts, not layers): a pip.conf for the wheels below and a CA bundle (LORAFAAS_CA_BUNDLE=FILE,
# for a network whose TLS proxy has its own CA)
mounts=()
printf '[global]\n' >"$WORK/pip.conf"
if [ -n "${LORAFAAS_TORCH_WHEELS:-}" ]; then
    printf 'find-links = /wheels\n' >>"$WORK/pip.conf"
    mounts+=(-v "$LORAFAAS_TORCH_WHEELS:/wheels:ro" --build-arg TORCH_INDEX_URL=https://pypi.org/simple)
fi
if [ -n "${LORAFAAS_CA_BUNDLE:-}" ]; then
    printf 'cert = /etc/lorafaas-build-ca.crt\n' >>"$WORK/pip.conf"
    mounts+=(-v "$LORAFAAS_CA_BUNDLE:/etc/lorafaas-build-ca.crt:ro")
fi
mounts+=(-v "$WORK/pip.conf:/etc/pip.conf:ro")

for image in "${IMAGES[@]}"; do
    tag="lorafaas/$image:$VERSION"
    if [ "${LORAFAAS_IMAGE_REUSE:-0}" = 1 ] && bah inspect --type image "$tag" >/dev/null 2>&1; then
        echo "reusing $tag (LORAFAAS_IMAGE_REUSE=1)" >&2
    else
        echo "building $tag from $base" >&2
        bah bud --isolation chroot --layers=false --pull=never --from "$base" "${mounts[@]}" \
            -f "$ROOT/manifests/images/$image/Dockerfile" -t "$tag" "$ROOT" >"$WORK/build-$image.log" 2>&1 \
            || { tail -20 "$WORK/build-$image.log" >&2; exit 1; }
    fi
    # the image's own entrypoint, as its user: the function's worker until it listens, the node agent's default command
    # (lists the backbones of an empty home), the gateway's `up --help`
    container=$(bah from --pull=never "$tag")
    config=$(bah inspect --type image "$tag")
    field() { python3 -c 'import json, sys; print(json.dumps(json.loads(sys.stdin.read())["OCIv1"]["config"].get(sys.argv[1]) or []))' "$1" <<<"$config"; }
    port=$((20000 + RANDOM % 20000))
    case "$image" in
        function) expect="listening on"
            args=$(python3 -c 'import json, sys; print(json.dumps([json.dumps({"function": "probe", "instance_id": "probe-0",
                "socket_path": f"tcp://127.0.0.1:{sys.argv[1]}", "model_dir": "/nonexistent"})]))' "$port") ;;
        node-agent) args=$(field Cmd); expect="" ;;
        gateway) args='["up", "--help"]'; expect="--backend" ;;
    esac
    mapfile -t command < <(python3 -c 'import json, sys; print("\n".join(json.loads(sys.argv[1]) + json.loads(sys.argv[2])))' "$(field Entrypoint)" "$args")
    echo "running $tag: ${command[*]}" >&2
    set +e
    timeout 120 buildah --storage-driver vfs --root "$WORK/storage" --runroot "$WORK/run" run --isolation chroot \
        --user "$(python3 -c 'import json, sys; print(json.loads(sys.argv[1]))' "$(field User)")" "$container" -- \
        "${command[@]}" >"$WORK/run-$image.log" 2>&1
    status=$?
    set -e
    bah rm "$container" >/dev/null
    tail -3 "$WORK/run-$image.log" >&2
    if [ -n "$expect" ]; then
        grep -q -e "$expect" "$WORK/run-$image.log" || { echo "$image: no '$expect' in its output" >&2; exit 1; }
    elif [ "$status" -ne 0 ]; then
        echo "$image: exit status $status" >&2; exit 1
    fi
    echo "$image: built and ran" >&2
done
