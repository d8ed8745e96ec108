"""The plugin inside SGLang: hooks, routes, the in-process engine port, and the scheduler-side state they keep
(SGLang objects are read through ``adapters/`` where several hooks share the access)."""
