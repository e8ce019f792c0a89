"""The kernels built ahead of time at install (``neardup.core.aot``, ``setup.py``): used
when current, the very functions numba's JIT compiles, the same outputs, no numba import."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from neardup.core import aot

DATA = Path(__file__).resolve().parent / "data" / "reuters_excerpt.jsonl.gz"
PACKAGE = Path(aot.__file__).resolve().parent.parent


def _python(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_install_built_the_kernels_and_a_run_never_imports_numba(tmp_path: Path) -> None:
    """`pip install` compiled the kernels (the test command installs the package so): this
    process runs them, and a whole `neardup dedup` runs without importing numba."""
    assert aot.ahead_of_time(), "neardup._kernels is missing or stale: the install did not build it"
    stories = tmp_path / "in.jsonl"
    with gzip.open(DATA, "rt") as f:
        stories.write_text("".join(f.readlines()[:50]))
    out = _python(
        "import sys; from neardup.cli import main\n"
        f"code = main(['dedup', {str(stories)!r}, '--out-dir', {str(tmp_path / 'out')!r}, '--no-progress'])\n"
        "print(code, sorted(m for m in sys.modules if m.split('.')[0] == 'numba'))")
    assert out.split("\n")[-2] == "0 []", out


def test_each_built_kernel_has_the_one_signature_the_jit_compiles_from_the_engine_s_calls() -> None:
    """Every variant of the engine (neardup.build_kernels.WARM_VARIANTS) run under numba's
    JIT compiles each exported kernel for exactly its declared signature and no other: the
    built kernels take every call the engine makes."""
    out = _python(
        "import importlib, json\n"
        "from neardup.build_kernels import warm\n"
        "from neardup.core import aot\n"
        "from numba.core import sigutils\n"
        "warm()\n"
        "rows = []\n"
        "for e in aot.EXPORTS:\n"
        "    compiled = getattr(importlib.import_module(e.module), e.name)\n"
        "    args, _ = sigutils.normalize_signature(e.signature)\n"
        "    rows.append([e.module, e.name, [str(s) for s in compiled.signatures], str(tuple(args))])\n"
        "print(json.dumps(rows))",
        NEARDUP_KERNELS="jit")
    rows = json.loads(out.strip().splitlines()[-1])
    assert len(rows) == 14, rows
    for module, name, compiled, declared in rows:
        assert compiled == [declared], f"{module}.{name}: compiled for {compiled}, declared {declared}"


def test_built_and_jit_kernels_give_the_same_outputs(tmp_path: Path) -> None:
    stories = tmp_path / "in.jsonl"
    with gzip.open(DATA, "rt") as f:
        stories.write_text(f.read())
    outputs = {}
    for mode in ("built", "jit"):
        out = tmp_path / mode
        env = {"NEARDUP_KERNELS": "jit"} if mode == "jit" else {}
        _python("from neardup.cli import main\n"
                f"assert main(['dedup', {str(stories)!r}, '--out-dir', {str(out)!r}, '--no-progress', "
                "'--measure', 'containment', '--cluster-policy', 'components']) == 0", **env)
        outputs[mode] = {name: (out / name).read_bytes() for name in ("unique.jsonl", "duplicates.jsonl")}
    assert outputs["built"]["duplicates.jsonl"], "no duplicate found: the comparison says little"
    assert outputs["built"] == outputs["jit"]


def test_a_kernel_source_edited_after_the_build_is_compiled_by_numba(tmp_path: Path) -> None:
    """The extension carries the digest of the kernel sources it was built from; sources
    that differ (a kernel edited in a source checkout) give another digest, so the process
    compiles them with numba instead of running the stale build."""
    copy = tmp_path / "neardup"
    for name in aot.KERNEL_MODULES:
        source = PACKAGE / Path(*name.split(".")[1:]).with_suffix(".py")
        target = copy / source.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, target)
    assert aot.source_digest(copy) == aot.source_digest()
    oph = copy / "core" / "oph.py"
    oph.write_text(oph.read_text() + "\n# edited\n")
    assert aot.source_digest(copy) != aot.source_digest()


def test_neardup_kernels_jit_chooses_numba_whatever_is_installed() -> None:
    out = _python("import sys\n"
                  "from neardup.core import aot, xxh3\n"
                  "print(aot.ahead_of_time(), type(xxh3._hash_spans).__name__, 'numba' in sys.modules)",
                  NEARDUP_KERNELS="jit")
    assert out.split() == ["False", "CPUDispatcher", "True"]


def test_a_call_of_other_types_than_built_for_is_run_by_numba_and_right() -> None:
    """The built function reads what it is given as the declared types, unchecked: a
    strided view gave wrong hashes, int32 offsets crashed the process. Such a call goes to
    numba's JIT instead, with the right values, and is counted."""
    out = _python(
        "import numpy as np, xxhash\n"
        "from neardup.core import xxh3\n"
        "data = np.frombuffer(bytes(range(40)), dtype=np.uint8)\n"
        "edges = np.arange(0, 40, 5, dtype=np.int64)\n"
        "want = [xxhash.xxh3_64_intdigest(bytes(data[a:b])) for a, b in zip(edges[0::2], edges[1::2])]\n"
        "strided = xxh3._hash_spans(data, edges[0::2], edges[1::2]).tolist()\n"
        "narrow = xxh3._hash_spans(data, edges[0::2].astype(np.int32), edges[1::2].astype(np.int32)).tolist()\n"
        "print(strided == want, narrow == want, xxh3._hash_spans.fallbacks)\n"
        "print(xxh3._hash_spans.built(data, edges[0::2].copy(), edges[1::2].copy()).tolist() == want)")
    assert out.split() == ["True", "True", "2", "True"], out
