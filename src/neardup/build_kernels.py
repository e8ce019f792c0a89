"""Compile neardup's kernels: ahead of time into the extension module ``neardup._kernels``
(``setup.py`` calls :func:`aot_compiler` at install; ``neardup.core.aot``), or into numba's
cache folder that an image ships for processes that compile at run
(``neardup.kernel_cache``):

    python -m neardup.build_kernels /usr/local/share/neardup/kernels

Run that in the image, as the last step of the build, with the ``NUMBA_CPU_NAME`` the
containers will have (``generic``: kernels for any CPU of the architecture).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

#: ``neardup dedup`` options, one variant each, whose runs together call every kernel:
#: the two MinHash schemes, shingle kinds, measures and directions, verification modes,
#: cluster policies, multisets, and a retention window over a state directory.
WARM_VARIANTS: tuple[tuple[str, ...], ...] = (
    (),
    ("--shingle", "char:5"),
    ("--minhash", "classic"),
    ("--measure", "containment", "--containment-direction", "both"),
    ("--measure", "containment", "--containment-direction", "earlier-in-new"),
    ("--verify", "estimate"),
    ("--cluster-policy", "components"),
    ("--multiset",),
    ("--duplicate-buckets", "all"),
    ("--retention-documents", "3", "--timestamp-field", "time", "--state-dir", "{state}"),
)

_WARM_TEXTS = (
    "the central bank raised its key interest rate by half a point on tuesday citing inflation",
    "shares of the mining group fell sharply after the company cut its profit forecast for the year",
    "the ministry said grain exports rose in the first quarter as harvests recovered from drought",
)


def build(target: Path) -> None:
    """Compile every kernel into ``target`` (a ``NUMBA_CACHE_DIR``) by running :func:`warm`.
    The image build runs it (``python -m neardup.build_kernels DIR``) with the runtime's
    ``NUMBA_CPU_NAME``.

    Raises:
        RuntimeError: numba was imported already (its cache folder is fixed then), or a
            warm-up run failed.
    """
    if "numba" in sys.modules or "neardup.core.aot" in sys.modules:
        raise RuntimeError("build() must run before numba and neardup.core.aot are imported")
    os.environ["NUMBA_CACHE_DIR"] = str(target)
    os.environ["NEARDUP_KERNELS"] = "jit"  # numba's kernels, whatever the install built
    warm()


def warm() -> None:
    """Compile every kernel into the cache in use (numba's own choice, or
    ``NUMBA_CACHE_DIR``) by running ``neardup dedup`` in this process over a few stories
    and their edited copies, once per variant of :data:`WARM_VARIANTS`, then the sharded
    mode's pair check (``neardup.sharded.shard.similarities``); kernels already
    cached are loaded, not compiled. The test suite runs it once before its parallel
    workers start, so that a cold cache is compiled once, not once per worker.

    Raises:
        RuntimeError: a warm-up run failed.
    """
    import contextlib  # noqa: PLC0415 - only here
    import json  # noqa: PLC0415

    from neardup.cli import main  # noqa: PLC0415 - after the cache folder is set

    with tempfile.TemporaryDirectory(prefix="neardup-kernels-") as scratch:
        corpus = Path(scratch) / "warm.jsonl"
        lines = []
        for i, text in enumerate(_WARM_TEXTS * 2):
            edited = text if i < len(_WARM_TEXTS) else text.replace(" the ", " a ", 1) + " officials said"
            lines.append(json.dumps({"id": f"w{i}", "text": edited, "time": 1_700_000_000 + i}))
        corpus.write_text("\n".join(lines) + "\n")
        for n, variant in enumerate(WARM_VARIANTS):
            argv = [a.replace("{state}", str(Path(scratch) / f"state{n}")) for a in variant]
            with contextlib.redirect_stdout(None):  # the runs' summaries
                code = main(["dedup", str(corpus), "--out-dir", str(Path(scratch) / f"out{n}"),
                             "--no-pipeline", "--no-progress", "--batch-size", "2", "--log-level", "WARNING", *argv])
            if code != 0:
                raise RuntimeError(f"kernel warm-up {' '.join(variant) or '(defaults)'} exited {code}")
    # the sharded mode's pair check, which dedup does not make (``similarities`` hands the
    # kernel read-only views, whatever it is given)
    import numpy as np  # noqa: PLC0415

    from neardup.sharded.shard import similarities  # noqa: PLC0415

    similarities(np.array([1, 5, 9], np.uint32), np.array([5, 9, 12], np.uint32), "jaccard", "new-in-earlier")


def aot_compiler() -> Any:
    """numba's ahead-of-time compiler (``numba.pycc.CC``) set up with every kernel that
    Python calls (``neardup.core.aot.EXPORTS``, each with its one signature), the kernel
    sources' digest (``source_digest()`` in the module) and the target's
    (``target_digest()``), for ``CC.distutils_extension()``
    or ``CC.compile()``. The kernels are compiled for ``NUMBA_CPU_NAME`` when it is set,
    else for the CPU of this machine (``host``), and release the GIL as their JIT builds do
    (``nogil=True``: the pipelined mode prepares a batch in a thread meanwhile).

    Must run in a process that has not imported ``neardup.core.aot`` yet (it sets
    ``NEARDUP_KERNELS=jit``, so that the kernels are numba functions to compile).

    Raises:
        RuntimeError: ``neardup.core.aot`` was imported already.
        ImportError: numba is not installed.
    """
    import importlib  # noqa: PLC0415 - only here
    import warnings  # noqa: PLC0415

    if "neardup.core.aot" in sys.modules:
        raise RuntimeError("aot_compiler() must run before neardup.core.aot is imported")
    os.environ["NEARDUP_KERNELS"] = "jit"
    with warnings.catch_warnings():  # numba.pycc: "pending deprecation"
        warnings.simplefilter("ignore")
        import numba.pycc.compiler  # noqa: PLC0415
        from numba.pycc import CC  # noqa: PLC0415

    class _GilReleased(numba.pycc.compiler.Flags):  # type: ignore[misc,name-defined]
        """The compile flags of every exported kernel, with its Python wrapper releasing
        the GIL (``nogil=True``; pycc has no option for it)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.release_gil = True

    numba.pycc.compiler.Flags = _GilReleased  # type: ignore[attr-defined]
    from neardup.core import aot  # noqa: PLC0415

    for module in aot.KERNEL_MODULES:
        importlib.import_module(module)
    compiler = CC("_kernels", source_module="neardup.build_kernels")  # neardup._kernels
    compiler.target_cpu = target_cpu()
    compiler.verbose = False
    for export in aot.EXPORTS:
        compiler.export(export.symbol, export.signature)(export.function)
    digest = aot.source_digest()
    compiler.export("source_digest", "int64()")(lambda: digest)
    target = target_digest(compiler.target_cpu)
    compiler.export("target_digest", "int64()")(lambda: target)
    return compiler


def target_cpu() -> str:
    """The CPU the kernels are compiled for: ``NUMBA_CPU_NAME`` when it is set, else
    ``host`` (this machine's)."""
    return os.environ.get("NUMBA_CPU_NAME") or "host"


def target_digest(cpu: str) -> int:
    """A 63-bit digest of the CPU name the kernels are compiled for (``host`` or a
    ``NUMBA_CPU_NAME``), stored in the extension so that ``setup.py`` rebuilds one built
    for another target."""
    from neardup.core.aot import digest63  # noqa: PLC0415

    return digest63(cpu.encode())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m neardup.build_kernels DIR")
    build(Path(sys.argv[1]))
