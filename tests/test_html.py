"""--text-format html: the main text of web pages is deduplicated, not their boilerplate.

The pages are ``neardup.sitepages`` renderings of Reuters stories into four site
templates, some stories on several sites: without extraction pages of one template are
flagged as duplicates of each other; with it, only pages of one story are.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from kafka_util import create_topic, excerpt, produce, read_all, start_run, stop, wait_committed

from neardup.cli import main
from neardup.core.types import Document
from neardup.extract import main_text
from neardup.kafka.messages import MessageError, to_document
from neardup.records import NoMainText, RecordError, record_text
from neardup.sitepages import SITES, distinct_stories, site_pages

#: A page of one site's template whose article holds nothing: menus, links, footer.
EMPTY_PAGE = ('<html><body><nav><ul><li><a href="/a">World</a></li><li><a href="/b">Business</a></li></ul></nav>'
              '<footer><a href="/terms">Terms of use</a> <a href="/privacy">Privacy policy</a></footer></body></html>')


def _pages(n_stories: int, seed: int = 1):
    records = [r for r in excerpt(400) if len(r["text"]) >= 400]
    kept = {d.id for d in distinct_stories([Document(str(r["id"]), r["text"]) for r in records])}
    records = [r for r in records if str(r["id"]) in kept][:n_stories]
    return records, site_pages([Document(str(r["id"]), r["text"]) for r in records],
                               [r["title"] for r in records], seed=seed)


def test_pages_are_deterministic_and_some_stories_are_on_several_sites():
    _, a = _pages(30)
    _, b = _pages(30)
    assert [p.html for p in a] == [p.html for p in b]
    per_story = defaultdict(set)
    for p in a:
        per_story[p.story].add(p.site)
    assert any(len(s) > 1 for s in per_story.values()) and any(len(s) == 1 for s in per_story.values())
    assert {p.site for p in a} == {s.host for s in SITES}


def test_main_text_keeps_the_story_and_drops_the_template():
    records, pages = _pages(5)
    page = pages[0]
    record = next(r for r in records if str(r["id"]) == page.story)
    text = main_text(page.html)
    body_words = record["text"][len(record["title"]) + 1:].split()
    assert " ".join(body_words[:12]) in " ".join(text.split())
    assert " ".join(body_words[-8:]) in " ".join(text.split())
    site = next(s for s in SITES if s.host == page.site)
    for boilerplate in (site.legal[:60], "We use cookies", "Most read", "Related stories", "Our network",
                        "__NEXT_DATA__", "Get the"):
        assert boilerplate not in text, boilerplate
    assert len(text) < len(page.html) / 10


def test_record_text_of_html_fields():
    _, pages = _pages(3)
    record = {"html": pages[0].html, "extra": EMPTY_PAGE}
    assert record_text(record, ["html"], "html") == main_text(pages[0].html)
    # fields whose page holds no main text are left out; none: refused, saying why
    assert record_text(record, ["extra", "html"], "html") == main_text(pages[0].html)
    with pytest.raises(NoMainText, match="no main text in the HTML of field 'extra'"):
        record_text(record, ["extra"], "html")
    assert isinstance(NoMainText("x"), RecordError)
    # plain: the markup is the text
    assert record_text(record, ["html"]) == pages[0].html


def test_to_document_extracts_whole_values_and_json_fields():
    _, pages = _pages(3)
    html = pages[0].html.encode()
    doc = to_document(html, b"k", "t", 0, 7, None, None, 1 << 20, "html")
    assert doc.id == "k" and doc.text == main_text(pages[0].html)
    doc = to_document(json.dumps({"id": "a", "page": pages[0].html}).encode(), None, "t", 0, 7, ["page"], "id",
                      1 << 20, "html")
    assert doc.id == "a" and doc.text == main_text(pages[0].html)
    assert to_document(html, b"k", "t", 0, 7, None, None, 1 << 20).text == pages[0].html
    for value, fields in ((EMPTY_PAGE.encode(), None), (b"", None),
                          (json.dumps({"page": EMPTY_PAGE}).encode(), ["page"])):
        with pytest.raises(MessageError, match="no main text in the HTML") as info:
            to_document(value, b"k", "t", 0, 7, fields, None, 1 << 20, "html")
        assert info.value.kind == "empty_text"


def _flagged_pairs(out_dir: Path) -> set[frozenset[str]]:
    members = defaultdict(list)
    for name in ("unique.jsonl", "duplicates.jsonl"):
        for line in (out_dir / name).read_text().splitlines():
            entry = json.loads(line)["neardup"]
            members[entry["cluster"]].append(entry["id"])
    return {frozenset(p) for ids in members.values() for p in itertools.combinations(ids, 2)}


def test_dedup_flags_template_pages_without_extraction_and_same_stories_with_it(tmp_path, capsys):
    """``neardup dedup --text-field html --text-format html`` on pages of 60 stories: every
    pair of pages of one story is flagged, and no other; the same pages deduplicated as
    text flag pages of one site holding different stories."""
    _, pages = _pages(60)
    corpus = tmp_path / "pages.jsonl"
    lines = [json.dumps({"id": p.id, "html": p.html}) for p in pages]
    lines.insert(len(lines) // 2, json.dumps({"id": "empty@example", "html": EMPTY_PAGE}))
    corpus.write_text("\n".join(lines) + "\n")
    by_story = defaultdict(list)
    for p in pages:
        by_story[p.story].append(p.id)
    truth = {frozenset(pair) for ids in by_story.values() for pair in itertools.combinations(ids, 2)}
    assert len(truth) >= 20
    site = {p.id: p.site for p in pages}
    story = {p.id: p.story for p in pages}

    assert main(["dedup", str(corpus), "--out-dir", str(tmp_path / "plain"), "--text-field", "html",
                 "--no-pipeline"]) == 0
    plain = _flagged_pairs(tmp_path / "plain") - {p for p in _flagged_pairs(tmp_path / "plain") if "empty@example" in p}
    template = {p for p in plain if len({story[i] for i in p}) == 2 and len({site[i] for i in p}) == 1}
    assert len(template) > 5 * len(truth)  # a site's pages look alike whatever their stories
    assert len(plain & truth) < len(truth) / 2  # a story on two sites does not

    assert main(["dedup", str(corpus), "--out-dir", str(tmp_path / "html"), "--text-field", "html",
                 "--text-format", "html", "--no-pipeline"]) == 0
    assert _flagged_pairs(tmp_path / "html") == truth
    rejects = [json.loads(line) for line in (tmp_path / "html" / "rejects.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejects] == [len(pages) // 2 + 1]
    assert json.loads(rejects[0]["raw"])["id"] == "empty@example"
    assert "no main text in the HTML of field 'html'" in rejects[0]["reason"]
    assert "1 of" in capsys.readouterr().err


def test_a_page_holding_a_lone_surrogate_is_rejected(tmp_path):
    """A ``\\ud800`` escape (read by json, not by orjson) is no Unicode text to parse:
    the line is rejected, saying so, and the others are deduplicated."""
    corpus = tmp_path / "pages.jsonl"
    corpus.write_text('{"id": 1, "html": "<p>bad \\ud800 text</p>"}\n'
                      '{"id": 2, "html": "<p>a page of some words</p>"}\n')
    assert main(["dedup", str(corpus), "--out-dir", str(tmp_path / "out"), "--text-field", "html",
                 "--text-format", "html", "--no-pipeline"]) == 0
    [reject] = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert reject["line"] == 1 and "lone surrogate" in reject["reason"]
    [unique] = [json.loads(line) for line in (tmp_path / "out" / "unique.jsonl").read_text().splitlines()]
    assert unique["id"] == 2


def test_missing_extra_is_one_line_naming_it(tmp_path):
    """Without the html extra (its import made to fail), dedup and run stop with one line
    naming the extra, before reading anything."""
    corpus = tmp_path / "pages.jsonl"
    corpus.write_text(json.dumps({"id": 1, "text": "<p>Some words here</p>"}) + "\n")
    blocked = ("import sys; sys.modules['resiliparse'] = None; "
               "from neardup.cli import main; sys.exit(main(sys.argv[1:]))")
    for args in (["dedup", str(corpus), "--out-dir", str(tmp_path / "out"), "--text-format", "html"],
                 ["run", "--bootstrap-servers", "127.0.0.1:1", "--input-topic", "t", "--text-format", "html",
                  "--state-dir", str(tmp_path / "state"), "--metrics-port", "0"]):
        proc = subprocess.run([sys.executable, "-c", blocked, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            proc.stderr.strip().splitlines()[0]], proc.stderr
        assert proc.stderr.startswith("neardup: error: --text-format html needs the html extra: "
                                      "pip install 'neardup[html]'"), proc.stderr
        assert not (tmp_path / "out" / "unique.jsonl").exists()


def test_stage_refuses_html_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NEARDUP_TEXT_FORMAT", "html")
    assert main(["stage", "prepare", "--bootstrap-servers", "127.0.0.1:1", "--input-topic", "t"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("neardup: error: neardup stage reads plain text only (--text-format html): "
                   "extract the pages' main text before the input topic, or use neardup run")


def test_text_format_setting_from_toml_and_environment(tmp_path, monkeypatch):
    from neardup.config import load_settings

    toml = tmp_path / "neardup.toml"
    toml.write_text('text_format = "html"\n')
    assert load_settings({}, toml).text_format == "html"
    monkeypatch.setenv("NEARDUP_TEXT_FORMAT", "plain")
    assert load_settings({}, toml).text_format == "plain"
    assert load_settings({}).text_format == "plain"


def test_run_dedups_whole_value_html(kafka_bootstrap, tmp_path):
    """``neardup run --text-format html`` on whole-value pages: pages of one story are
    duplicates of the first, every other page unique, and a page with no main text a
    dead letter saying so."""
    _, pages = _pages(25)
    topic = create_topic(kafka_bootstrap, f"html-{uuid.uuid4().hex[:12]}", {"max.message.bytes": str(4 << 20)})
    messages = [(p.id.encode(), p.html.encode()) for p in pages]
    messages.insert(3, (b"empty@example", EMPTY_PAGE.encode()))
    produce(kafka_bootstrap, topic, messages, max_bytes=4 << 20)
    log = tmp_path / "run.log"
    proc = start_run(kafka_bootstrap, topic, f"g-{topic}", tmp_path / "state", "--text-format", "html", log=log)
    try:
        wait_committed(kafka_bootstrap, f"g-{topic}", topic, len(messages), proc, log=log)
    finally:
        assert stop(proc) == 0
    outs = read_all(kafka_bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"],
                    expected=len(messages))
    by_key = {o.key.decode(): o for o in outs}
    assert len(outs) == len(messages) == len(by_key)
    dead = by_key.pop("empty@example")
    assert dead.topic == f"{topic}.dlq"
    assert b"no main text in the HTML value" in dead.headers["neardup-error"]
    first = {}
    for p in pages:  # in input order: a story's first page is unique, the others its duplicates
        o = by_key[p.id]
        if p.story not in first:
            first[p.story] = p.id
            assert o.topic == f"{topic}.unique", p.id
        else:
            assert o.topic == f"{topic}.duplicates", p.id
            assert o.headers["neardup-cluster"] == first[p.story].encode()
    assert len(first) < len(pages)
