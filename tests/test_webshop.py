"""WebShop: catalog, BM25, simulator pages / actions / reward, the HTTP backend, the env adapter."""

from __future__ import annotations

import socket

import pytest

from async_rl.envs.base import make_env, registered_env_names
from async_rl.envs.calls import run_env_reset, run_env_step
from async_rl.envs.webshop import (
    BM25Index,
    Catalog,
    Shop,
    WebShopEnv,
    WebShopHTTPServer,
    WebShopServerError,
    WebShopSimulator,
    admissible_actions,
    expert_actions,
    generate_catalog,
    get_shop,
    make_webshop_tasks,
    parse_action,
    webshop_env_kwargs,
    webshop_reward,
)
from async_rl.envs.webshop.server import WebShopClient

# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def shop() -> Shop:
    return get_shop()


def _hand_catalog() -> Catalog:
    """Three products and one goal, small enough to compute rewards by hand."""
    alpha = {
        "asin": "B000000001", "title": "Alpha Natural Looking Hair Extension, Wavy",
        "attributes": ["natural looking", "heat resistant"],
        "options": {"color": ["black", "brown"], "size": ["14 inch", "18 inch"]}, "price": 30.0,
        "small_description": ["Soft and light."], "full_description": "A hair extension.",
        "reviews": [{"score": 5, "body": "Great."}], "rating": 4.5,
        "product_category": "Beauty", "query": "hair extensions", "category": "beauty",
    }
    beta = {
        "asin": "B000000002", "title": "Beta Hair Extension, Heat Resistant",
        "attributes": ["tangle free"], "options": {"color": ["brown", "blonde"]}, "price": 45.0,
        "small_description": ["Thick."], "full_description": "Another hair extension.", "reviews": [],
        "product_category": "Beauty", "query": "hair extensions", "category": "beauty",
    }
    gamma = {
        "asin": "B000000003", "title": "Gamma Running Shoes", "attributes": ["non slip"],
        "options": {}, "price": 20.0, "small_description": [], "full_description": "Shoes.", "reviews": [],
        "product_category": "Fashion", "query": "running shoes", "category": "fashion",
    }
    goal = {
        "asin": "B000000001",
        "instruction_text": "i need a hair extension which is natural looking and heat resistant, in brown color, "
                            "in size 18 inch, and price lower than 40.00 dollars",
        "attributes": ["natural looking", "heat resistant"],
        "goal_options": {"color": "brown", "size": "18 inch"},
        "price_upper": 40.0,
    }
    return Catalog([alpha, beta, gamma], [goal], num_test_goals=0)


@pytest.fixture()
def hand_shop() -> Shop:
    return Shop(_hand_catalog())


def _buy(shop: Shop, actions: list[str], goal_index: int = 0):
    sim = WebShopSimulator(shop)
    sim.reset(goal_index)
    reply = None
    for action in actions:
        reply = sim.step(action)
        assert not reply.info["invalid_action"], action
    return reply


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------------ catalog


def test_catalog_is_deterministic_and_in_webshop_schema():
    a = generate_catalog(seed=3, num_products=120, num_goals=50, num_test_goals=10)
    b = generate_catalog(seed=3, num_products=120, num_goals=50, num_test_goals=10)
    c = generate_catalog(seed=4, num_products=120, num_goals=50, num_test_goals=10)
    assert a.products == b.products and a.goals == b.goals
    assert a.products != c.products
    assert len({p["asin"] for p in a.products}) == 120
    assert len({p["title"] for p in a.products}) == 120
    for product in a.products:
        for key in ("asin", "name", "title", "category", "product_category", "query", "attributes", "options",
                    "pricing", "price", "small_description", "full_description", "reviews", "rating"):
            assert key in product
        assert product["asin"].startswith("B0") and len(product["asin"]) == 10
        values = [v for vs in product["options"].values() for v in vs]
        assert len(values) == len(set(values))
    for goal in a.goals:  # every goal is satisfiable by its target, and the instruction names everything
        target = a.product(goal["asin"])
        assert set(goal["attributes"]) <= set(target["attributes"])
        for option_type, value in goal["goal_options"].items():
            assert value in target["options"][option_type]
            assert value in goal["instruction_text"]
        assert target["price"] < goal["price_upper"]
        assert f"price lower than {goal['price_upper']:.2f} dollars" in goal["instruction_text"]
        assert all(attr in goal["instruction_text"] for attr in goal["attributes"])
    assert list(a.split_indices("test")) == list(range(10))
    assert list(a.split_indices("train")) == list(range(10, 50))


# ------------------------------------------------------------------------------------------ BM25


def test_bm25_ranks_the_matching_document_first():
    index = BM25Index(["red running shoes for men", "blue running shoes", "red dress", "green tea bags"])
    ranked = index.search("red shoes")
    assert ranked[0][0] == 0
    assert {doc for doc, _ in ranked} == {0, 1, 2}
    assert index.search("tea bag")[0][0] == 3  # light plural stemming
    assert index.search("unknownword") == []


def test_exact_title_query_ranks_that_product_first(shop):
    for product in shop.catalog.products:
        assert shop.search(product["title"], 50)[0] == product["asin"], product["title"]


# ------------------------------------------------------------------------------------------ simulator


def test_expert_purchase_gets_reward_one(shop):
    for goal_index in range(0, 2000, 40):
        reply = _buy(shop, expert_actions(shop.catalog, goal_index), goal_index)
        assert reply.done and reply.reward == 1.0
        assert reply.info["success"] is True and reply.info["score"] == 1.0
        assert reply.info["purchased"]["asin"] == shop.catalog.goal(goal_index)["asin"]


def test_search_click_options_buy_on_hand_catalog(hand_shop):
    sim = WebShopSimulator(hand_shop)
    first = sim.reset(0)
    assert first.observation.startswith("WebShop [SEP] Instruction: [SEP] i need a hair extension")
    assert first.observation.endswith(" [SEP] Search")
    assert first.available_actions == {"has_search_bar": True, "clickables": []}
    assert admissible_actions(first.available_actions) == ["search[<your query>]"]

    results = sim.step("search[natural looking hair extension]")
    assert " [SEP] Back to Search [SEP] Page 1 (Total results: 2) [SEP] B000000001 [SEP] Alpha" in results.observation
    assert results.available_actions["clickables"] == ["back to search", "b000000001", "b000000002"]

    item = sim.step("click[b000000001]")
    assert item.observation.split(" [SEP] ")[-14:] == [
        "< Prev", "color", "black", "brown", "size", "14 inch", "18 inch", "Alpha Natural Looking Hair Extension, Wavy",
        "Price: $30.00", "Rating: 4.5", "Description", "Features", "Reviews", "Buy Now"]
    assert item.available_actions["clickables"] == [
        "back to search", "< prev", "black", "brown", "14 inch", "18 inch", "description", "features", "reviews",
        "buy now"]
    picked = sim.step("click[Brown]")  # click targets are case-insensitive
    assert "You have clicked brown." in picked.observation and sim.selected_options == {"color": "brown"}
    sim.step("click[black]")  # another value of the same type replaces it
    sim.step("click[brown]")
    sim.step("click[18 inch]")
    assert sim.selected_options == {"color": "brown", "size": "18 inch"}
    bought = sim.step("click[buy now]")
    assert bought.done and bought.reward == 1.0 and bought.info["success"] is True
    assert bought.info["reward_details"] == {"attribute_matches": 2, "option_matches": 2, "price_ok": 1,
                                             "num_goal_attributes": 2, "num_goal_options": 2}
    assert bought.info["purchased"] == {"asin": "B000000001", "options": {"color": "brown", "size": "18 inch"},
                                        "price": 30.0}
    with pytest.raises(RuntimeError):
        sim.step("click[buy now]")


def test_partial_matches_give_the_hand_computed_reward(hand_shop):
    # goal: 2 attributes + 2 options + price -> denominator 5
    wrong_color = _buy(hand_shop, ["search[alpha]", "click[b000000001]", "click[black]", "click[18 inch]",
                                   "click[buy now]"])
    assert wrong_color.reward == pytest.approx(4 / 5) and wrong_color.info["success"] is False
    no_options = _buy(hand_shop, ["search[alpha]", "click[b000000001]", "click[buy now]"])
    assert no_options.reward == pytest.approx(3 / 5)
    # beta: "heat resistant" only in its title (text fallback), brown matches, 18 inch missing, $45 > $40
    beta = _buy(hand_shop, ["search[beta]", "click[b000000002]", "click[brown]", "click[buy now]"])
    assert beta.reward == pytest.approx(2 / 5)
    assert beta.info["reward_details"] == {"attribute_matches": 1, "option_matches": 1, "price_ok": 0,
                                           "num_goal_attributes": 2, "num_goal_options": 2}
    # gamma: nothing but the price -> 1/5
    gamma = _buy(hand_shop, ["search[running shoes]", "click[b000000003]", "click[buy now]"])
    assert gamma.reward == pytest.approx(1 / 5)
    # the function itself, with fuzzy-free normalisation (case, punctuation)
    goal = hand_shop.catalog.goal(0)
    product = hand_shop.catalog.product("B000000001")
    assert webshop_reward(goal, product, {"color": "Brown", "size": "18-inch"})[0] == 1.0


def test_invalid_actions_are_flagged_and_leave_the_page_unchanged(hand_shop):
    sim = WebShopSimulator(hand_shop)
    start = sim.reset(0).observation
    for bad in ["click[buy now]", "search[]", "search[   ]", "buy it", "click[b000000001]", "search[x"]:
        reply = sim.step(bad)
        assert reply.info["invalid_action"] is True, bad
        assert reply.observation == start and reply.reward == 0.0 and not reply.done
    results = sim.step("search[hair extension]").observation
    for bad in ["search[shoes]", "click[b000000003]", "click[next >]", "click[< prev]", "click[buy now]"]:
        reply = sim.step(bad)
        assert reply.info["invalid_action"] is True and reply.observation == results, bad
    assert sim.turn == 12


def test_pagination_and_navigation(shop):
    sim = WebShopSimulator(shop)
    sim.reset(0)
    first = sim.step("search[easy assembly]")  # 140 matches, capped at 50
    assert "Page 1 (Total results: 50)" in first.observation
    assert "< prev" not in first.available_actions["clickables"]
    pages = [[c for c in first.available_actions["clickables"] if c.startswith("b0")]]
    assert len(pages[0]) == 10
    for number in range(2, 6):
        reply = sim.step("click[next >]")
        assert f"Page {number} (Total results: 50)" in reply.observation
        assert "< prev" in reply.available_actions["clickables"]
        pages.append([c for c in reply.available_actions["clickables"] if c.startswith("b0")])
    assert "next >" not in reply.available_actions["clickables"]
    assert sim.step("click[next >]").info["invalid_action"] is True
    assert len({asin for page in pages for asin in page}) == 50  # 5 disjoint pages of 10
    back = sim.step("click[< prev]")
    assert "Page 4 (Total results: 50)" in back.observation
    # item -> sub-page -> item (selection kept) -> results (same page) -> search
    asin = pages[3][0]
    item = sim.step(f"click[{asin}]")
    value = next(c for c in item.available_actions["clickables"]
                 if c not in ("back to search", "< prev", "description", "features", "reviews", "buy now"))
    sim.step(f"click[{value}]")
    description = sim.step("click[description]")
    assert description.available_actions["clickables"] == ["back to search", "< prev"]
    assert description.observation.split(" [SEP] ")[-1] == shop.catalog.product(asin)["full_description"]
    item_again = sim.step("click[< prev]")
    assert f"You have clicked {value}." in item_again.observation
    assert "Page 4 (Total results: 50)" in sim.step("click[< prev]").observation
    home = sim.step("click[back to search]")
    assert home.available_actions["has_search_bar"] is True and home.observation.endswith("[SEP] Search")


def test_turn_limit_ends_the_episode_with_zero_reward(hand_shop):
    sim = WebShopSimulator(hand_shop, max_turns=3)
    sim.reset(0)
    sim.step("search[alpha]")
    sim.step("click[b000000001]")
    last = sim.step("click[brown]")
    assert last.done and last.reward == 0.0 and last.info["out_of_turns"] is True


# ------------------------------------------------------------------------------------------ env


def test_env_is_registered_and_config_kwargs():
    assert "webshop" in registered_env_names()
    assert isinstance(make_env("webshop"), WebShopEnv)
    kwargs = webshop_env_kwargs({"backend": "server", "server_url": "http://h:1", "server_timeout_s": 5.0,
                                 "max_turns": 9, "num_tasks": 3, "history_length": None})
    assert kwargs == {"backend": "server", "server_url": "http://h:1", "timeout_s": 5.0, "max_turns": 9}
    with pytest.raises(ValueError):
        WebShopEnv(backend="lucene")
    with pytest.raises(ValueError):
        WebShopEnv(backend="server")


def test_parse_action_takes_the_last_tag():
    assert parse_action("<think>maybe <action>click[x]</action></think> <action> search[red  shoes] </action>") == \
        "search[red shoes]"
    assert parse_action("search[red shoes]") is None
    assert parse_action("<action> </action>") is None
    assert parse_action("<ACTION>click[buy now]</ACTION>") == "click[buy now]"


def test_tasks_are_seeded_and_split():
    train = make_webshop_tasks(30, seed=1, split="train")
    assert train == make_webshop_tasks(30, seed=1, split="train")
    assert make_webshop_tasks(10, seed=1, split="train") == train[:10]
    assert train != make_webshop_tasks(30, seed=2, split="train")
    test = make_webshop_tasks(300, seed=1, split="test")  # more than the 200 test goals: a second pass
    assert {t["goal_index"] for t in test} == set(range(200))
    assert all(t["goal_index"] >= 200 for t in train)
    assert len({t["id"] for t in train}) == 30
    assert train[0]["instruction"] == get_shop().catalog.goal(train[0]["goal_index"])["instruction_text"]


def test_env_episode_prompts_invalid_actions_and_success(shop):
    task = make_webshop_tasks(1, seed=5, split="test")[0]
    env = WebShopEnv(shop=shop)
    prompt = env.reset(task)
    assert task["instruction"] in prompt and "search[<your query>]" in prompt and "<action>" in prompt
    no_tag = env.step("I will search for it")
    assert no_tag.info["invalid_action"] is True and no_tag.info["action"] is None and not no_tag.done
    assert "Current page: Search" in no_tag.observation
    actions = expert_actions(shop.catalog, task["goal_index"])
    results = None
    for i, action in enumerate(actions):
        results = env.step(f"<think>step {i}</think>\n<action>{action}</action>")
        assert results.info["invalid_action"] is False
        if i == 0:
            assert f"[Step 2] Action: {action}" in results.observation  # recent history
            assert "Admissible actions: click[back to search]" in results.observation
    assert results.done and results.reward == 1.0 and results.observation == ""
    assert results.info["success"] is True and results.info["score"] == 1.0 and results.info["turn"] == len(actions) + 1
    with pytest.raises(RuntimeError):
        env.step("<action>click[buy now]</action>")


def test_env_turn_limit_and_instruction_check(shop):
    env = WebShopEnv(shop=shop, max_turns=2)
    task = make_webshop_tasks(1, seed=0)[0]
    env.reset(task)
    assert not env.step("nope").done
    last = env.step("<action>click[buy now]</action>")
    assert last.done and last.reward == 0.0 and last.info["out_of_turns"] is True and last.info["invalid_action"]
    with pytest.raises(ValueError, match="another catalog"):
        env.reset({**task, "instruction": "i need something else entirely"})
    with pytest.raises(KeyError):
        env.reset({"id": "x"})


# ------------------------------------------------------------------------------------------ server


def _play(env: WebShopEnv, task: dict, texts: list[str]) -> list[tuple]:
    trace = [env.reset(task)]
    for text in texts:
        result = env.step(text)
        trace.append((result.observation, result.reward, result.done, result.info))
        if result.done:
            break
    return trace


def test_server_backend_matches_the_in_process_simulator(shop):
    tasks = make_webshop_tasks(2, seed=7, split="test")
    scripts = [
        ["<action>search[" + shop.catalog.goal(tasks[0]["goal_index"])["attributes"][0] + "]</action>",
         "no action here", "<action>click[buy now]</action>", "<action>click[next >]</action>",
         "<action>click[< prev]</action>", "<action>click[back to search]</action>"]
        + [f"<action>{a}</action>" for a in expert_actions(shop.catalog, tasks[0]["goal_index"])],
        # a partial purchase: the target without picking options
        [f"<action>{a}</action>" for a in expert_actions(shop.catalog, tasks[1]["goal_index"])[:2]]
        + ["<action>click[buy now]</action>"],
    ]
    with WebShopHTTPServer(shop, port=0) as server:
        assert WebShopClient(server.url).health()["num_goals"] == len(shop.catalog.goals)
        for task, script in zip(tasks, scripts):
            local = _play(WebShopEnv(shop=shop), task, script)
            remote_env = WebShopEnv(backend="server", server_url=server.url, timeout_s=10)
            remote = _play(remote_env, task, script)
            remote_env.close()
            assert remote == local
            assert local[-1][2] is True
        assert local[-1][1] == pytest.approx(local[-1][3]["score"]) and local[-1][1] < 1.0


def test_server_protocol_errors_raise(shop):
    with WebShopHTTPServer(shop, port=0) as server:
        client = WebShopClient(server.url, timeout_s=5)
        with pytest.raises(WebShopServerError, match="404"):
            client.step("never-reset", "search[x]")
        with pytest.raises(WebShopServerError, match="400"):
            client.reset("s", 10**9)
        client.reset("s", 0)
        assert client.close_session("s") is True and client.close_session("s") is False


def test_unreachable_server_aborts_instead_of_scoring(shop):
    env = WebShopEnv(backend="server", server_url=f"http://127.0.0.1:{_free_port()}", timeout_s=2)
    with pytest.raises(WebShopServerError, match="unreachable"):
        env.reset({"goal_index": 0})
    assert run_env_reset(env, {"goal_index": 0}, timeout_s=10).aborted

    server = WebShopHTTPServer(shop, port=0).start()
    env = WebShopEnv(backend="server", server_url=server.url, timeout_s=2)
    env.reset(make_webshop_tasks(1, seed=0)[0])
    server.close()  # the server goes away mid-episode
    with pytest.raises(WebShopServerError):
        env.step("<action>search[shoes]</action>")
    outcome = run_env_step(env, "<action>search[shoes]</action>", timeout_s=10)
    assert outcome.aborted and outcome.result is None and "WebShopServerError" in outcome.error
    env.close()  # best effort, must not raise


def test_tasks_from_goal_indices_and_config():
    real = make_webshop_tasks(5, seed=0, split="train", goal_indices=range(1500, 12087))
    assert all(1500 <= t["goal_index"] < 12087 and "instruction" not in t for t in real)
    from async_rl.envs.webshop import make_webshop_tasks_from_config

    assert make_webshop_tasks_from_config({"num_tasks": 4, "split": "test"}, seed=2) == \
        make_webshop_tasks(4, seed=2, split="test")
    ranged = make_webshop_tasks_from_config({"num_tasks": 3, "goal_range": [0, 500]}, seed=2)
    assert all(0 <= t["goal_index"] < 500 for t in ranged)
