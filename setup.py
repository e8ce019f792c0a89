"""Builds neardup's compiled kernels ahead of time, into the extension module
``neardup._kernels`` (numba's ahead-of-time compiler; ``neardup.core.aot``). Everything
else about the package is in ``pyproject.toml``.

The install never fails for the kernels: if they cannot be built here (no C compiler, a
numba that cannot compile for this Python), it says so and neardup compiles them with
numba's just-in-time compiler at its first run instead, as a source checkout does.
"""

import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))


def kernel_extensions() -> list:
    try:
        from neardup.build_kernels import aot_compiler

        return [aot_compiler().distutils_extension()]
    except Exception as error:  # noqa: BLE001 - any failure leaves the JIT path
        print(f"neardup: kernels not compiled ahead of time ({error}); "
              "they compile at the first run instead", file=sys.stderr)
        return []


extensions = kernel_extensions()

# After the extension is made: numba.pycc swaps its own build_ext into setuptools then.
from setuptools.command.build_ext import build_ext  # noqa: E402


class BuildKernels(build_ext):
    """``build_ext`` whose failure is a warning: the kernels then compile at run."""

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001
            print(f"neardup: kernels not compiled ahead of time ({error}); "
                  "they compile at the first run instead", file=sys.stderr)


setup(ext_modules=extensions, cmdclass={"build_ext": BuildKernels})
