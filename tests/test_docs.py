"""The documentation: README.md and the pages of docs/, held to what the code does.

- Every command block (```sh, ```bash) of a page runs as written, the page's blocks in
  order in one scratch directory (the checkout's ``tests`` and ``deploy`` linked into
  it), and exits 0 without a traceback. ``pip`` stands for the install already made from
  this checkout (installing over it would change the environment of every other test).
  A block that calls ``kafka.sh`` starts its own broker, with a broker home of its own
  (the fetched jars linked) so that its ``kafka.sh stop`` stops that broker only; a page
  that uses ``$BOOTSTRAP`` without setting it gets the tests' broker there.
- A ```console block is a transcript: each ``$ command`` is run, and the lines shown
  after it must appear in its output, in that order (lines may be left out).
- A block not meant to run is marked by the line just before it,
  ``<!-- no-run: why -->``; there are few, and each says why.
- Every ```toml block is a valid settings file (``neardup.config.read_toml``).
- ``mkdocs build --strict`` builds the site (broken links and anchors, pages left out of
  the nav, fail it).
- docs/cli.md and docs/metrics.md are what ``python -m neardup.docs_reference`` generates
  from the parser and the metrics registries.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import KAFKA_SH, REPO_ROOT

from neardup import docs_reference
from neardup.config import read_toml

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
RUNNABLE = {"sh", "bash", "shell"}
MOST_NOT_RUN = 6
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NO_RUN = re.compile(r"^<!-- no-run: (\S.*?) -->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    no_run: str | None  # the reason, when marked

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = "\n".join(line[len(indent):] for line in lines[i + 1:end]) + "\n"
        before = lines[i - 1] if i else ""
        marker = NO_RUN.match(before)
        found.append(Block(path, i + 1, lang, body, marker.group(1) if marker else None))
        i = end + 1
    return found


def _pages_with_commands() -> list[Path]:
    return [p for p in PAGES if any(b.lang in RUNNABLE | {"console"} and not b.no_run for b in blocks(p))]


def _scratch(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory that looks like the checkout to a command, and the environment."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("tests", "deploy"):
        (work / name).symlink_to(REPO_ROOT / name)
    home = tmp_path / "kafka-home"
    home.mkdir()
    cache = Path(os.environ.get("NEARDUP_KAFKA_HOME") or REPO_ROOT / ".cache" / "kafka")
    (home / "libs").symlink_to(cache / "libs")
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "pip").write_text("#!/bin/sh\necho 'pip: neardup is installed from this checkout'\n")
    (shims / "pip").chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "NEARDUP_KAFKA_HOME": str(home),
           "PYTHONPATH": str(REPO_ROOT / "src")}
    env.pop("NEARDUP_KAFKA_BOOTSTRAP", None)
    return work, env


def _run(script: str, work: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _transcript(block: Block) -> list[tuple[str, list[str]]]:
    """A console block as (command, the output lines shown after it)."""
    steps: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
        else:
            raise AssertionError(f"{block}: a console block starts with '$ command'")
    return steps


def _in_order(shown: list[str], output: str) -> bool:
    lines = iter(output.splitlines())
    return all(any(line.rstrip() == want.rstrip() for line in lines) for want in shown if want.strip())


@pytest.mark.parametrize("page", _pages_with_commands(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_command_blocks_run_as_written(page: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    todo = [b for b in blocks(page) if b.lang in RUNNABLE | {"console"} and not b.no_run]
    uses_broker = any("kafka.sh" in b.text for b in todo)
    needs_broker = any("$BOOTSTRAP" in b.text for b in todo) and not any("BOOTSTRAP=" in b.text for b in todo)
    if uses_broker or needs_broker:
        bootstrap = request.getfixturevalue("kafka_bootstrap")  # and the jars are fetched
    work, env = _scratch(tmp_path)
    if needs_broker:
        env["BOOTSTRAP"] = bootstrap
    outputs: dict[Block, str] = {}
    try:
        for block in todo:
            if block.lang == "console":
                for command, shown in _transcript(block):
                    done = _run(command, work, env)
                    assert done.returncode == 0, f"{block}: $ {command}\n{done.stderr[-3000:]}"
                    assert _in_order(shown, done.stdout), f"{block}: $ {command} printed\n{done.stdout[-3000:]}"
                continue
            done = _run(block.text, work, env)
            assert done.returncode == 0, f"{block} exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            assert "Traceback" not in done.stderr, f"{block}\n{done.stderr[-3000:]}"
            outputs[block] = done.stdout
    finally:
        if uses_broker:
            subprocess.run(["bash", str(KAFKA_SH), "stop"], env=env, capture_output=True, timeout=120)
    if page == README:
        # the main job: real newswire deduplicated, the outputs written
        assert (work / "out" / "unique.jsonl").stat().st_size > 0
        assert (work / "out" / "duplicates.jsonl").stat().st_size > 0
        # the Kafka walk: every verdict of the excerpt read back, its duplicates printed
        [walk] = [out for b, out in outputs.items() if "kafka.sh start" in b.text and "neardup run" in b.text]
        assert "4000 verdicts read" in walk, walk[-2000:]
        assert len([line for line in walk.splitlines() if " duplicate of " in line]) >= 50, walk[-2000:]


def test_a_console_transcript_that_differs_from_the_output_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```console\n$ neardup params --threshold 0.8 --num-perm 128\nbands 20  rows 6\n```\n")
    [block] = blocks(page)
    [(command, shown)] = _transcript(block)
    done = _run(command, *_scratch(tmp_path))
    assert done.returncode == 0, done.stderr
    assert not _in_order(shown, done.stdout)
    assert _in_order(["bands 32  rows 4  (uses 128 of 128 slots), tuned for similarity 0.55"], done.stdout)


def test_blocks_not_run_are_few_and_say_why() -> None:
    marked = [b for p in PAGES for b in blocks(p) if b.no_run]
    assert len(marked) <= MOST_NOT_RUN, [str(b) for b in marked]
    for block in marked:
        assert block.lang in RUNNABLE, f"{block}: only a command block needs a no-run mark"
        assert len(block.no_run.split()) >= 3, f"{block}: say why it is not run"
    # a mark must sit just before its block, or it marks nothing
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert text.count("<!-- no-run:") == sum(1 for b in blocks(page) if b.no_run), page


def test_toml_blocks_are_valid_settings_files(tmp_path: Path) -> None:
    tomls = [b for p in PAGES for b in blocks(p) if b.lang == "toml"]
    assert tomls
    for i, block in enumerate(tomls):
        path = tmp_path / f"{i}.toml"
        path.write_text(block.text)
        assert read_toml(path), block


def _words(command: str) -> list[str]:
    return shlex.split(command)


def test_the_readme_test_command_is_what_ci_runs() -> None:
    [block] = [b for b in blocks(README) if b.lang in RUNNABLE and "pytest" in b.text]
    ci = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    simple = [c.strip(" ()") for c in re.split(r"&&|\|\||\(|\)", block.text.strip()) if c.strip(" ()")]
    assert any(c.startswith("pytest") for c in simple) and any("pip install" in c for c in simple)
    for command in simple:
        want = _words(command)

        def has(line: str, want: list[str] = want) -> bool:
            words = iter(_words(line.split("#")[0]) if not line.lstrip().startswith("#") else [])
            return all(any(w == got for got in words) for w in want)

        assert any(has(line) for line in ci), f".ci/run does not run {command!r} of README.md"


def test_readme_links_resolve() -> None:
    for readme in (README, REPO_ROOT / "deploy" / "README.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (readme.parent / target).exists(), f"{readme.relative_to(REPO_ROOT)}: {target}"


def test_mkdocs_builds_the_site_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO_ROOT / "mkdocs.yml"),
                           "-d", str(site)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for page in DOCS.glob("*.md"):
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), f"{page.name} is not in the site"


def test_reference_pages_are_generated_from_the_parser_and_registry() -> None:
    assert docs_reference.main(["--check", "--docs-dir", str(DOCS)]) == 0, "run python -m neardup.docs_reference"
    assert (DOCS / "cli.md").read_text() == docs_reference.cli_page()
    # every flag of every command is on the page
    page = (DOCS / "cli.md").read_text()
    for flag in ("--threshold", "--retention-documents", "--topic-replication-factor", "--reorder-window-ms", "-X"):
        assert f"`{flag}`" in page
    assert "`neardup_dead_letter_total`" in (DOCS / "metrics.md").read_text()


def test_the_reference_check_fails_on_a_page_that_drifted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert docs_reference.main(["--docs-dir", str(tmp_path)]) == 0
    assert docs_reference.main(["--check", "--docs-dir", str(tmp_path)]) == 0
    metrics = tmp_path / "metrics.md"
    metrics.write_text(metrics.read_text().replace("| `neardup_replayed_total` |", "| `neardup_replays_total` |"))
    assert docs_reference.main(["--check", "--docs-dir", str(tmp_path)]) == 1
    assert "metrics.md" in capsys.readouterr().err
