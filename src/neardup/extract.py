"""The main text of an HTML page, without its navigation, related links and footer.

A site's boilerplate repeats on all its pages and is often longer than a page's own
text, so that two pages of one site look like near-duplicates whatever they say. With
``--text-format html`` the text a record gives (its text fields, or the whole Kafka
value) is read as HTML and only its main content is deduplicated.

The extractor is Resiliparse's ``extract_plain_text(html, main_content=True)``
(Bevendorff et al., "Elastic ChatNoir: Search Engine for the ClueWeb and the Common
Crawl", ECIR 2018; the library of the ChatNoir web archive tools), chosen over
trafilatura for being 20 to 50 times as fast on the same pages (trafilatura with
``fast=True``, and with its defaults) at the same detection quality, and for its
smaller footprint (``benchmarks/html_extraction.py``). It is in the optional ``html`` extra:
``pip install 'neardup[html]'``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Literal

TextFormat = Literal["plain", "html"]
TEXT_FORMATS: tuple[TextFormat, ...] = ("plain", "html")
#: The extra that installs the extractor.
EXTRA = "html"


class ExtraMissing(ValueError):
    """The ``html`` extra is not installed; ``str(error)`` says how to install it."""


@cache
def _extractor() -> Callable[..., str]:
    try:
        from resiliparse.extract.html2text import extract_plain_text
    except ImportError as exc:
        raise ExtraMissing(
            f"--text-format html needs the {EXTRA} extra: pip install 'neardup[{EXTRA}]' ({exc})"
        ) from None
    return extract_plain_text


def require_extractor() -> None:
    """Check, before any record is read, that the extractor can be imported.

    Raises:
        ExtraMissing: the ``html`` extra is not installed (a one-line message naming it).
    """
    _extractor()


def main_text(page: str) -> str:
    """The main content of the HTML ``page`` as plain text: paragraphs separated by
    blank lines, leading and trailing white space stripped; the empty string when the
    page holds none (no markup, an empty body, boilerplate only).

    Navigation, headers, footers, asides, forms and link lists are left out by
    Resiliparse's main-content heuristics (``main_content=True``); alt texts and
    ``<noscript>`` are not kept.

    Raises:
        ExtraMissing: the ``html`` extra is not installed.
    """
    return _extractor()(page, main_content=True, alt_texts=False, noscript=False).strip()
