"""Fetch a function's adapter from the control plane before its worker starts: the init step of a function pod.

On Kubernetes the adapter store lives on the controller's volume; a function pod on any node gets its own adapter
through the controller's internal route (`GET /internal/adapters/<digest>/<file>`, lorafaas/platform/adapter_access.py)
into the pod's own volume, which the worker then mounts read-only. The request carries a credential the controller
minted for this function and this digest only; the bytes are hashed as they arrive (the digest is the sha256 over
adapter_config.json then adapter_model.safetensors, as the adapter store names its entries) and nothing is left in
place unless they match.

    python -m lorafaas.function_runtime.adapter_fetch <destination directory>

reads LORAFAAS_ADAPTER_URL, LORAFAAS_FUNCTION, LORAFAAS_ADAPTER_DIGEST and LORAFAAS_ADAPTER_TOKEN; on failure it
prints one line saying why and exits 1 (the pod's termination message: the controller reports it as the launch's
failure).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

import httpx

from lorafaas.formats.adapter_files import CONFIG_FILE, WEIGHTS_FILE

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # hashed in this order, as the adapter store hashes them
FUNCTION_HEADER = "x-lorafaas-function"
CHUNK_BYTES = 1024 * 1024
ENV = ("LORAFAAS_ADAPTER_URL", "LORAFAAS_FUNCTION", "LORAFAAS_ADAPTER_DIGEST", "LORAFAAS_ADAPTER_TOKEN")


class AdapterFetchError(Exception):
    pass


def fetch_adapter(url: str, function: str, digest: str, token: str, dest: Path, timeout_s: float = 60.0) -> Path:
    """Download the adapter `digest` of `function` into `dest` and check its digest; returns `dest`. On any failure
    (refused, unreachable, mismatch) `dest` holds none of the adapter's files and AdapterFetchError says why."""
    dest.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256()
    headers = {"authorization": f"Bearer {token}", FUNCTION_HEADER: function}
    try:
        with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s) as client:
            for name in ADAPTER_FILES:
                _download(client, f"/internal/adapters/{digest}/{name}", dest / name, hasher)
    except (httpx.HTTPError, OSError) as exc:
        _discard(dest)
        raise AdapterFetchError(f"cannot fetch adapter {digest[:12]} of {function} from {url}: {exc}") from exc
    except AdapterFetchError:
        _discard(dest)
        raise
    if hasher.hexdigest() != digest:
        _discard(dest)
        raise AdapterFetchError(
            f"adapter of {function} refused: its bytes hash to {hasher.hexdigest()[:12]}, not to the deployed "
            f"digest {digest[:12]} (the control plane's copy is damaged or was replaced); nothing was kept")
    return dest


def _download(client: httpx.Client, path: str, target: Path, hasher: hashlib._Hash) -> None:
    with client.stream("GET", path) as reply:
        if reply.status_code != 200:
            reply.read()
            raise AdapterFetchError(f"the control plane refused {path}: {reply.status_code} {_message(reply)}")
        with target.open("wb") as out:
            for chunk in reply.iter_bytes(CHUNK_BYTES):
                hasher.update(chunk)
                out.write(chunk)


def _message(reply: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return str(reply.json()["error"]["message"])
    return reply.text[:200]


def _discard(dest: Path) -> None:
    for name in ADAPTER_FILES:
        (dest / name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    missing = [name for name in ENV if not os.environ.get(name)]
    if len(args) != 1 or missing:
        print(f"usage: adapter_fetch <destination> with {', '.join(ENV)} set"
              + (f" (missing: {', '.join(missing)})" if missing else ""), file=sys.stderr)
        return 2
    url, function, digest, token = (os.environ[name] for name in ENV)
    try:
        fetch_adapter(url, function, digest, token, Path(args[0]))
    except AdapterFetchError as exc:
        print(f"adapter fetch failed: {exc}", file=sys.stderr)
        return 1
    print(f"fetched adapter {digest[:12]} of {function}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
