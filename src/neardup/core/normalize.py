"""Text normalisation applied before shingling."""

from __future__ import annotations

import sys
import unicodedata
from dataclasses import asdict, dataclass
from functools import cache


@dataclass(frozen=True)
class TextNorm:
    """How a text is normalised before it is cut into shingles.

    The settings are part of the state: a store built with one ``TextNorm`` refuses
    another.

    Attributes:
        nfkc: apply Unicode NFKC normalisation (compatibility forms folded: ligatures,
            full-width letters, non-breaking spaces).
        casefold: apply ``str.casefold`` (aggressive lower-casing, e.g. "ß" -> "ss").
        collapse_whitespace: replace every run of white space by one space and strip
            both ends.
        strip_punctuation: delete every character of a Unicode punctuation category (P*).
    """

    nfkc: bool = True
    casefold: bool = True
    collapse_whitespace: bool = True
    strip_punctuation: bool = False

    def to_dict(self) -> dict[str, bool]:
        return asdict(self)


@cache
def _punctuation_table() -> dict[int, None]:
    return {
        cp: None
        for cp in range(sys.maxunicode + 1)
        if unicodedata.category(chr(cp)).startswith("P")
    }


def normalize(text: str, norm: TextNorm = TextNorm()) -> str:
    """Return ``text`` normalised by ``norm``.

    The steps run in a fixed order: NFKC, casefold, punctuation removal, NFKC again
    (casefolding and removals can leave composable sequences, e.g. "ß" + U+0301 ->
    "ss" + U+0301; without it the function is not idempotent), white-space collapsing. The
    result may be empty; callers treat that as an invalid record.
    """
    if norm.nfkc:
        text = unicodedata.normalize("NFKC", text)
    if norm.casefold:
        text = text.casefold()
    if norm.strip_punctuation:
        text = text.translate(_punctuation_table())
    if norm.nfkc and (norm.casefold or norm.strip_punctuation):
        text = unicodedata.normalize("NFKC", text)
    if norm.collapse_whitespace:
        # str.split() splits at runs of exactly the characters re's \s matches
        # (str.isspace), and drops them at both ends; three times faster than re.sub.
        text = " ".join(text.split())
    return text
