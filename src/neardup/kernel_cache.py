"""Where numba keeps neardup's compiled kernels, chosen before the first kernel is defined.

This is for processes that compile the kernels at run, with numba's just-in-time compiler:
those of an install that has no ahead-of-time build of them (``neardup.core.aot``), or
that ask for it (``NEARDUP_KERNELS=jit``).

numba caches a compiled function (``cache=True``) beside its source, in ``__pycache__``,
else in the user's cache directory (``$XDG_CACHE_HOME/numba``, ``~/.cache/numba``), and
raises ``RuntimeError: cannot cache function ...: no locator available`` when the module
is imported and neither is writable: a container with a read-only root file system, or an
install owned by another user with a read-only home. :func:`choose` then points numba at a
directory under the temporary directory (``$TMPDIR``, an ``emptyDir`` in Kubernetes), the
one place such a process can write.

Prebuilt kernels: an image compiles the kernels once at build time into a directory
(``python -m neardup.build_kernels DIR``) and ships it;
at start, files of that directory missing from the cache in use are copied there, so that
a fresh container loads the kernels (about half a second) instead of compiling them (13 s
of CPU on an idle core, minutes on a busy one). The directory is ``NEARDUP_PREBUILT_KERNELS``,
by default ``<sys.prefix>/share/neardup/kernels``. numba keys a kernel on the source file's
directory and contents and on the CPU model, so the prebuilt kernels serve only the same
install, and only a machine of the same CPU model unless both build and run set
``NUMBA_CPU_NAME=generic`` (as the image does); any other case compiles as before.

Environment variables read: ``NUMBA_CACHE_DIR`` (a user's choice always wins),
``NEARDUP_PREBUILT_KERNELS``, ``XDG_CACHE_HOME``, ``HOME``, ``TMPDIR``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

#: Where an install's prebuilt kernels are looked for when NEARDUP_PREBUILT_KERNELS is unset.
DEFAULT_PREBUILT = Path(sys.prefix) / "share" / "neardup" / "kernels"

_PACKAGE = Path(__file__).resolve().parent
#: The folders of the modules that define cached kernels (numba writes their __pycache__).
_KERNEL_DIRS = (_PACKAGE / "core", _PACKAGE / "state")


def _writable(path: Path) -> bool:
    """Whether numba could cache in ``path``: its own test (create it, write a temporary file)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def _user_wide(environ: MutableMapping[str, str]) -> Path:
    """numba's per-user cache folder on Linux and macOS (``numba.misc.appdirs``)."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "numba"


def seed(cache_dir: Path, prebuilt: Path) -> int:
    """Copy the files of ``prebuilt`` missing from ``cache_dir`` into it; returns how many.

    A file is written under a temporary name and linked into place, so that a process
    reading the cache meanwhile (numba's index, ``.nbi``; a kernel, ``.nbc``) never sees
    half a file, and a file already there (compiled here since) is never replaced.
    Raises nothing: a file that cannot be copied is left to numba to compile.
    """
    copied = 0
    for source in sorted(prebuilt.rglob("*")):
        if not source.is_file():
            continue
        target = cache_dir / source.relative_to(prebuilt)
        if target.exists():
            continue
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=target.parent, prefix=".seed-")
            os.close(fd)
            try:
                shutil.copyfile(source, partial)
                os.link(partial, target)  # fails if another process got there first
                copied += 1
            finally:
                os.unlink(partial)
        except OSError:
            continue
    return copied


def choose(environ: MutableMapping[str, str] | None = None) -> Path | None:
    """Make sure numba can cache the kernels, and seed its cache with prebuilt kernels.

    Must run before the first kernel module is imported (``neardup/__init__.py`` calls
    it). ``NUMBA_CACHE_DIR`` set by the user is kept. Otherwise numba's own choice is kept
    when it can write beside the package or in the user's cache folder; when it can write
    in neither, ``NUMBA_CACHE_DIR`` is set (in ``environ``, hence also for child
    processes) to ``$TMPDIR/neardup-kernels-<uid>``.

    Returns the ``NUMBA_CACHE_DIR`` in effect, or None when numba's own folders are used.
    Raises nothing: a cache that cannot be written anywhere is numba's error to report.
    """
    environ = os.environ if environ is None else environ
    chosen = environ.get("NUMBA_CACHE_DIR", "")
    if not chosen:
        if all(_writable(d / "__pycache__") for d in _KERNEL_DIRS) or _writable(_user_wide(environ)):
            return None
        uid = os.getuid() if hasattr(os, "getuid") else 0
        chosen = os.path.join(tempfile.gettempdir(), f"neardup-kernels-{uid}")
        environ["NUMBA_CACHE_DIR"] = chosen
        config = sys.modules.get("numba.core.config")
        if config is not None:  # numba read its settings already
            config.CACHE_DIR = chosen  # type: ignore[attr-defined]
    prebuilt = Path(environ.get("NEARDUP_PREBUILT_KERNELS") or DEFAULT_PREBUILT)
    if prebuilt.is_dir() and Path(chosen).resolve() != prebuilt.resolve():
        seed(Path(chosen), prebuilt)
    return Path(chosen)
