"""SGLang servers as the rollout engine: one server's HTTP API (``client``), the engine over
several (``engine``), weight sync (``weight_sync``, ``layout``), and SGLang itself (``facade``:
the only module that imports it)."""
