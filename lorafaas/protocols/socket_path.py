"""A Unix socket's path as this process bound it.

Several of a home's sockets have fixed names (the step gate's, the zygote's): a server started while its predecessor
on the same home is still stopping binds the same path, and the predecessor's cleanup, removing "its" path, would
remove the new server's socket (its workers then find no gate and compute ungated). `BoundPath` remembers which file
this process bound (device, inode and change time: an inode number freed by the predecessor's removal may be given
to the successor's socket, its change time is that of its own bind) and removes the path at stop only while it is
still that file. It also sets the socket's mode first: a chmod changes the change time, so recorded before it, the
file would no longer read as this process's own.
"""

from __future__ import annotations

import os
from pathlib import Path


class BoundPath:
    def __init__(self, path: Path | str, mode: int = 0o600) -> None:
        """Call right after binding `path`: sets the socket's `mode` (default: only this user may connect), then
        records the file it names now."""
        self.path = Path(path)
        self.path.chmod(mode)
        stat = os.stat(self.path)
        self._file = (stat.st_dev, stat.st_ino, stat.st_ctime_ns)

    def ours(self) -> bool:
        """Whether the path still names the socket this process bound."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (stat.st_dev, stat.st_ino, stat.st_ctime_ns) == self._file

    def unlink(self) -> None:
        """Remove the path if it still names this process's socket; a successor's is left alone. (Between the check
        and the removal a successor could bind in a few microseconds; its start removes a stale path first anyway.)"""
        if self.ours():
            self.path.unlink(missing_ok=True)
