"""Synthetic WebShop catalog: products in WebShop's product schema and WebShop-style shopping goals.

A small stand-in, generated deterministically from a seed, for the real WebShop's ~1.18 M scraped Amazon
products and ~12 k human instructions, with the same shape, so the built-in simulator
(:mod:`async_rl.envs.webshop.simulator`) runs the task without its data, Java, Lucene or spaCy. Every goal's
instruction states its checked attributes, option values and price bound verbatim, and its target satisfies
them all, so a score of 1 is reachable. Entry points: :func:`generate_catalog` (cached:
:func:`get_catalog`), :func:`make_goal`, :func:`normalize_phrase`.

Details: docs/webshop.md (The simulator backend: Catalog).
"""

from __future__ import annotations

import functools
import math
import random
import re
import string
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "CATEGORIES",
    "Catalog",
    "PRODUCT_TYPES",
    "ProductType",
    "generate_catalog",
    "get_catalog",
    "instruction_for",
    "make_goal",
    "normalize_phrase",
]

CATEGORIES: tuple[str, ...] = ("beauty", "grocery", "fashion", "furniture", "electronics")

DEFAULT_SEED = 0
DEFAULT_NUM_PRODUCTS = 500
DEFAULT_NUM_GOALS = 2000
DEFAULT_NUM_TEST_GOALS = 200


@dataclass(frozen=True)
class ProductType:
    """A kind of product the generator can make (one row of :data:`PRODUCT_TYPES`)."""

    category: str
    product_category: str
    query: str
    nouns: tuple[str, ...]  # head nouns used in titles and instructions
    descriptors: tuple[str, ...]  # title fillers that are never attributes of this type
    attributes: tuple[str, ...]  # attribute pool (products get 3-4)
    options: Mapping[str, tuple[str, ...]]  # option type -> value pool (products get 2+ values each)
    price_range: tuple[float, float]


def _pt(category, product_category, query, nouns, descriptors, attributes, options, price_range) -> ProductType:
    return ProductType(
        category, product_category, query, tuple(nouns), tuple(descriptors), tuple(attributes),
        {k: tuple(v) for k, v in options.items()}, tuple(price_range),
    )


PRODUCT_TYPES: tuple[ProductType, ...] = (
    # ---------------------------------------------------------------- beauty
    _pt("beauty", "Beauty & Personal Care › Hair Care › Hair Extensions, Wigs & Accessories › Hair Extensions",
        "hair extensions", ["clip-in hair extension", "hair extension", "tape-in hair extension"],
        ["straight", "wavy", "full head set"],
        ["natural looking", "long lasting", "heat resistant", "easy to apply", "human hair", "tangle free"],
        {"color": ["natural black", "dark brown", "medium brown", "ash blonde", "auburn"],
         "size": ["14 inch", "18 inch", "22 inch", "26 inch"]}, (15, 90)),
    _pt("beauty", "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
        "shampoo", ["shampoo", "moisturizing shampoo", "clarifying shampoo"],
        ["for all hair types", "salon formula", "daily use"],
        ["sulfate free", "paraben free", "natural ingredients", "cruelty free", "color safe", "dry hair"],
        {"size": ["8 fl oz", "12 fl oz", "16.9 fl oz", "33.8 fl oz"],
         "scent": ["lavender", "coconut", "tea tree", "unscented", "citrus"]}, (6, 35)),
    _pt("beauty", "Beauty & Personal Care › Makeup › Lips › Lipstick",
        "lipstick", ["matte lipstick", "liquid lipstick", "lipstick"],
        ["full coverage", "satin finish", "creamy formula"],
        ["long lasting", "cruelty free", "paraben free", "vegan", "highly pigmented", "moisturizing"],
        {"color": ["ruby red", "nude pink", "berry", "coral", "mauve", "plum"]}, (5, 30)),
    _pt("beauty", "Beauty & Personal Care › Skin Care › Face › Creams & Moisturizers",
        "face moisturizer", ["face moisturizer", "facial cream", "daily moisturizer"],
        ["for face and neck", "lightweight texture", "non-greasy"],
        ["oil free", "sensitive skin", "anti aging", "fragrance free", "dermatologist tested", "hyaluronic acid"],
        {"size": ["1.7 oz", "2.5 oz", "3.4 oz"], "style": ["day cream", "night cream", "gel cream"]}, (9, 60)),
    _pt("beauty", "Beauty & Personal Care › Foot, Hand & Nail Care › Nail Art & Polish › Nail Polish",
        "nail polish", ["nail polish", "gel nail polish", "nail lacquer"],
        ["high shine", "salon quality", "glossy finish"],
        ["long lasting", "non toxic", "easy to apply", "chip resistant", "cruelty free", "quick drying"],
        {"color": ["classic red", "baby pink", "midnight blue", "pure white", "jet black", "lilac"],
         "size": ["0.5 fl oz", "0.25 fl oz"]}, (4, 20)),
    # ---------------------------------------------------------------- grocery
    _pt("grocery", "Grocery & Gourmet Food › Snacks & Sweets › Chips & Crisps › Tortilla",
        "tortilla chips", ["tortilla chips", "corn tortilla chips"],
        ["party size", "restaurant style", "crunchy snack"],
        ["gluten free", "non gmo", "low sodium", "vegan", "kosher", "whole grain"],
        {"flavor": ["sea salt", "lime", "chipotle", "nacho cheese", "blue corn"],
         "size": ["9 ounce (pack of 1)", "12 ounce (pack of 2)", "6 ounce (pack of 6)"]}, (3, 30)),
    _pt("grocery", "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Coffee › Whole Coffee Beans",
        "coffee beans", ["whole bean coffee", "ground coffee", "coffee"],
        ["small batch roasted", "rich and smooth", "freshly roasted"],
        ["organic", "fair trade", "low acid", "kosher", "non gmo", "high caffeine"],
        {"flavor": ["french vanilla", "hazelnut", "original", "mocha", "caramel"],
         "size": ["12 ounce", "2 pound", "5 pound"]}, (8, 55)),
    _pt("grocery", "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Tea › Green",
        "green tea", ["green tea bags", "matcha green tea", "loose leaf green tea"],
        ["premium grade", "classic blend", "imported from japan"],
        ["organic", "decaffeinated", "sugar free", "non gmo", "gluten free", "natural ingredients"],
        {"flavor": ["jasmine", "mint", "lemon ginger", "original", "peach"],
         "size": ["20 count", "50 count", "100 count"]}, (4, 30)),
    _pt("grocery", "Grocery & Gourmet Food › Snacks & Sweets › Bars › Protein Bars",
        "protein bars", ["protein bar", "protein snack bar"],
        ["on the go snack", "meal replacement", "post workout"],
        ["gluten free", "low sugar", "keto friendly", "non gmo", "dairy free", "plant based"],
        {"flavor": ["chocolate chip", "peanut butter", "cookies and cream", "almond", "salted caramel"],
         "size": ["12 count", "24 count"]}, (10, 45)),
    _pt("grocery", "Grocery & Gourmet Food › Pantry Staples › Cooking & Baking › Oils › Olive Oil",
        "olive oil", ["extra virgin olive oil", "olive oil"],
        ["cold pressed", "first harvest", "imported from italy"],
        ["organic", "kosher", "non gmo", "single origin", "unfiltered", "gluten free"],
        {"size": ["16.9 fl oz", "33.8 fl oz", "1 gallon"]}, (8, 60)),
    # ---------------------------------------------------------------- fashion
    _pt("fashion", "Clothing, Shoes & Jewelry › Men › Clothing › Shirts › T-Shirts",
        "t-shirt", ["t-shirt", "crew neck t-shirt", "v-neck t-shirt"],
        ["for men", "for women", "classic fit"],
        ["machine wash", "moisture wicking", "cotton", "slim fit", "breathable", "quick dry"],
        {"color": ["black", "white", "navy", "heather gray", "red", "olive green"],
         "size": ["small", "medium", "large", "x-large", "xx-large"]}, (8, 35)),
    _pt("fashion", "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
        "running shoes", ["running shoes", "walking shoes", "trail running shoes"],
        ["for men", "for women", "lightweight sneaker"],
        ["non slip", "rubber sole", "arch support", "breathable", "lace up", "memory foam"],
        {"color": ["black white", "all black", "gray", "navy blue", "pink"],
         "size": ["7", "8", "9", "10", "11", "12"]}, (25, 120)),
    _pt("fashion", "Clothing, Shoes & Jewelry › Women › Clothing › Dresses › Casual",
        "dress", ["maxi dress", "summer dress", "wrap dress"],
        ["for women", "floral print", "casual"],
        ["machine wash", "short sleeve", "high waist", "pockets", "loose fit", "polyester spandex"],
        {"color": ["floral blue", "black", "wine red", "green", "beige"],
         "size": ["small", "medium", "large", "x-large"]}, (18, 70)),
    _pt("fashion", "Clothing, Shoes & Jewelry › Men › Clothing › Active › Active Hoodies",
        "hoodie", ["pullover hoodie", "zip up hoodie", "hooded sweatshirt"],
        ["for men", "for women", "everyday wear"],
        ["machine wash", "long sleeve", "drawstring closure", "soft fleece", "relaxed fit", "kangaroo pocket"],
        {"color": ["charcoal", "black", "forest green", "maroon", "light gray"],
         "size": ["small", "medium", "large", "x-large", "xx-large"]}, (20, 65)),
    _pt("fashion",
        "Clothing, Shoes & Jewelry › Men › Accessories › Sunglasses & Eyewear Accessories › Sunglasses",
        "sunglasses", ["aviator sunglasses", "sunglasses", "retro sunglasses"],
        ["for men", "for women", "classic style"],
        ["uv protection", "lightweight", "scratch resistant", "metal frame", "polarized lens", "unisex"],
        {"color": ["gold brown", "silver blue", "black gray", "tortoise"]}, (10, 60)),
    # ---------------------------------------------------------------- furniture
    _pt("furniture", "Home & Kitchen › Furniture › Home Office Furniture › Home Office Chairs › Desk Chairs",
        "office chair", ["office chair", "ergonomic desk chair", "computer chair"],
        ["with armrests", "for home office", "swivel"],
        ["lumbar support", "height adjustable", "easy assembly", "high back", "mesh back", "heavy duty"],
        {"color": ["black", "gray", "white", "blue"]}, (60, 300)),
    _pt("furniture", "Home & Kitchen › Furniture › Living Room Furniture › Bookcases",
        "bookshelf", ["bookshelf", "bookcase", "storage shelf"],
        ["for living room", "for bedroom", "open shelving"],
        ["easy assembly", "solid wood", "space saving", "industrial style", "metal frame", "wall mounted"],
        {"color": ["rustic brown", "white", "black oak", "walnut"], "size": ["3 tier", "4 tier", "5 tier"]},
        (40, 200)),
    _pt("furniture", "Home & Kitchen › Furniture › Living Room Furniture › Tables › Coffee Tables",
        "coffee table", ["coffee table", "lift top coffee table", "round coffee table"],
        ["for living room", "modern design", "with storage"],
        ["easy assembly", "solid wood", "storage space", "mid century", "engineered wood", "tempered glass"],
        {"color": ["walnut", "white", "black", "natural oak"]}, (50, 260)),
    _pt("furniture", "Home & Kitchen › Furniture › Bedroom Furniture › Beds, Frames & Bases › Beds",
        "bed frame", ["platform bed frame", "metal bed frame", "upholstered bed frame"],
        ["with headboard", "no box spring needed", "noise free"],
        ["easy assembly", "heavy duty", "under bed storage", "wood slat support", "non slip",
         "mattress foundation"],
        {"size": ["twin", "full", "queen", "king"], "color": ["black", "gray", "white"]}, (90, 400)),
    _pt("furniture",
        "Home & Kitchen › Home Décor Products › Decorative Pillows, Inserts & Covers › Throw Pillow Covers",
        "throw pillow covers", ["throw pillow cover", "decorative pillow case", "cushion cover"],
        ["for couch", "for sofa", "farmhouse style"],
        ["machine washable", "hidden zipper", "soft velvet", "double sided", "fade resistant", "linen"],
        {"color": ["mustard yellow", "navy", "cream", "sage green", "blush pink"],
         "size": ["18 x 18 inch", "20 x 20 inch", "12 x 20 inch"]}, (8, 30)),
    # ---------------------------------------------------------------- electronics
    _pt("electronics", "Electronics › Headphones, Earbuds & Accessories › Earbuds",
        "wireless earbuds", ["wireless earbuds", "bluetooth earbuds", "true wireless earphones"],
        ["with charging case", "for iphone and android", "in-ear"],
        ["noise cancelling", "water resistant", "long battery life", "fast charging", "hands free",
         "bluetooth 5.0"],
        {"color": ["black", "white", "navy blue", "rose gold"]}, (15, 120)),
    _pt("electronics", "Electronics › Cell Phones & Accessories › Chargers & Power Adapters › Wall Chargers",
        "phone charger", ["usb c charger", "wall charger", "fast charger block"],
        ["for iphone", "for samsung galaxy", "travel ready"],
        ["fast charging", "compact size", "high speed", "foldable plug", "overheat protection",
         "universal compatibility"],
        {"color": ["white", "black"], "style": ["20w single port", "30w dual port", "65w three port"]}, (9, 45)),
    _pt("electronics", "Electronics › Television & Video › Accessories › Cables › HDMI Cables",
        "hdmi cable", ["hdmi cable", "hdmi cord", "hdmi 2.0 cable"],
        ["for tv", "for monitor", "for gaming console"],
        ["gold plated", "high speed", "4k", "ultra hd", "braided nylon", "ethernet"],
        {"size": ["3 feet", "6 feet", "10 feet", "15 feet"], "style": ["1 pack", "2 pack", "3 pack"]}, (5, 30)),
    _pt("electronics",
        "Electronics › Portable Audio & Video › Portable Speakers & Docks › Portable Bluetooth Speakers",
        "bluetooth speaker", ["bluetooth speaker", "portable speaker", "wireless speaker"],
        ["for outdoors", "for home and party", "mini"],
        ["waterproof", "long battery life", "stereo sound", "bass boost", "shockproof", "hands free"],
        {"color": ["black", "blue", "red", "camo"]}, (18, 110)),
    _pt("electronics", "Electronics › Wearable Technology › Smartwatches",
        "smart watch", ["smart watch", "fitness tracker watch", "smartwatch"],
        ["for men", "for women", "for android and ios"],
        ["heart rate monitor", "water resistant", "sleep tracking", "long battery life", "gps", "touch screen"],
        {"color": ["black", "silver", "rose pink", "midnight green"], "size": ["41mm", "45mm"]}, (30, 200)),
)

_BRANDS: dict[str, tuple[str, ...]] = {
    "beauty": ("Lumira", "Velora", "Glowna", "Purelle", "Silkara", "Bellisa", "Aurebe", "Nuvia", "Cosmira", "Radora"),
    "grocery": ("Harvest Lane", "Green Acre", "Sunfield", "Old Mill", "Mesa Verde", "Brightleaf", "Kettle Creek",
                "Nordic Farm", "Golden Grove", "Hillcrest"),
    "fashion": ("Northtrail", "Urbanic", "Coastline", "Vantero", "Hemway", "Pacelle", "Solvane", "Drift & Co",
                "Marlow", "Keystride"),
    "furniture": ("Oakhaven", "Nestwood", "Loftique", "Habitra", "Woodmere", "Casaform", "Timberly", "Homelyn",
                  "Rowley", "Archway"),
    "electronics": ("Voltix", "Sonara", "Zentek", "Ampero", "Nexbeam", "Pulsewave", "Orbix", "Linkor",
                    "Tecvolt", "Auralis"),
}

# Generic sentences for descriptions and bullet points. They never contain an attribute phrase, so the
# reward's text fallback (an attribute found in the title / bullets / description) only fires for a
# product's own attributes.
_GENERIC_BULLETS: dict[str, tuple[str, ...]] = {
    "beauty": ("Designed for everyday beauty routines.", "Suitable for travel and gym bags.",
               "Satisfaction guaranteed or your money back."),
    "grocery": ("Packed fresh in a resealable bag.", "Great for family meals and parties.",
                "Store in a cool and dry place."),
    "fashion": ("True to size; see the size chart for details.", "Perfect for daily wear and weekends.",
                "Easy returns within thirty days."),
    "furniture": ("All hardware and instructions included.", "Fits small apartments and large homes alike.",
                  "Backed by a one year warranty."),
    "electronics": ("Works with most phones, tablets and laptops.", "Ships with a user manual.",
                    "Backed by an eighteen month warranty."),
}

_REVIEW_BODIES: dict[int, tuple[str, ...]] = {
    5: ("Exactly as described, would buy again.", "Love it, great value for the money.",
        "Five stars, arrived early and works great."),
    4: ("Pretty good overall, minor issues with packaging.", "Does the job well, a bit pricey.",
        "Good quality, took a while to arrive."),
    3: ("It is okay, nothing special.", "Average product, expected a little more.",
        "Decent but the pictures look better."),
    2: ("Not what I expected.", "Quality could be better for this price."),
    1: ("Stopped working after a week.", "Did not match the description at all."),
}

# Price bounds an instruction may quote ("price lower than 40.00 dollars").
_PRICE_BOUNDS: tuple[float, ...] = (10, 20, 30, 40, 50, 60, 70, 80, 100, 120, 150, 200, 250, 300, 400, 500)

_ASIN_ALPHABET = string.ascii_uppercase + string.digits

_NON_ALNUM_RE = re.compile(r"[^a-z0-9.]+")


def normalize_phrase(text: str) -> str:
    """Lower-case, every run of characters other than letters / digits / ``.`` becomes one space, stripped.

    ``"Clip-In  Hair"`` -> ``"clip in hair"``. Used by the reward to compare attributes and options.
    """
    return _NON_ALNUM_RE.sub(" ", str(text).lower()).strip(" .")


def _title_case(phrase: str) -> str:
    return " ".join(word[:1].upper() + word[1:] for word in phrase.split(" "))


def _make_asin(rng: random.Random, taken: set[str]) -> str:
    while True:
        asin = "B0" + "".join(rng.choice(_ASIN_ALPHABET) for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _make_product(rng: random.Random, ptype: ProductType, asin: str, titles: set[frozenset[str]]) -> dict[str, Any]:
    brands = _BRANDS[ptype.category]
    for attempt in range(50):
        noun = rng.choice(ptype.nouns)
        attributes = rng.sample(ptype.attributes, rng.randint(3, 4))
        in_title = attributes[: rng.randint(1, 2)]
        descriptor = rng.choice(ptype.descriptors)
        brand = rng.choice(brands)
        if rng.random() < 0.5:
            title = f"{brand} {_title_case(in_title[0])} {_title_case(noun)}"
            rest = in_title[1:] + [descriptor]
        else:
            title = f"{brand} {_title_case(noun)}"
            rest = in_title + [descriptor]
        title += ", " + ", ".join(_title_case(part) for part in rest)
        if attempt >= 10:  # crowded corner of the catalog: add a model number
            title += f", Model {rng.choice(string.ascii_uppercase)}{rng.randint(10, 99)}"
        words = frozenset(normalize_phrase(title).split())
        # No title's words may be a subset of another's: then a search for an exact title always has a
        # query term the other products lack, which keeps the exact title on top of the BM25 ranking.
        if not any(words <= other or other <= words for other in titles):
            titles.add(words)
            break
    else:  # pragma: no cover - 50 collisions in a row would need an absurdly large catalog
        raise RuntimeError("could not draw a distinct product title")

    options: dict[str, list[str]] = {}
    for option_type, pool in ptype.options.items():
        count = rng.randint(2, len(pool))
        chosen = set(rng.sample(pool, count))
        options[option_type] = [value for value in pool if value in chosen]  # keep the pool's order

    low, high = ptype.price_range
    price = round(rng.uniform(low, high), 2)
    if price * 100 % 100 == 0:
        price -= 0.01
    price = round(price, 2)

    bullets = [f"{attr.upper()}: this {noun} is {attr}." for attr in attributes]
    bullets += rng.sample(_GENERIC_BULLETS[ptype.category], 2)
    description = (
        f"The {brand} {noun} is {', '.join(attributes[:-1])} and {attributes[-1]}. "
        f"{rng.choice(_GENERIC_BULLETS[ptype.category])}"
    )
    reviews = []
    for _ in range(rng.randint(2, 3)):
        score = rng.choice((5, 5, 5, 4, 4, 3, 2, 1))
        reviews.append({"score": score, "body": rng.choice(_REVIEW_BODIES[score])})
    return {
        "asin": asin,
        "name": title,
        "title": title,
        "category": ptype.category,
        "product_category": ptype.product_category,
        "query": ptype.query,
        "noun": noun,
        "attributes": list(attributes),
        "options": options,
        "pricing": [price],
        "price": price,
        "small_description": bullets,
        "full_description": description,
        "reviews": reviews,
        "rating": round(rng.uniform(3.0, 5.0), 1),
    }


def _join_and(parts: Sequence[str]) -> str:
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _option_phrase(option_type: str, value: str) -> str:
    if option_type == "color":
        return f"in {value} color"
    if option_type == "size":
        return f"in size {value}"
    if option_type == "flavor":
        return f"in {value} flavor"
    if option_type == "scent":
        return f"with {value} scent"
    if option_type == "style":
        return f"in {value} style"
    return f"with {option_type} {value}"


def _with_article(phrase: str) -> str:
    head = phrase.split(" ")[-1]
    if head.endswith("s") and not head.endswith("ss"):  # plural head noun: "i need running shoes"
        return phrase
    return ("an " if phrase[:1] in "aeiou" else "a ") + phrase


def instruction_for(
    noun: str, attributes: Sequence[str], goal_options: Mapping[str, str], price_upper: float, template: int
) -> str:
    """The WebShop-style instruction text of a goal (lower case, like WebShop's human instructions).

    ``template`` (0-3) picks the phrasing. Every attribute, option value and the price bound appears
    verbatim; the price is written with two decimals (``"price lower than 40.00 dollars"``).
    """
    options = "".join(", " + _option_phrase(t, v) for t, v in goal_options.items())
    price = f", and price lower than {price_upper:.2f} dollars"
    attrs = _join_and(list(attributes))
    template %= 4
    if template == 0:
        return f"i need {_with_article(noun)} which is {attrs}{options}{price}"
    if template == 1:
        return f"i am looking for {_with_article(' '.join(attributes) + ' ' + noun)}{options}{price}"
    if template == 2:
        return f"find me {_with_article(noun)} that is {attrs}{options}{price}"
    return f"i want to buy {_with_article(noun)} that is {attrs}{options}{price}"


def make_goal(product: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    """Draw a goal satisfied by ``product``: 1-3 of its attributes, a value for most option types,
    a price bound above its price, and the instruction text."""
    attributes = list(product["attributes"])
    goal_attributes = rng.sample(attributes, rng.randint(1, min(3, len(attributes))))
    goal_options: dict[str, str] = {}
    for option_type, values in product["options"].items():
        if values and rng.random() < 0.8:
            goal_options[option_type] = rng.choice(values)
    price = float(product["price"])
    bounds = [b for b in _PRICE_BOUNDS if b > price] or [math.ceil(price * 1.5 / 100) * 100]
    price_upper = float(rng.choice(bounds[:2]))
    noun = product.get("noun") or product["query"]
    return {
        "asin": product["asin"],
        "category": product["category"],
        "query": product["query"],
        "name": product["title"],
        "product_category": product["product_category"],
        "instruction_text": instruction_for(noun, goal_attributes, goal_options, price_upper, rng.randrange(4)),
        "attributes": goal_attributes,
        "goal_options": goal_options,
        "price_upper": price_upper,
        "price": price,
    }


@dataclass
class Catalog:
    """Products and goals of one shop. Treat as read-only once built (the simulator shares it across
    threads).

    Build with :func:`generate_catalog` (synthetic, seeded) or directly from hand-written lists
    (``Catalog(products, goals)``, e.g. in tests). ``num_test_goals``: the first that many goals form
    the test split.
    """

    products: list[dict[str, Any]]
    goals: list[dict[str, Any]]
    num_test_goals: int = 0
    seed: int | None = None
    _by_asin: dict[str, dict[str, Any]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_asin = {}
        for product in self.products:
            for key in ("asin", "title", "attributes", "options", "price"):
                if key not in product:
                    raise ValueError(f"product {product.get('asin', '?')!r} has no {key!r} field")
            asin = str(product["asin"]).upper()
            if asin in self._by_asin:
                raise ValueError(f"duplicate asin {asin!r} in catalog")
            self._by_asin[asin] = product
        for index, goal in enumerate(self.goals):
            for key in ("asin", "instruction_text", "attributes", "goal_options", "price_upper"):
                if key not in goal:
                    raise ValueError(f"goal {index} has no {key!r} field")
            if str(goal["asin"]).upper() not in self._by_asin:
                raise ValueError(f"goal {index} targets unknown asin {goal['asin']!r}")
        if not 0 <= self.num_test_goals <= len(self.goals):
            raise ValueError(f"num_test_goals={self.num_test_goals} outside [0, {len(self.goals)}]")

    def product(self, asin: str) -> dict[str, Any]:
        """The product with this ASIN (case-insensitive); ``KeyError`` if unknown."""
        return self._by_asin[str(asin).upper()]

    def has_product(self, asin: str) -> bool:
        return str(asin).upper() in self._by_asin

    def goal(self, index: int) -> dict[str, Any]:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.goals):
            raise IndexError(f"goal index {index!r} outside [0, {len(self.goals)})")
        return self.goals[index]

    def split_indices(self, split: str) -> range:
        """Goal indices of ``split``: ``"test"`` = ``[0, num_test_goals)``, ``"train"`` = the rest,
        ``"all"`` = every goal."""
        if split == "test":
            return range(0, self.num_test_goals)
        if split == "train":
            return range(self.num_test_goals, len(self.goals))
        if split == "all":
            return range(0, len(self.goals))
        raise ValueError(f"unknown split {split!r}; valid: train, test, all")


def generate_catalog(
    seed: int = DEFAULT_SEED,
    num_products: int = DEFAULT_NUM_PRODUCTS,
    num_goals: int = DEFAULT_NUM_GOALS,
    num_test_goals: int = DEFAULT_NUM_TEST_GOALS,
    product_types: Iterable[ProductType] = PRODUCT_TYPES,
) -> Catalog:
    """A synthetic catalog: ``num_products`` products spread evenly over the product types (in a seeded
    order), and ``num_goals`` goals whose target products are drawn uniformly.

    Deterministic in its arguments. ``num_test_goals`` is clipped to ``num_goals``.
    """
    if num_products < 1:
        raise ValueError(f"num_products must be >= 1, got {num_products}")
    if num_goals < 0:
        raise ValueError(f"num_goals must be >= 0, got {num_goals}")
    types = list(product_types)
    rng = random.Random(f"webshop-catalog:{seed}")
    asins: set[str] = set()
    titles: set[frozenset[str]] = set()
    products: list[dict[str, Any]] = []
    order: list[ProductType] = []
    while len(order) < num_products:
        batch = list(types)
        rng.shuffle(batch)
        order += batch
    for ptype in order[:num_products]:
        products.append(_make_product(rng, ptype, _make_asin(rng, asins), titles))
    goal_rng = random.Random(f"webshop-goals:{seed}")
    goals = [make_goal(products[goal_rng.randrange(len(products))], goal_rng) for _ in range(num_goals)]
    return Catalog(products, goals, num_test_goals=min(num_test_goals, num_goals), seed=seed)


@functools.lru_cache(maxsize=8)
def get_catalog(
    seed: int = DEFAULT_SEED,
    num_products: int = DEFAULT_NUM_PRODUCTS,
    num_goals: int = DEFAULT_NUM_GOALS,
    num_test_goals: int = DEFAULT_NUM_TEST_GOALS,
) -> Catalog:
    """Cached :func:`generate_catalog` (one copy per process and argument tuple; do not mutate it)."""
    return generate_catalog(seed, num_products, num_goals, num_test_goals)
