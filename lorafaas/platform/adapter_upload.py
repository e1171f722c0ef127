"""Adapters arriving over HTTP: a tar archive (optionally gzipped) holding adapter_config.json and
adapter_model.safetensors, unpacked safely into a scratch directory for validation.

Only those two regular files are taken, at the archive's root or inside one top-level folder; anything else
(links, devices, absolute or `..` paths, other names, oversized members, more than `MAX_MEMBERS` entries, a truncated
or corrupt stream) is refused with a message naming it, and nothing outside the scratch directory is ever written.
The archive is read as a stream from a file (the gateway spools an upload to disk), never held whole in memory.
"""

from __future__ import annotations

import errno
import io
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from lorafaas.errors import AdapterInvalid, PickledWeightsRefused, ServerError, StorageFull
from lorafaas.formats.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from lorafaas.formats.weights import PICKLE_SUFFIXES

MAX_CONFIG_BYTES = 1024 * 1024
MAX_WEIGHTS_BYTES = 2 * 1024**3
ALLOWED = {CONFIG_FILE: MAX_CONFIG_BYTES, WEIGHTS_FILE: MAX_WEIGHTS_BYTES}
# Two files and a folder or two; a tar of 200,000 empty folders would otherwise cost the gateway seconds of CPU.
MAX_MEMBERS = 16
# A broken stream: gzip or tar framing cut short or corrupt (zlib.error: a damaged deflate block).
_BROKEN_STREAM = (tarfile.TarError, EOFError, zlib.error)


def unpack_adapter(archive: bytes | BinaryIO, out_dir: Path) -> Path:
    """Write the archive's two adapter files into `out_dir`; returns `out_dir`."""
    source = io.BytesIO(archive) if isinstance(archive, bytes | bytearray) else archive
    try:
        tar = tarfile.open(fileobj=source, mode="r:*")  # noqa: SIM115 (closed by the with below)
    except (*_BROKEN_STREAM, OSError) as exc:
        raise AdapterInvalid("the adapter upload is not a tar archive (plain, gzip, bzip2 or xz)") from exc
    found: set[str] = set()
    with tar:
        try:
            _unpack_members(tar, Path(out_dir), found)
        except _BROKEN_STREAM as exc:
            raise AdapterInvalid(f"the adapter archive is truncated or corrupt ({exc})") from exc
    missing = set(ALLOWED) - found
    if missing:
        raise AdapterInvalid(f"the adapter archive lacks {', '.join(sorted(missing))}")
    return Path(out_dir)


def _unpack_members(tar: tarfile.TarFile, out_dir: Path, found: set[str]) -> None:
    for index, member in enumerate(tar):
        if index >= MAX_MEMBERS:
            raise AdapterInvalid(
                f"the adapter archive has more than {MAX_MEMBERS} entries; it should hold {CONFIG_FILE} and "
                f"{WEIGHTS_FILE} (and at most one folder)"
            )
        name = _checked_name(member)
        if name is None:
            continue
        if member.size > ALLOWED[name]:
            raise AdapterInvalid(f"{member.name} is {member.size} bytes; the limit is {ALLOWED[name]} bytes")
        if name in found:
            raise AdapterInvalid(f"the archive holds {name} twice")
        try:
            _copy_member(tar.extractfile(member), out_dir / name)
        except OSError as exc:
            raise storage_error(exc, f"cannot unpack the uploaded {name} ({member.size} bytes)") from exc
        found.add(name)


def _copy_member(source, target: Path, chunk_bytes: int = 1 << 20) -> None:
    """Stream a member to disk: a member inflates to its (checked) size in chunks, never whole in memory."""
    with target.open("wb") as out:
        while chunk := source.read(chunk_bytes):
            out.write(chunk)


def _checked_name(member: tarfile.TarInfo) -> str | None:
    """The adapter file this member is, None for a folder; raises for anything unsafe or unexpected."""
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts:
        raise AdapterInvalid(f"archive member {member.name!r} points outside the adapter; refused")
    if member.isdir():
        return None
    if not member.isfile():
        kind = "a link" if member.issym() or member.islnk() else "not a regular file"
        raise AdapterInvalid(f"archive member {member.name!r} is {kind}; only regular files are accepted")
    parts = [p for p in path.parts if p != "."]
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise PickledWeightsRefused(
            f"archive member {member.name!r} is pickled weights; lorafaas accepts {WEIGHTS_FILE} only"
        )
    if len(parts) > 2 or parts[-1] not in ALLOWED:
        raise AdapterInvalid(
            f"unexpected archive member {member.name!r}; an adapter archive holds only {CONFIG_FILE} and "
            f"{WEIGHTS_FILE}"
        )
    return parts[-1]


def storage_error(exc: OSError, action: str) -> ServerError:
    """A failed write as the platform reports it: StorageFull (507) when space ran out, ServerError otherwise."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return StorageFull(f"{action}: {exc.strerror}; free some space on the platform's disk and retry")
    return ServerError(f"{action}: {exc}")


def pack_adapter(adapter_dir: Path) -> bytes:
    """The CLI's side: a plain tar of the adapter's two files (symlinks followed, as in the Hugging Face cache).
    Not gzipped: random-looking float weights shrink by about 7%, and gzip costs a second of CPU per 3-4 MB (25 s for
    a 74 MB rank-64 all-linear SmolLM2 adapter on a busy 2-core machine, against 0.8 s for the tar)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", dereference=True) as tar:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            path = Path(adapter_dir) / name
            if not path.is_file():
                raise AdapterInvalid(f"{adapter_dir} has no {name}")
            tar.add(path, arcname=name, recursive=False)
    return buffer.getvalue()
