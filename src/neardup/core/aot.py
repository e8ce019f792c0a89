"""neardup's compiled kernels: built ahead of time at install, or compiled by numba at run.

Every kernel is a numba ``nopython`` function over numpy arrays, declared with
:func:`kernel`. ``pip install`` compiles the kernels that Python calls (those declared with
a signature) into one extension module, ``neardup._kernels``, with numba's ahead-of-time
compiler (``numba.pycc``; ``setup.py``, :func:`neardup.build_kernels.aot_compiler`). A
process that finds that module, built from the kernel sources it runs, calls its functions
and never imports numba: about 0.6 s less start-up, and no compiling at the first run of
a fresh install (13 s of CPU on an idle core). Otherwise (a source checkout run from its
folder, a kernel edited since the build, a build that failed, or ``NEARDUP_KERNELS=jit``)
:func:`kernel` hands the function to ``numba.njit(nogil=True, cache=True)`` as before:
compiled at its first call, then loaded from numba's cache (``neardup.kernel_cache``).
Both run the same source, so they give the same results.

Environment variables read: ``NEARDUP_KERNELS`` (``jit``: numba's just-in-time compiler
whatever is installed).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

_PACKAGE = Path(__file__).resolve().parent.parent

#: The modules that declare kernels, in the order they are compiled.
KERNEL_MODULES = ("neardup.core.xxh3", "neardup.core.oph", "neardup.core.candidates",
                  "neardup.core.overlap", "neardup.core.decide", "neardup.core.cluster",
                  "neardup.core.unionfind", "neardup.state.index", "neardup.state.setcache")

#: Bumped when the way kernels are exported changes (symbols, signatures' form).
_FORMAT = 1


class Export(NamedTuple):
    """A kernel that Python calls: its module, name, numba signature and Python function."""

    module: str
    name: str
    signature: str
    function: Callable[..., Any]

    @property
    def symbol(self) -> str:
        """Its name in the extension module: ``core_xxh3___hash_spans`` for
        ``neardup.core.xxh3._hash_spans``."""
        return self.module.removeprefix("neardup.").replace(".", "_") + "__" + self.name


#: Every kernel declared with a signature so far, in declaration order.
EXPORTS: list[Export] = []


def source_digest(package: Path = _PACKAGE) -> int:
    """A 63-bit digest of the kernel modules' sources under ``package`` (the ``neardup``
    folder; this one by default) and of this module's export format: the build stores it in
    the extension, and a process uses the extension only when the sources it runs give the
    same digest.

    Raises:
        OSError: a kernel module's file cannot be read.
    """
    return digest63(str(_FORMAT).encode(), *((package / Path(*name.split(".")[1:])).with_suffix(".py").read_bytes()
                                             for name in KERNEL_MODULES))


def digest63(*parts: bytes) -> int:
    """The first 63 bits of the sha256 of ``parts`` one after the other (a positive int64,
    what a built kernel returns)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def _load() -> Any | None:
    """The built extension when it is there and current, else None (numba's JIT then)."""
    if os.environ.get("NEARDUP_KERNELS", "").lower() == "jit":
        return None
    try:
        module = importlib.import_module("neardup._kernels")
        return module if int(module.source_digest()) == source_digest() else None
    except (ImportError, AttributeError, OSError):
        return None


_BUILT = _load()


def ahead_of_time() -> bool:
    """Whether this process runs the kernels built at install (no numba, no compiling)."""
    return _BUILT is not None


class _Lazy:
    """A kernel that only other kernels call, in a process that runs the built extension.
    Never compiled, unless Python calls it itself (a test does): then every such kernel
    is handed to numba at once (:func:`_compile_helpers`), since one calls others."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.py_func = function
        self.compiled: Callable[..., Any] | None = None
        self.__name__ = function.__name__
        self.__doc__ = function.__doc__

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            _compile_helpers()
        assert self.compiled is not None
        return self.compiled(*args)


def _compile_helpers() -> None:
    """Replace every :class:`_Lazy` kernel, in every kernel module's namespace (its own
    and those that import it), by ``numba.njit`` of its function: numba resolves a
    kernel's calls through its module's globals, which must be numba functions then."""
    from numba import njit  # noqa: PLC0415 - only when Python calls a helper

    for name in KERNEL_MODULES:
        namespace = vars(importlib.import_module(name))
        for key, value in list(namespace.items()):
            if isinstance(value, _Lazy):
                if value.compiled is None:
                    value.compiled = njit(nogil=True, cache=True)(value.py_func)
                namespace[key] = value.compiled


def kernel(arg: str | Callable[..., Any]) -> Any:
    """Declare a kernel: ``@kernel`` for one only other kernels call, ``@kernel("sig")``
    for one Python calls, with its numba signature (the one and only: callers pass exactly
    these types, C-contiguous arrays).

    Returns the built extension's function when the process runs it, else
    ``numba.njit(nogil=True, cache=True)`` of the function.
    """
    if callable(arg):
        return _declare(arg, None)
    return lambda function: _declare(function, arg)


def _declare(function: Callable[..., Any], signature: str | None) -> Any:
    if signature is not None:
        export = Export(function.__module__, function.__name__, signature, function)
        EXPORTS.append(export)
        if _BUILT is not None:
            return _Built(getattr(_BUILT, export.symbol), function, signature)
    if _BUILT is not None:
        return _Lazy(function)
    from numba import njit  # noqa: PLC0415 - numba only where the kernels are not built

    return njit(nogil=True, cache=True)(function)


class _Built:
    """A kernel that Python calls, in a process that runs the built extension: its built
    function for a call of the declared types, numba's JIT for any other.

    The built function does not check what it is given: an array of another dtype,
    dimension or layout (a strided view) would be read as the declared one (wrong values,
    or a crash past its end). So every call's arrays are checked first (dtype, ndim,
    C-contiguous, writeable as declared) and its scalars' kinds; a call that does not fit
    is compiled and run by numba for its own types, as without the build, and logged once.
    ``fallbacks`` counts those calls.
    """

    def __init__(self, built: Callable[..., Any], function: Callable[..., Any], signature: str) -> None:
        self.built = built
        self.py_func = function
        self.__name__ = function.__name__
        self.__doc__ = function.__doc__
        self._args = _argument_checks(signature)
        self._jit: Callable[..., Any] | None = None
        self.fallbacks = 0

    def __call__(self, *args: Any) -> Any:
        if len(args) == len(self._args) and all(fits(a) for fits, a in zip(self._args, args)):
            return self.built(*args)
        return self._fallback(args)

    def _fallback(self, args: tuple[Any, ...]) -> Any:
        if self._jit is None:
            import logging  # noqa: PLC0415

            from numba import njit  # noqa: PLC0415 - only for a call the build does not take

            logging.getLogger(__name__).warning(
                "kernel %s.%s called with other types than it was built for (%s): compiled by numba",
                self.py_func.__module__, self.__name__,
                ", ".join(f"{a.dtype}[{a.ndim}d]" if isinstance(a, np.ndarray) else type(a).__name__ for a in args))
            _compile_helpers()
            self._jit = njit(nogil=True, cache=True)(self.py_func)
        self.fallbacks += 1
        return self._jit(*args)


#: numba's names of the scalar types in the signatures, and what Python passes for them.
_SCALARS: dict[str, tuple[type, ...]] = {
    "int64": (int, np.integer), "uint64": (int, np.integer), "float64": (float, int, np.floating, np.integer),
    "boolean": (bool, np.bool_),
}


def _argument_checks(signature: str) -> list[Callable[[Any], bool]]:
    """One test per argument of a numba signature string ``"ret(arg, ...)"`` as the kernels
    here write them: ``dtype[::1]``, ``dtype[:, ::1]``, ``Array(dtype, ndim, 'C',
    readonly=True)`` and the scalars of ``_SCALARS``.

    Raises:
        ValueError: a type not of those forms.
    """
    depth, start = 0, len(signature) - 1
    for start in range(len(signature) - 1, -1, -1):  # the last top-level "(...)": the arguments
        depth += {")": 1, "(": -1}.get(signature[start], 0)
        if depth == 0:
            break
    parts, depth, begin = [], 0, start + 1
    for i, c in enumerate(signature[start + 1:-1], start + 1):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(signature[begin:i].strip())
            begin = i + 1
    parts.append(signature[begin:-1].strip())
    checks: list[Callable[[Any], bool]] = []
    for part in parts:
        array = re.fullmatch(r"(\w+)\[([:, 1]+)\]", part)
        declared = re.fullmatch(r"Array\((\w+), (\d), 'C', readonly=True\)", part)
        if array or declared:
            name = (array or declared).group(1)  # type: ignore[union-attr]
            dtype = np.dtype("bool" if name == "boolean" else name)
            ndim = array.group(2).count(",") + 1 if array else int(declared.group(2))  # type: ignore[union-attr]
            writeable = declared is None
            checks.append(lambda a, dtype=dtype, ndim=ndim, writeable=writeable: (
                isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == ndim and a.flags.c_contiguous
                and a.flags.writeable == writeable))
        elif part in _SCALARS:
            checks.append(lambda a, kinds=_SCALARS[part]: isinstance(a, kinds))
        else:
            raise ValueError(f"a kernel argument type not handled here: {part!r} in {signature!r}")
    return checks
