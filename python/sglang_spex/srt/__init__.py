"""Everything that touches SGLang internals (hooks, routes, the in-process engine port)."""
