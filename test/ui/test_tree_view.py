"""The live tree view in a real headless browser (Debian's Chromium driven by Playwright) on the tiny server.

One SPEX search is started from the page (REBASE, BFS strict cancel makes cancelled speculative nodes); the
drawn tree must match the result, speculative work must be styled as such, and a replay of the saved result
must draw the same tree. The ``browser`` fixture is in ``conftest.py``; ``test_tree_view_page.py`` drives the
page against a mocked server.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Tuple

import pytest
import requests

SPEC = {
    "policy": {"name": "rebase", "width": 4, "max_depth": 3},
    "step": {"max_tokens": 6, "stop": ["\n\n"], "temperature": 1.0},
    "reward": {"type": "logprob"},
    "seed": 0,
    "speculation": {"enabled": True},
}
DRAWN = "[...document.querySelectorAll('circle.node')].map(c => [c.dataset.path, c.getAttribute('class')])"


def drawn(page) -> List[Tuple[str, str]]:
    return sorted(tuple(x) for x in page.evaluate(DRAWN))


def engine_statuses(rows: List[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """(path, engine status) of the drawn nodes of the primary tree."""
    return sorted((p, c.split(" status-")[1].split()[0]) for p, c in rows if " ghost" not in c)


@pytest.fixture(scope="module")
def live(spex_server, browser, tmp_path_factory) -> Dict[str, Any]:
    """Start one search from the page and wait for its result; screenshot under the test's tmp dir."""
    page = browser.new_page()
    errors: List[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(spex_server.url + "/tot/ui")
    page.evaluate("document.querySelector('details').open = true")
    page.fill("#question", "What is 12 + 7?")
    page.fill("#spec", json.dumps(SPEC))
    page.click("#start")
    page.wait_for_selector("body[data-state=done], body[data-state=error]", timeout=120_000)
    assert page.get_attribute("body", "data-state") == "done", page.text_content("#status")
    shot = tmp_path_factory.mktemp("ui") / "tree.png"
    page.screenshot(path=str(shot), full_page=True)
    out = {
        "result": page.evaluate("window.spexUI.result"),
        "drawn": drawn(page),
        "styles": page.evaluate(
            "Object.fromEntries(['show-primary', 'show-adopted', 'show-cancelled'].map(k => {"
            " const c = document.querySelector('circle.' + k);"
            " return [k, c ? [getComputedStyle(c).fill, getComputedStyle(c).strokeDasharray] : null]; }))"
        ),
        "screenshot": shot,
        "errors": errors,
        "tmp": shot.parent,
    }
    page.close()
    return out


def test_page_draws_the_search(live, spex_server):
    res = live["result"]
    assert res["status"] == "done" and not live["errors"]
    assert live["screenshot"].stat().st_size > 0
    tree = [(p, c) for p, c in live["drawn"] if " ghost" not in c]
    ghosts = [(p, c) for p, c in live["drawn"] if " ghost" in c]
    assert len(tree) == len(res["nodes"])  # every node of the result, nothing else, is in the tree
    assert sorted(p for p, _ in tree) == sorted(n["path"] for n in res["nodes"])
    # the same result through the plain route
    assert requests.get(f"{spex_server.url}/tot/search/{res['search_id']}", timeout=30).json()["num_nodes"] == (
        len(res["nodes"]) - 1
    )
    spec = res["speculation"]
    adopted = [p for p, c in tree if "show-adopted" in c]
    assert spec["hits"] > 0 and sorted(adopted) == sorted(res["ui"]["adopted"]) and len(adopted) == spec["hits"]
    cancelled = [p for p, c in ghosts if "show-cancelled" in c]
    # every cancelled speculative node is drawn, also one aborted between two of the watcher's reads
    assert 0 < len(cancelled) == spec["cancelled"], spec
    assert all(p not in {n["path"] for n in res["nodes"]} for p, _ in ghosts)
    styles = live["styles"]
    assert styles["show-adopted"][0] != styles["show-primary"][0]
    assert styles["show-cancelled"][0] != styles["show-primary"][0] and styles["show-cancelled"][1] != "none"


def test_replay_of_the_saved_result_draws_the_same_tree(live, spex_server, browser):
    saved = live["tmp"] / "result.json"
    saved.write_text(json.dumps(live["result"]))
    page = browser.new_page()
    page.goto(spex_server.url + "/tot/ui")
    page.set_input_files("#replay-file", str(saved))
    page.wait_for_selector("body[data-state=done]", timeout=30_000)
    assert drawn(page) == live["drawn"]
    # the server's own result JSON (no `ui` section): the same nodes with the same engine statuses
    plain = requests.get(f"{spex_server.url}/tot/search/{live['result']['search_id']}", timeout=30).json()["result"]
    page.evaluate("r => window.spexReplay(r)", plain)
    assert engine_statuses(drawn(page)) == engine_statuses(live["drawn"])
    page.close()


def test_page_and_assets_are_served_from_the_package(spex_server):
    page = requests.get(spex_server.url + "/tot/ui", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/tot/ui/static/tree.js" in page.text
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", page.text)  # nothing from elsewhere
    js = requests.get(spex_server.url + "/tot/ui/static/tree.js", timeout=30)
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    bad = requests.get(spex_server.url + "/tot/ui/static/secret.py", timeout=30)
    assert bad.status_code == 404 and bad.json()["error"]["field"] == "name"
    gone = requests.get(spex_server.url + "/tot/ui/events/nope", timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["field"] == "search_id"
