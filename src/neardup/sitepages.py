"""Web pages for measuring HTML text extraction: news stories inside site templates.

A crawler fetches pages whose navigation, related links and footers repeat on every page
of a site; a story's text is often smaller than that boilerplate, so that without
extraction two pages of one site look like near-duplicates whatever their stories, and
two pages of one story on different sites do not. ``site_pages`` renders stories (the
tests' Reuters-21578 excerpt) into the pages of ``SITES`` (four templates: a wire
service, a business daily, a regional paper, a markets portal), each with a header
menu, a breaking-news ticker, a "most read" list, related links (headlines of other
stories, so they differ page to page), a newsletter box, a cookie notice and a footer of
site-map links and legal text, as such sites print them. Some stories are published on
several sites. Which pages hold the same story is given by their ``story`` field: the
ground truth of the evaluation.
"""

from __future__ import annotations

import functools
import html
import itertools
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from neardup.core.types import Document


@dataclass(frozen=True)
class Site:
    """A site template: its name, host, menu sections, most-read headlines, footer
    link columns and legal text (each printed on every page)."""

    name: str
    host: str
    sections: tuple[str, ...]
    most_read: tuple[str, ...]
    footer_links: tuple[tuple[str, tuple[str, ...]], ...]
    legal: str


_COMMON_FOOTER = (
    ("Company", ("About us", "Careers", "Advertise with us", "Contact", "Press office", "Investor relations")),
    ("Help", ("Help centre", "Accessibility", "Subscriptions", "Manage your account", "Newsletters", "Apps")),
    ("Legal", ("Terms of use", "Privacy policy", "Cookie policy", "Modern slavery statement", "Corrections", "Editorial standards")),
)

SITES: tuple[Site, ...] = (
    Site(
        "Global Wire Daily", "globalwire.example",
        ("World", "Business", "Markets", "Commodities", "Energy", "Technology", "Politics", "Sport", "Opinion", "Video"),
        ("Oil prices climb as producers weigh output cuts", "Central bank signals patience on interest rates",
         "Grain exporters brace for weaker harvest", "Tech shares slide after earnings warnings",
         "Shipping rates jump on port congestion"),
        _COMMON_FOOTER + (("Sections", ("World", "Business", "Markets", "Sport", "Lifestyle", "Podcasts")),),
        "All quotes delayed a minimum of 15 minutes. Global Wire Daily, the news and media division of "
        "Global Wire Group, is the world's largest multimedia news provider, reaching billions of people "
        "worldwide every day. Global Wire Daily provides business, financial, national and international "
        "news to professionals via desktop terminals, the world's media organizations, industry events "
        "and directly to consumers. Copyright Global Wire Group. All rights reserved.",
    ),
    Site(
        "The Business Ledger", "ledger.example",
        ("Home", "Companies", "Economy", "Markets", "Personal finance", "Property", "Work & careers", "Life & arts"),
        ("Five things to watch in the markets this week", "Why bond yields are rising again",
         "The hidden costs of a strong dollar", "Merger wave sweeps mid-sized banks",
         "What the trade figures tell us about growth", "Pension funds shift towards equities"),
        _COMMON_FOOTER + (("Tools", ("Portfolio", "Currency converter", "Stock screener", "Mortgage calculator", "E-paper")),),
        "The Business Ledger and its journalism are subject to a self-regulation regime under the Ledger "
        "Editorial Code of Practice. Registered in England and Wales with company number 01234567. "
        "Reproduction of news articles, photos, videos or any other content in whole or in part in any "
        "form or medium without express written permission of The Business Ledger is prohibited. Market "
        "data is provided for information purposes only and is not intended for trading purposes.",
    ),
    Site(
        "Riverside Courier", "riversidecourier.example",
        ("News", "Local", "Business", "Farming", "Sport", "Weather", "Obituaries", "Events", "Jobs", "Classifieds"),
        ("Council approves new bridge funding", "Farmers report early frost damage",
         "High school team wins state title", "Road closures planned for the weekend",
         "New clinic opens on Main Street"),
        _COMMON_FOOTER + (("Local", ("Submit a story", "Letters to the editor", "Public notices", "Photo galleries", "Weather alerts")),),
        "Riverside Courier is part of the Valley Media Group of community newspapers. Our journalists "
        "follow the Valley Media code of ethics. If you believe a story is inaccurate, please contact "
        "the newsroom. Content on this site may not be republished, broadcast, rewritten or "
        "redistributed without permission. Riverside Courier, 100 River Road, Riverside.",
    ),
    Site(
        "MarketPulse", "marketpulse.example",
        ("Stocks", "Bonds", "Currencies", "Commodities", "Funds", "ETFs", "Crypto", "Earnings calendar", "Screeners", "Watchlist"),
        ("Dow futures point to a higher open", "Gold holds near record as dollar eases",
         "Analysts raise targets for chip makers", "Copper rallies on supply worries",
         "Yen weakens past key level", "Small caps outperform for third week"),
        _COMMON_FOOTER + (("Data", ("Real-time quotes", "Historical prices", "Market movers", "Economic calendar", "Heat map")),),
        "MarketPulse is not a broker or investment adviser. Information on this site is for general "
        "purposes only and does not constitute investment advice. Quotes may be delayed by at least 15 "
        "minutes. Data provided by third-party exchanges and vendors; see our data disclaimer. Past "
        "performance is not indicative of future results. MarketPulse Ltd. All rights reserved.",
    ),
)

_PARAGRAPH = re.compile(r"\n\s{2,}|\n\n")


def _paragraphs(body: str) -> list[str]:
    """A Reuters body's paragraphs (indented lines start one), white space collapsed."""
    return [" ".join(p.split()) for p in _PARAGRAPH.split(body) if p.strip()]


def _link(text: str, href: str) -> str:
    return f'<a href="{href}">{html.escape(text)}</a>'


_TOPICS = (
    "Africa", "Americas", "Asia Pacific", "Europe", "Middle East", "United Kingdom", "United States", "China",
    "India", "Japan", "Germany", "France", "Brazil", "Canada", "Australia", "Russia", "Mexico", "South Africa",
    "Aerospace", "Autos", "Banks", "Chemicals", "Construction", "Consumer goods", "Defence", "Healthcare",
    "Insurance", "Media", "Mining", "Oil and gas", "Pharmaceuticals", "Real estate", "Retail", "Shipping",
    "Steel", "Telecoms", "Transport", "Utilities", "Agriculture", "Coffee", "Cocoa", "Sugar", "Wheat", "Corn",
    "Soybeans", "Cotton", "Gold", "Silver", "Copper", "Aluminium", "Crude oil", "Natural gas", "Interest rates",
    "Inflation", "Employment", "Trade", "Currencies", "Bonds", "Equities", "Mergers", "IPOs", "Earnings",
    "Regulation", "Elections", "Climate", "Sustainable business", "Technology", "Cybersecurity", "Start-ups",
)
_PROMO = (
    "Watch: the week in markets in three minutes", "Podcast: what investors are asking this month",
    "Interactive: how global trade flows have shifted", "Explainer: what a rate cut means for savers",
    "Live blog: the latest from the trading floors", "Analysis: the commodity supercycle question",
    "Opinion: why the next recession may look different", "Photos: the year in pictures",
    "Guide: understanding company results season", "Quiz: test your knowledge of this week's news",
)


@functools.cache
def _chrome(site: Site) -> tuple[str, str]:
    """The markup ``site`` prints before and after every story's own part: a mega menu
    (each section with a dozen topic links), inline analytics and advertising
    configuration, promoted links, a topics index and a network of sister sites, all
    chosen by a generator seeded with the site's host (the same on every page)."""
    rnd = random.Random(site.host)
    prefix = site.host.split(".")[0]
    mega = "".join(
        f'<li class="menu-item"><a class="menu-link" href="/{sec.lower()}">{html.escape(sec)}</a><ul class="submenu">'
        + "".join(f'<li><a class="submenu-link" href="/{sec.lower()}/{t.lower().replace(" ", "-")}">{html.escape(t)}</a></li>'
                  for t in rnd.sample(_TOPICS, 18))
        + "</ul></li>"
        for sec in site.sections
    )
    config = {
        "site": prefix, "platform": "web", "pageType": "article", "consent": {"framework": "tcf-v2", "vendors": sorted(rnd.sample(range(1, 900), 300))},
        "ads": {"network": f"/{rnd.randrange(10**6, 10**7)}/{prefix}", "slots": [
            {"id": f"ad-slot-{i}", "sizes": [[300, 250], [728, 90], [970, 250]], "lazy": i > 1} for i in range(24)]},
        "analytics": {"account": f"UA-{rnd.randrange(10**7, 10**8)}-1", "dimensions": {f"dimension{i}": t for i, t in enumerate(rnd.sample(_TOPICS, 10))}},
        "features": {t.lower().replace(" ", "_"): rnd.random() < 0.5 for t in rnd.sample(_TOPICS, 60)},
    }
    script = (f'<script type="text/javascript">window.__{prefix.upper()}_CONFIG__ = {json.dumps(config)};</script>'
              f'<script async src="https://static.{site.host}/js/main.{rnd.randrange(16**8):08x}.js"></script>')
    state = {"props": {"pageProps": {"navigation": [
        {"label": sec, "href": f"/{sec.lower()}", "children": [
            {"label": t, "href": f"/{sec.lower()}/{t.lower().replace(' ', '-')}", "tracking": f"nav|{sec}|{t}"}
            for t in rnd.sample(_TOPICS, 18)]} for sec in site.sections]}}, "buildId": f"{rnd.randrange(16**12):012x}"}
    script += f'<script id="__NEXT_DATA__" type="application/json">{json.dumps(state)}</script>'
    promo = "".join(f'<li class="promo-item"><a href="/promo/{i}">{html.escape(t)}</a></li>'
                    for i, t in enumerate(rnd.sample(_PROMO, 8)))
    topics = "".join(f'<li><a href="/topic/{t.lower().replace(" ", "-")}">{html.escape(t)}</a></li>' for t in rnd.sample(_TOPICS, 50))
    network = "".join(f'<li><a href="https://{w.lower()}.example">{w} {kind}</a></li>'
                      for w, kind in zip(rnd.sample(_TOPICS, 15), itertools.cycle(("Weekly", "Today", "Review", "Insider"))))
    before = f'{script}<nav class="mega-menu"><ul>{mega}</ul></nav>'
    after = (f'<section class="promo"><h3>More from {html.escape(site.name)}</h3><ul>{promo}</ul></section>'
             f'<section class="topics"><h3>Topics</h3><ul>{topics}</ul></section>'
             f'<section class="network"><h3>Our network</h3><ul>{network}</ul></section>')
    return before, after


def render_page(site: Site, title: str, body: str, related: Sequence[str], page_id: str, date: str) -> str:
    """One HTML page of ``site`` holding a story (``title``, ``body`` as Reuters prints
    it: paragraphs start indented lines), with ``related`` headlines as links.
    Returns the page as text."""
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:60]
    menu = "".join(f"<li>{_link(s, f'/{s.lower()}')}</li>" for s in site.sections)
    ticker = " | ".join(html.escape(h) for h in site.most_read[:3])
    most_read = "".join(f"<li>{_link(h, f'/story/{i}')}</li>" for i, h in enumerate(site.most_read))
    rel = "".join(f"<li>{_link(h, f'/related/{i}')}</li>" for i, h in enumerate(related))
    paras = "".join(f"<p>{html.escape(p)}</p>" for p in _paragraphs(body))
    columns = "".join(
        f'<div class="col"><h4>{html.escape(head)}</h4><ul>'
        + "".join(f"<li>{_link(x, '/' + x.lower().replace(' ', '-'))}</li>" for x in links)
        + "</ul></div>"
        for head, links in site.footer_links
    )
    name = html.escape(site.name)
    before, after = _chrome(site)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)} | {name}</title>"
        f'<link rel="canonical" href="https://{site.host}/{slug}-{page_id}"></head><body>'
        f'<div class="cookie-banner">We use cookies and similar technologies to improve your experience, '
        f"measure audiences and show you personalised advertising. By clicking Accept, you agree to this "
        f'use. You can change your choices at any time in Cookie settings. <button>Accept</button></div>'
        f'<header><div class="logo">{_link(site.name, "/")}</div>'
        f'<nav><ul class="menu">{menu}</ul></nav>'
        f'<div class="account">{_link("Sign in", "/login")} {_link("Subscribe", "/subscribe")}</div>'
        f'<div class="ticker">Breaking: {ticker}</div>{before}</header>'
        f'<main><article><h1>{html.escape(title)}</h1>'
        f'<div class="byline">By {name} staff · <time>{html.escape(date)}</time> · 3 min read</div>'
        f'<div class="share">Share: {_link("Twitter", "#")} {_link("Facebook", "#")} {_link("LinkedIn", "#")} {_link("Email", "#")}</div>'
        f'<div class="article-body">{paras}</div></article>'
        f'<aside class="related"><h3>Related stories</h3><ul>{rel}</ul></aside></main>'
        f'<aside class="most-read"><h3>Most read</h3><ol>{most_read}</ol></aside>'
        f'<div class="newsletter"><h3>Get the {name} briefing</h3><p>The day\'s top stories and market '
        f"moves, in your inbox every morning before the open. Free for registered readers.</p>"
        f'<form><input type="email" placeholder="Your email address"><button>Sign up</button></form></div>'
        f'{after}<footer><div class="columns">{columns}</div>'
        f'<p class="legal">{html.escape(site.legal)}</p></footer></body></html>'
    )


def distinct_stories(stories: Sequence[Document], threshold: float = 0.5, n: int = 5,
                     limit: int | None = None) -> list[Document]:
    """``stories`` without those whose text is a near-duplicate of an earlier one kept:
    the Reuters wire re-issued stories under new ids (a corrected headline, the same
    text), and pages of two such ids are pages of one story. A story is dropped when the
    Jaccard similarity of its casefolded white-space ``n``-word shingles with a kept
    story's is at least ``threshold`` (exact, over every kept story: quadratic, for a
    few thousand stories). Stops once ``limit`` stories are kept."""
    kept: list[Document] = []
    sets: list[frozenset[tuple[str, ...]]] = []
    for doc in stories:
        words = doc.text.casefold().split()
        shingles = frozenset(tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1)))
        if any(len(shingles & other) >= threshold * len(shingles | other) for other in sets):
            continue
        kept.append(doc)
        sets.append(shingles)
        if limit is not None and len(kept) >= limit:
            break
    return kept


@dataclass(frozen=True)
class Page:
    """A generated page: its id, its story's id (same story, same ``story``), its site's
    host, and its HTML."""

    id: str
    story: str
    site: str
    html: str


def site_pages(stories: Sequence[Document], titles: Sequence[str], seed: int = 1,
               several: float = 0.4, sites: Sequence[Site] = SITES, related: int = 4) -> list[Page]:
    """Every story rendered as a page of one site or, with probability ``several``, of
    2 to ``len(sites)`` sites; pages in a random order (``seed``: the same arguments
    give the same pages).

    Args:
        stories: id and text of each story; the text is ``title + "\\n" + body``, as in
            the Reuters JSONL (the first line is taken as the title if it is the
            story's ``titles`` entry).
        titles: each story's headline, also used for other pages' related links.
        several: share of stories published on more than one site.
        related: related links per page (headlines of other stories, at random).

    Returns:
        Pages with ids ``<story id>@<site host>``.
    """
    rnd = random.Random(seed)
    pages: list[Page] = []
    for doc, title in zip(stories, titles):
        body = doc.text[len(title) + 1:] if doc.text.startswith(title + "\n") else doc.text
        k = rnd.randint(2, len(sites)) if rnd.random() < several else 1
        for site in rnd.sample(list(sites), k):
            links = [titles[rnd.randrange(len(titles))] for _ in range(related)]
            page_id = f"{doc.id}@{site.host}"
            pages.append(Page(page_id, doc.id, site.host,
                              render_page(site, title, body, links, doc.id, "20 March 1987")))
    rnd.shuffle(pages)
    return pages
