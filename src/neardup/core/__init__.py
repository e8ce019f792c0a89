"""The pure core: normalisation, shingling, MinHash, LSH banding, set overlap,
union-find.

Nothing here does I/O: numpy, numba (the compiled kernels, ``neardup.core.aot``) and
xxhash only.
"""

import sys


def numba_math_without_scipy() -> None:
    """Import numba's array math (``numba.np.arraymath``) with SciPy's linear algebra
    hidden, unless it is imported already.

    numba's CPU target imports that module when it is first set up (at the first call of
    a compiled kernel), and the module probes for SciPy's BLAS, importing SciPy when it is
    installed (``scipy.linalg``): 0.06 to 0.09 s of every ``neardup`` process's start-up
    on a 2-core machine.
    The kernels here use no linear algebra, so the probe is left to find none; SciPy
    itself is not touched: it is importable again right after, but numba's own linear
    algebra (``np.dot`` and ``np.linalg`` in compiled code) is off in this process. So
    only neardup's own processes call this (the ``neardup`` command and its worker
    process), before their first compiled call; importing ``neardup`` as a library
    changes nothing. Nothing is imported when the process runs the kernels built ahead of
    time (``neardup.core.aot``): numba is not needed then.
    """
    from neardup.core.aot import ahead_of_time  # noqa: PLC0415

    if "scipy.linalg" in sys.modules or ahead_of_time():
        return
    sys.modules["scipy.linalg"] = None  # type: ignore[assignment]  # an import of it fails at once
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        del sys.modules["scipy.linalg"]

