"""On-disk cache of built kernels.

An entry is ``<key>.bin``: a magic line, the SHA-256 of the payload, then the payload. Entries are written
to a temporary file and moved into place with ``os.replace`` (a reader never sees half a file), checked on
read (a damaged entry is rebuilt), and built under a per-key file lock so that ranks sharing a node build
each kernel once while the others wait for it.
"""
import contextlib
import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

CACHE_ENV = "MOECOMM_CACHE_DIR"
_MAGIC = b"moecomm-cache-v1\n"


def cache_dir():
    """``$MOECOMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/moecomm``, else ``~/.cache/moecomm``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moecomm"


def _read(path):
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    head = len(_MAGIC) + 65
    if not data.startswith(_MAGIC) or len(data) < head:
        return None
    digest, payload = data[len(_MAGIC):head - 1].decode("ascii", "replace"), data[head:]
    return payload if hashlib.sha256(payload).hexdigest() == digest else None


def _write(path, payload):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def get_or_build(key, build, directory=None):
    """Return the cached payload (bytes) for ``key``, calling ``build()`` to make it on a miss.

    Returns ``(payload, hit)`` where hit says whether the payload came from the disk.
    """
    d = Path(directory) if directory is not None else cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{key}.bin"
    payload = _read(path)
    if payload is not None:
        return payload, True
    with open(d / f"{key}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        payload = _read(path)  # another process may have built it while we waited
        if payload is not None:
            return payload, True
        payload = build()
        _write(path, payload)
        return payload, False
