"""Composite articles for measuring containment: short stories embedded in longer texts.

A newspaper prints a wire story inside its own longer article. ``composites`` builds such
articles from a corpus of stories: a short story, whole or trimmed at both ends, with the
text of other stories before and after it, 2 to 6 times its length. The stream it returns
holds the stories and the composites, so that a story arrives before some of its
composites (an earlier short text contained in a new long one) and after others (a new
short text contained in an earlier long one). Which pairs are contained is not recorded:
the evaluation computes it exactly over the shingles (``neardup.groundtruth``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from neardup.core.types import Document

_WORD = re.compile(r"\S+")


def composites(stories: Sequence[Document], count: int, seed: int = 1, min_words: int = 40,
               max_words: int = 150, ratios: tuple[float, float] = (2.0, 6.0),
               trimmed: float = 0.5) -> list[Document]:
    """``stories`` with ``count`` composite articles inserted among them.

    Each composite (id ``<story id>~in~<k>``) takes a story of ``min_words`` to
    ``max_words`` white-space words, whole or (with probability ``trimmed``) with up to a
    fifth of its words cut at each end, and puts it at a random point of the words of
    other stories (taken in turn from a random start), so that the composite is
    ``ratios[0]`` to ``ratios[1]`` times as long as the embedded part (uniform). It is
    inserted at a random position of the stream, before or after its story.

    Args:
        stories: the corpus, in stream order.
        count: composites to build.
        seed: seed of every random choice (same arguments, same output).

    Returns:
        The stream: ``len(stories) + count`` documents.

    Raises:
        ValueError: no story has ``min_words`` to ``max_words`` words, or the corpus
            holds too few words to fill a composite.
    """
    rnd = random.Random(seed)
    words = [_WORD.findall(d.text) for d in stories]
    short = [i for i, w in enumerate(words) if min_words <= len(w) <= max_words]
    if count and not short:
        raise ValueError(f"no story of {min_words} to {max_words} words")
    pool = [i for i, w in enumerate(words) if len(w) >= min_words]
    stream: list[Document] = list(stories)
    for k in range(count):
        i = rnd.choice(short)
        part = words[i]
        if rnd.random() < trimmed:
            cut = len(part) // 5
            part = part[rnd.randint(0, cut) : len(part) - rnd.randint(0, cut)]
        filler = _filler(words, pool, i, round(len(part) * (rnd.uniform(*ratios) - 1.0)), rnd)
        at = rnd.randint(0, len(filler))
        text = " ".join(filler[:at] + part + filler[at:])
        stream.insert(rnd.randint(0, len(stream)), Document(f"{stories[i].id}~in~{k}", text))
    return stream


def _filler(words: list[list[str]], pool: list[int], skip: int, n: int, rnd: random.Random) -> list[str]:
    """``n`` words of other stories than ``skip``, whole stories in turn from a random one."""
    out: list[str] = []
    j = rnd.randrange(len(pool))
    for _ in range(len(pool)):
        if len(out) >= n:
            break
        if pool[j] != skip:
            out += words[pool[j]]
        j = (j + 1) % len(pool)
    if len(out) < n:
        raise ValueError(f"the corpus holds fewer than {n} words to fill a composite")
    return out[:n]
