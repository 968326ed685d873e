"""Cache files written atomically: the pipeline cache, the device profile, a shader manifest.

Several vkxsplit processes may share one cache directory (``VKXSPLIT_CACHE_DIR``): each
writes into a temporary file of its own (a unique name in the target's directory, so the
rename is atomic on the same file system) and renames it over the target. A reader sees the
old file or the new one, never a mixture, and two writers never write into one temporary
file (one of the two saves wins, whole).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a private temporary file and an atomic rename; on any
    error the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["atomic_write"]
