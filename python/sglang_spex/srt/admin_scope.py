"""The plugin's admin-scoped routes, marked with SGLang's own auth levels (touch point W5).

SGLang's API-key middleware (``sglang.srt.utils.auth.add_api_key_middleware``, installed by SGLang's HTTP server
when ``--api-key`` or ``--admin-api-key`` is set) reads each endpoint's auth level. Routes that change server-wide
state or reach other clients' work are marked ``AuthLevel.ADMIN_OPTIONAL``, the level of SGLang's own admin routes
(``/flush_cache``, ``/update_weights_from_tensor``): with ``--admin-api-key`` only that key opens them (the plain
``--api-key`` gets 401), with only ``--api-key`` that key does, with neither they are open. Every other plugin route
keeps SGLang's normal level (``--api-key`` when set). A search's own routes (``GET``/``DELETE /tot/search/{id}``)
stay normal: its id, 128 random bits unless the caller chose one, is the caller's handle on it.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from sglang.srt.utils.auth import AuthLevel, auth_level

ADMIN_ROUTES: Tuple[Tuple[str, str], ...] = (
    ("POST", "/spex/budget"),
    ("POST", "/spex/knobs"),
    ("POST", "/spex/cancel"),
    ("POST", "/spex/promote"),
    ("POST", "/spex/protect"),
    ("POST", "/spex/release"),
    ("POST", "/spex/profile"),
    ("POST", "/respec/rollouts"),
    ("POST", "/respec/policy"),
    ("POST", "/respec/drafter"),
    ("POST", "/respec/drafter/update_weights_from_tensor"),
    ("GET", "/tot/searches"),
)


def apply(app: Any) -> List[Tuple[str, str]]:
    """Mark the admin routes of ``app`` (those it has); returns the (method, path) pairs marked. An endpoint
    function shared with a route that is not admin-scoped is refused (its level would leak to that route)."""
    marked, admin = [], set(ADMIN_ROUTES)
    routes = [r for r in app.router.routes if hasattr(r, "methods") and hasattr(r, "endpoint")]
    for route in routes:
        keys = {(m, route.path) for m in route.methods}
        if not keys & admin:
            continue
        if not keys <= admin or any(o.endpoint is route.endpoint and o is not route for o in routes):
            raise RuntimeError(f"admin route {route.path} shares its endpoint; give it its own function")
        auth_level(AuthLevel.ADMIN_OPTIONAL)(route.endpoint)
        marked.extend(sorted(keys))
    return marked
