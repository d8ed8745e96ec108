"""One mapping of ``POST /tot/search`` error answers, shared by the CLI, the DSL and the demo."""

import httpx
import pytest

from sglang_spex import demo
from sglang_spex.tot.http_port import NotASpexServer, check_search_answer
from sglang_spex.tot.validation import SearchSpecError

URL = "http://127.0.0.1:1/tot/search"


def answer(status: int, **kw) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("POST", URL), **kw)


def test_a_400_names_the_servers_field():
    with pytest.raises(SearchSpecError) as e:
        check_search_answer(answer(400, json={"error": {"field": "policy.width", "reason": "must be >= 1"}}))
    assert (e.value.field, e.value.reason) == ("policy.width", "must be >= 1")


def test_a_400_without_the_plugins_body_is_an_http_error_on_one_line():
    with pytest.raises(httpx.HTTPStatusError) as e:
        check_search_answer(answer(400, text="bad\nrequest\n  body"))
    assert str(e.value) == "search: HTTP 400: bad request body"


def test_a_404_says_what_the_url_is_instead():
    with pytest.raises(NotASpexServer, match="not a sglang-spex server"):
        check_search_answer(answer(404, json={"detail": "Not Found"}))


@pytest.mark.parametrize("status", [429, 500, 503])
def test_other_errors_keep_the_status_and_the_start_of_the_body(status):
    with pytest.raises(httpx.HTTPStatusError) as e:
        check_search_answer(answer(status, text="x" * 5000))
    assert str(e.value).startswith(f"search: HTTP {status}: x") and len(str(e.value)) < 600


def test_a_200_passes():
    check_search_answer(answer(200, json={"status": "done"}))


def test_the_demo_reports_a_refused_spec_in_one_line(monkeypatch):
    def refused(url, **kw):
        return answer(400, json={"error": {"field": "question", "reason": "the prompt is too long"}})

    monkeypatch.setattr(demo.httpx, "post", refused)
    with pytest.raises(demo.DemoError) as e:
        demo.run_arm("http://127.0.0.1:1", {}, [demo.get_task("toy_add").questions(1, seed=0)[0]])
    assert str(e.value) == "http://127.0.0.1:1/tot/search: question: the prompt is too long"
