"""SPEX: speculative execution for ToT search — one module per mechanism (T1 DFS/BFS, T2, T3)."""
