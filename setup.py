"""Builds neardup's compiled kernels ahead of time, into the extension module
``neardup._kernels`` (numba's ahead-of-time compiler; ``neardup.core.aot``). Everything
else about the package is in ``pyproject.toml``.

The install never fails for the kernels: if they cannot be built here (no C compiler, a
numba that cannot compile for this Python), it says so and neardup compiles them with
numba's just-in-time compiler at its first run instead, as a source checkout does.
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

SRC = Path(__file__).resolve().parent / "src"
sys.path.insert(0, str(SRC))


def _not_built(error: Exception) -> None:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    print(f"neardup: kernels not compiled ahead of time ({reason}); they compile at the first run instead",
          file=sys.stderr)


def kernel_extensions() -> list:
    try:
        from neardup.build_kernels import aot_compiler

        return [aot_compiler().distutils_extension()]
    except Exception as error:  # noqa: BLE001 - any failure leaves the JIT path
        _not_built(error)
        return []


extensions = kernel_extensions()

# After the extension is made: numba.pycc swaps its own build_ext into setuptools then.
from setuptools.command.build_ext import build_ext  # noqa: E402


def _built_from_these_sources(path: str) -> bool:
    """Whether the extension at ``path`` was built from the kernel sources here and for the
    same CPU (its ``source_digest()`` and ``target_digest()``): a rebuild is then skipped."""
    import importlib.util

    from neardup.build_kernels import target_cpu, target_digest
    from neardup.core.aot import source_digest

    try:
        spec = importlib.util.spec_from_file_location("neardup._kernels", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return (int(module.source_digest()) == source_digest()
                and int(module.target_digest()) == target_digest(target_cpu()))
    except Exception:  # noqa: BLE001 - missing, or not loadable: build it
        return False


class BuildKernels(build_ext):
    """``build_ext`` that keeps an extension built from the same kernel sources, and whose
    failure is a warning: the kernels then compile at run."""

    def build_extension(self, ext) -> None:
        target = self.get_ext_fullpath(ext.name)
        # the build folder's copy, or the source tree's that an editable install made
        for built in (target, str(SRC / "neardup" / os.path.basename(target))):
            if _built_from_these_sources(built):
                print(f"neardup: kernels up to date in {built}", file=sys.stderr)
                if built != target:
                    # a new file renamed over the target: the target may be mapped in this
                    # process (loaded above to read its digests), and a library rewritten in
                    # place under its mapping crashes the process (SIGSEGV, seen)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.copyfile(built, target + ".tmp")
                    os.replace(target + ".tmp", target)
                return
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001
            _not_built(error)


setup(ext_modules=extensions, cmdclass={"build_ext": BuildKernels})
