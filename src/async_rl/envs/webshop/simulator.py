"""Built-in WebShop simulator: WebShop's pages, text observations, actions and reward on a synthetic catalog.

:class:`WebShopSimulator` serves WebShop's text-mode pages (search, results, item, sub-pages) and takes
``search[query]`` / ``click[element]``; an action the page cannot execute sets ``info["invalid_action"]``
and leaves the page unchanged. :class:`Shop` searches with :class:`BM25Index` (Lucene's formula, pyserini's
``k1``, ``b``) plus a title boost. :func:`webshop_reward` on ``click[buy now]`` is WebShop's formula without
its spaCy type term. :func:`admissible_actions` gives the verl-agent style action list.

Details: docs/webshop.md (Pages, observations, actions; Search; Reward; What differs from the real WebShop).
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from async_rl.envs.webshop.catalog import (
    DEFAULT_NUM_GOALS,
    DEFAULT_NUM_PRODUCTS,
    DEFAULT_NUM_TEST_GOALS,
    DEFAULT_SEED,
    Catalog,
    get_catalog,
    normalize_phrase,
)

__all__ = [
    "BM25Index",
    "SEP",
    "Shop",
    "ShopReply",
    "WebShopSimulator",
    "admissible_actions",
    "expert_actions",
    "get_shop",
    "parse_shop_action",
    "tokenize",
    "webshop_reward",
]

SEP = " [SEP] "

PAGE_SEARCH = "search"
PAGE_RESULTS = "results"
PAGE_ITEM = "item"
PAGE_SUB = "sub"

BACK_TO_SEARCH = "back to search"
NEXT_PAGE = "next >"
PREV_PAGE = "< prev"
BUY_NOW = "buy now"
SUB_PAGES = ("description", "features", "reviews")

# --------------------------------------------------------------------------------------------------
# BM25
# --------------------------------------------------------------------------------------------------

_TOKEN_RE = re.compile(r"[a-z0-9]+(?:\.[0-9]+)?")
_STOPWORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these "
    "they this to was will with".split()
)


def _stem(token: str) -> str:
    """A light plural stemmer: ``extensions`` -> ``extension``, ``berries`` -> ``berry``."""
    if len(token) > 4 and token.endswith("ies"):
        return token[:-3] + "y"
    if len(token) > 3 and token.endswith("s") and not token.endswith(("ss", "us", "is")):
        return token[:-1]
    return token


def tokenize(text: str) -> list[str]:
    """Lower-case word / number tokens, English stop words dropped, plurals lightly stemmed."""
    return [_stem(tok) for tok in _TOKEN_RE.findall(str(text).lower()) if tok not in _STOPWORDS]


class BM25Index:
    """Okapi BM25 over a fixed list of documents (in-memory inverted index, no external engine).

    ``score(q, d) = sum over distinct query terms t in d of
    idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))`` with Lucene's
    ``idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))`` (always positive).
    """

    def __init__(self, documents: Sequence[str], k1: float = 0.9, b: float = 0.4) -> None:
        self.k1 = float(k1)
        self.b = float(b)
        self._postings: dict[str, list[tuple[int, int]]] = {}
        self._lengths: list[int] = []
        for doc_id, text in enumerate(documents):
            counts = Counter(tokenize(text))
            self._lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                self._postings.setdefault(term, []).append((doc_id, tf))
        self.num_docs = len(self._lengths)
        self._avgdl = (sum(self._lengths) / self.num_docs) if self.num_docs else 0.0
        self._idf = {
            term: math.log(1.0 + (self.num_docs - len(posts) + 0.5) / (len(posts) + 0.5))
            for term, posts in self._postings.items()
        }

    def scores(self, query: str) -> dict[int, float]:
        """``{doc_id: score}`` for every document sharing at least one term with ``query``."""
        totals: dict[int, float] = {}
        avgdl = self._avgdl or 1.0
        for term in dict.fromkeys(tokenize(query)):  # distinct terms, query order
            posts = self._postings.get(term)
            if not posts:
                continue
            idf = self._idf[term]
            for doc_id, tf in posts:
                norm = self.k1 * (1.0 - self.b + self.b * self._lengths[doc_id] / avgdl)
                totals[doc_id] = totals.get(doc_id, 0.0) + idf * tf * (self.k1 + 1.0) / (tf + norm)
        return totals

    def search(self, query: str, top_k: int | None = None) -> list[tuple[int, float]]:
        """Best documents first as ``(doc_id, score)``; ties broken by the lower doc id."""
        ranked = sorted(self.scores(query).items(), key=lambda item: (-item[1], item[0]))
        return ranked if top_k is None else ranked[: max(int(top_k), 0)]


# --------------------------------------------------------------------------------------------------
# The shop: catalog + search index (read-only, shared by all sessions)
# --------------------------------------------------------------------------------------------------


def _product_document(product: Mapping[str, Any]) -> str:
    parts: list[str] = [product["title"], product.get("product_category", ""), product.get("query", "")]
    parts += list(product.get("attributes", ()))
    parts += list(product.get("small_description", ()))
    return " ".join(str(p) for p in parts)


class Shop:
    """A catalog and its search index. Immutable after construction, so one shop serves many sessions
    and threads.

    A product's search score is ``BM25(product document) + title_weight * BM25(title)``: two BM25
    indexes, one over the whole product text (title, category, query, attributes, bullet points) and one
    over titles only, so that a query naming a product's exact title puts that product first even when
    another product's longer text also contains all of the query's words.
    """

    def __init__(self, catalog: Catalog, k1: float = 0.9, b: float = 0.4, title_weight: float = 1.0) -> None:
        self.catalog = catalog
        self.title_weight = float(title_weight)
        self.index = BM25Index([_product_document(p) for p in catalog.products], k1=k1, b=b)
        self.title_index = BM25Index([p["title"] for p in catalog.products], k1=k1, b=b)

    def ranked(self, query: str, top_k: int | None = 50) -> list[tuple[int, float]]:
        """``(product index, score)`` best first; ties keep catalog order."""
        totals = self.index.scores(query)
        if self.title_weight:
            for doc_id, score in self.title_index.scores(query).items():
                totals[doc_id] = totals.get(doc_id, 0.0) + self.title_weight * score
        ranked = sorted(totals.items(), key=lambda item: (-item[1], item[0]))
        return ranked if top_k is None else ranked[: max(int(top_k), 0)]

    def search(self, query: str, top_k: int = 50) -> list[str]:
        """ASINs of the best ``top_k`` products for ``query``."""
        return [self.catalog.products[doc_id]["asin"] for doc_id, _ in self.ranked(query, top_k)]


@functools.lru_cache(maxsize=8)
def get_shop(
    seed: int = DEFAULT_SEED,
    num_products: int = DEFAULT_NUM_PRODUCTS,
    num_goals: int = DEFAULT_NUM_GOALS,
    num_test_goals: int = DEFAULT_NUM_TEST_GOALS,
) -> Shop:
    """The cached shop over :func:`~async_rl.envs.webshop.catalog.get_catalog` ``(...)``."""
    return Shop(get_catalog(seed, num_products, num_goals, num_test_goals))


# --------------------------------------------------------------------------------------------------
# Reward
# --------------------------------------------------------------------------------------------------


def _contains_phrase(haystack: str, phrase: str) -> bool:
    return bool(phrase) and f" {phrase} " in f" {haystack} "


def webshop_reward(
    goal: Mapping[str, Any], product: Mapping[str, Any], selected_options: Mapping[str, str] | Iterable[str]
) -> tuple[float, dict[str, Any]]:
    """WebShop's purchase reward without the type term; see the module docstring.

    Returns ``(reward, details)`` with ``details = {"attribute_matches", "option_matches", "price_ok",
    "num_goal_attributes", "num_goal_options"}``.
    """
    goal_attributes = [normalize_phrase(a) for a in goal.get("attributes", ())]
    raw_options = goal.get("goal_options", {}) or {}
    goal_values = list(raw_options.values()) if isinstance(raw_options, Mapping) else list(raw_options)
    goal_values = [normalize_phrase(v) for v in goal_values]

    product_attributes = {normalize_phrase(a) for a in product.get("attributes", ())}
    text = normalize_phrase(
        " ".join([str(product.get("title", ""))] + [str(s) for s in product.get("small_description", ())]
                 + [str(product.get("full_description", ""))])
    )
    attribute_matches = sum(1 for a in goal_attributes if a in product_attributes or _contains_phrase(text, a))

    chosen = selected_options.values() if isinstance(selected_options, Mapping) else selected_options
    chosen_values = {normalize_phrase(v) for v in chosen}
    option_matches = sum(1 for v in goal_values if v in chosen_values)

    price_upper = goal.get("price_upper")
    price_ok = 1 if price_upper is None or float(product["price"]) <= float(price_upper) else 0
    denominator = len(goal_attributes) + len(goal_values) + 1
    reward = (attribute_matches + option_matches + price_ok) / denominator
    details = {
        "attribute_matches": attribute_matches,
        "option_matches": option_matches,
        "price_ok": price_ok,
        "num_goal_attributes": len(goal_attributes),
        "num_goal_options": len(goal_values),
    }
    return reward, details


# --------------------------------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------------------------------

_ACTION_RE = re.compile(r"\s*(search|click)\s*\[(.*)\]\s*", re.IGNORECASE | re.DOTALL)


def parse_shop_action(action: str) -> tuple[str, str] | None:
    """``"search[red shoes]"`` -> ``("search", "red shoes")``; ``"click[Buy Now]"`` -> ``("click", "buy now")``.

    The argument is stripped and its inner whitespace collapsed; click targets are lower-cased (search
    queries keep their case). None when the text is not one action.
    """
    if not isinstance(action, str):
        return None
    match = _ACTION_RE.fullmatch(action)
    if match is None:
        return None
    kind = match.group(1).lower()
    argument = " ".join(match.group(2).split())
    if kind == "click":
        argument = argument.lower()
    return kind, argument


def admissible_actions(available: Mapping[str, Any]) -> list[str]:
    """verl-agent style action list from WebShop's ``{"has_search_bar", "clickables"}``."""
    actions = ["search[<your query>]"] if available.get("has_search_bar") else []
    actions += [f"click[{c}]" for c in available.get("clickables", ()) if c != "search"]
    return actions


@dataclass
class ShopReply:
    """What a backend answers to reset / step (the JSON body of the HTTP protocol, as a dataclass)."""

    observation: str
    available_actions: dict[str, Any]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    instruction: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "observation": self.observation,
            "available_actions": self.available_actions,
            "reward": self.reward,
            "done": self.done,
            "info": self.info,
            "instruction": self.instruction,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ShopReply":
        if not isinstance(data, Mapping) or not isinstance(data.get("observation"), str):
            raise ValueError(f"malformed WebShop reply: {data!r:.300}")
        available = data.get("available_actions") or {}
        if not isinstance(available, Mapping):
            raise ValueError(f"malformed available_actions in WebShop reply: {available!r:.300}")
        reward = float(data.get("reward", 0.0) or 0.0)
        info = data.get("info") or {}
        return cls(
            observation=data["observation"],
            available_actions={
                "has_search_bar": bool(available.get("has_search_bar", False)),
                "clickables": [str(c) for c in available.get("clickables", ())],
            },
            reward=reward,
            done=bool(data.get("done", False)),
            info=dict(info) if isinstance(info, Mapping) else {},
            instruction=data.get("instruction"),
        )


# --------------------------------------------------------------------------------------------------
# Simulator
# --------------------------------------------------------------------------------------------------


class WebShopSimulator:
    """One shopping session (one episode at a time) on a :class:`Shop`. Not thread-safe; make one per
    session (they are cheap: the shop is shared).

    ``reset(goal_index) -> ShopReply``; ``step(action) -> ShopReply``; see the module docstring.
    """

    def __init__(self, shop: Shop | None = None, *, max_turns: int = 15, page_size: int = 10,
                 max_results: int = 50) -> None:
        if max_turns < 1 or page_size < 1 or max_results < 1:
            raise ValueError("max_turns, page_size and max_results must be >= 1")
        self.shop = shop if shop is not None else get_shop()
        self.max_turns = int(max_turns)
        self.page_size = int(page_size)
        self.max_results = int(max_results)
        self.goal: dict[str, Any] | None = None
        self.goal_index: int | None = None
        self.done = True
        self.turn = 0
        self._page = PAGE_SEARCH
        self._query = ""
        self._results: list[str] = []
        self._page_num = 1
        self._asin: str | None = None
        self._selected: dict[str, str] = {}
        self._sub_page: str | None = None
        self._bought = False

    # ------------------------------------------------------------------ public API
    @property
    def instruction(self) -> str:
        if self.goal is None:
            raise RuntimeError("WebShopSimulator: call reset first")
        return self.goal["instruction_text"]

    @property
    def page(self) -> str:
        return self._page

    @property
    def selected_options(self) -> dict[str, str]:
        return dict(self._selected)

    def reset(self, goal_index: int) -> ShopReply:
        """Start an episode for goal ``goal_index`` on the search page."""
        self.goal = self.shop.catalog.goal(goal_index)
        self.goal_index = goal_index
        self.done = False
        self.turn = 0
        self._goto_search()
        return ShopReply(self.observation(), self.available_actions(), instruction=self.instruction)

    def step(self, action: str) -> ShopReply:
        """Apply one ``search[...]`` / ``click[...]`` action."""
        if self.goal is None:
            raise RuntimeError("WebShopSimulator.step called before reset")
        if self.done:
            raise RuntimeError("WebShopSimulator episode is over; call reset for the next goal")
        self.turn += 1
        info: dict[str, Any] = {"invalid_action": False, "success": False, "score": 0.0, "turn": self.turn}
        reward = 0.0
        parsed = parse_shop_action(action)
        valid = parsed is not None and self._apply(parsed, info)
        if not valid:
            info["invalid_action"] = True
        if "purchased" in info:
            reward, details = webshop_reward(self.goal, self.shop.catalog.product(self._asin), self._selected)
            info["reward_details"] = details
            info["score"] = reward
            info["success"] = reward == 1.0
            self.done = True
            return ShopReply("", self.available_actions(), reward, True, info, self.instruction)
        if self.turn >= self.max_turns:
            self.done = True
            info["out_of_turns"] = True
        info["page"] = self._page
        return ShopReply(self.observation(), self.available_actions(), reward, self.done, info, self.instruction)

    def available_actions(self) -> dict[str, Any]:
        """WebShop's ``get_available_actions()``: ``{"has_search_bar": bool, "clickables": [str]}``."""
        if self._bought:
            return {"has_search_bar": False, "clickables": []}
        return {"has_search_bar": self._page == PAGE_SEARCH, "clickables": self._clickables()}

    def observation(self) -> str:
        """The current page in WebShop's text mode."""
        head = f"Instruction:{SEP}{self.instruction}"
        if self._page == PAGE_SEARCH:
            return f"WebShop{SEP}{head}{SEP}Search"
        parts = [head, "Back to Search"]
        if self._page == PAGE_RESULTS:
            parts.append(f"Page {self._page_num} (Total results: {len(self._results)})")
            if self._page_num > 1:
                parts.append("< Prev")
            if self._page_num < self._num_pages():
                parts.append("Next >")
            catalog = self.shop.catalog
            for asin in self._page_asins():
                product = catalog.product(asin)
                parts += [asin, product["title"], f"${float(product['price']):.2f}"]
            return SEP.join(parts)
        product = self.shop.catalog.product(self._asin)
        parts.append("< Prev")
        if self._page == PAGE_SUB:
            parts += self._sub_page_parts(product)
            return SEP.join(parts)
        for option_type, values in product["options"].items():
            parts.append(option_type)
            chosen = self._selected.get(option_type)
            parts += [f"You have clicked {v}." if v == chosen else v for v in values]
        parts += [product["title"], f"Price: ${float(product['price']):.2f}",
                  f"Rating: {product.get('rating', 'N.A.')}"]
        parts += ["Description", "Features", "Reviews", "Buy Now"]
        return SEP.join(parts)

    # ------------------------------------------------------------------ internals
    def _goto_search(self) -> None:
        self._page = PAGE_SEARCH
        self._query = ""
        self._results = []
        self._page_num = 1
        self._asin = None
        self._selected = {}
        self._sub_page = None
        self._bought = False

    def _num_pages(self) -> int:
        return max(1, math.ceil(len(self._results) / self.page_size))

    def _page_asins(self) -> list[str]:
        start = (self._page_num - 1) * self.page_size
        return self._results[start: start + self.page_size]

    def _option_values(self) -> dict[str, str]:
        """Lower-cased option value -> option type of the current item (first type wins on a clash)."""
        product = self.shop.catalog.product(self._asin)
        mapping: dict[str, str] = {}
        for option_type, values in product["options"].items():
            for value in values:
                mapping.setdefault(" ".join(str(value).lower().split()), option_type)
        return mapping

    def _clickables(self) -> list[str]:
        if self._page == PAGE_SEARCH:
            return []
        clickables = [BACK_TO_SEARCH]
        if self._page == PAGE_RESULTS:
            if self._page_num > 1:
                clickables.append(PREV_PAGE)
            if self._page_num < self._num_pages():
                clickables.append(NEXT_PAGE)
            clickables += [asin.lower() for asin in self._page_asins()]
            return clickables
        clickables.append(PREV_PAGE)
        if self._page == PAGE_ITEM:
            clickables += list(self._option_values())
            clickables += list(SUB_PAGES) + [BUY_NOW]
        return clickables

    def _apply(self, parsed: tuple[str, str], info: dict[str, Any]) -> bool:
        """Execute a parsed action; False (state untouched) when it is not valid on this page."""
        kind, argument = parsed
        if kind == "search":
            if self._page != PAGE_SEARCH or not tokenize(argument):
                return False
            self._query = argument
            self._results = self.shop.search(argument, self.max_results)
            self._page_num = 1
            self._page = PAGE_RESULTS
            return True
        if argument not in self._clickables():
            return False
        if argument == BACK_TO_SEARCH:
            self._goto_search()
        elif self._page == PAGE_RESULTS:
            if argument == NEXT_PAGE:
                self._page_num += 1
            elif argument == PREV_PAGE:
                self._page_num -= 1
            else:
                self._asin = argument.upper()
                self._selected = {}
                self._page = PAGE_ITEM
        elif self._page == PAGE_SUB:  # only "< prev" is left
            self._page = PAGE_ITEM
            self._sub_page = None
        elif argument == PREV_PAGE:  # item -> results
            self._page = PAGE_RESULTS
            self._asin = None
            self._selected = {}
        elif argument in SUB_PAGES:
            self._page = PAGE_SUB
            self._sub_page = argument
        elif argument == BUY_NOW:
            product = self.shop.catalog.product(self._asin)
            self._bought = True
            info["purchased"] = {"asin": product["asin"], "options": dict(self._selected),
                                 "price": float(product["price"])}
        else:
            option_type = self._option_values()[argument]
            original = next(v for v in self.shop.catalog.product(self._asin)["options"][option_type]
                            if " ".join(str(v).lower().split()) == argument)
            self._selected[option_type] = original
        return True

    def _sub_page_parts(self, product: Mapping[str, Any]) -> list[str]:
        if self._sub_page == "description":
            return [str(product.get("full_description", ""))]
        if self._sub_page == "features":
            return [str(b) for b in product.get("small_description", ())]
        parts: list[str] = []
        for review in product.get("reviews", ()):
            parts += [f"Rating: {review.get('score')}", str(review.get("body", ""))]
        return parts


def expert_actions(catalog: Catalog, goal_index: int) -> list[str]:
    """A scripted perfect episode: search the target's exact title, open it, pick the goal's option
    values, buy. (It relies on the exact-title search ranking the target on the first page.)"""
    goal = catalog.goal(goal_index)
    product = catalog.product(goal["asin"])
    options = goal["goal_options"]
    values = options.values() if isinstance(options, Mapping) else options
    return ([f"search[{product['title']}]", f"click[{product['asin'].lower()}]"]
            + [f"click[{v}]" for v in values] + [f"click[{BUY_NOW}]"])
