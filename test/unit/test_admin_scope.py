"""Which plugin routes carry SGLang's ADMIN_OPTIONAL auth level, and SGLang's decision on them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from sglang.srt.utils.auth import AuthLevel, decide_request_auth

from sglang_spex.config import SpexConfig
from sglang_spex.profile import routes as profile_routes
from sglang_spex.respec import routes as respec_routes
from sglang_spex.srt import admin_scope, control_routes, dp_drafter_update, search_service


def _app() -> FastAPI:
    app = FastAPI()
    search_service.install(app)
    control_routes.install(app)
    profile_routes.install(app, SimpleNamespace(cfg=SpexConfig()))
    respec_routes.install(app, learner=object())
    respec_routes.install_drafter(app)
    dp_drafter_update.install(app)
    return app


def _levels(app: FastAPI) -> dict:
    return {
        (m, r.path): getattr(r.endpoint, "_auth_level", AuthLevel.NORMAL)
        for r in app.router.routes
        if hasattr(r, "methods")
        for m in r.methods
    }


def test_every_admin_route_is_marked_and_no_other():
    app = _app()
    marked = admin_scope.apply(app)
    assert sorted(marked) == sorted(admin_scope.ADMIN_ROUTES)
    levels = _levels(app)
    for key, level in levels.items():
        want = AuthLevel.ADMIN_OPTIONAL if key in admin_scope.ADMIN_ROUTES else AuthLevel.NORMAL
        assert level == want, key
    for key in [("POST", "/tot/search"), ("GET", "/tot/search/{search_id}"), ("DELETE", "/tot/search/{search_id}"),
                ("GET", "/spex/stats"), ("GET", "/spex/profile"), ("GET", "/respec/state"), ("GET", "/respec/drafter")]:  # fmt: skip
        assert levels[key] == AuthLevel.NORMAL, key


@pytest.mark.parametrize(
    "api_key, admin_key, header, allowed",
    [
        ("u", "a", "Bearer u", False),  # both keys set: the user key is refused on admin routes
        ("u", "a", "Bearer a", True),
        ("u", "a", None, False),
        ("u", None, "Bearer u", True),  # only --api-key: that key opens them
        (None, None, None, True),  # no keys: open, as SGLang's own admin routes
    ],
)
def test_sglang_decides_admin_routes_as_its_own(api_key, admin_key, header, allowed):
    level = _levels(_app_marked())[("POST", "/spex/budget")]
    decision = decide_request_auth(
        method="POST",
        path="/spex/budget",
        authorization_header=header,
        api_key=api_key,
        admin_api_key=admin_key,
        auth_level=level,
    )
    assert decision.allowed is allowed


def _app_marked() -> FastAPI:
    app = _app()
    admin_scope.apply(app)
    return app


def test_a_shared_endpoint_is_refused():
    app = FastAPI()

    async def shared():
        return {}

    app.add_api_route("/spex/budget", shared, methods=["POST"])
    app.add_api_route("/spex/stats", shared, methods=["GET"])
    with pytest.raises(RuntimeError, match="shares its endpoint"):
        admin_scope.apply(app)
