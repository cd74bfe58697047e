"""The HTTP server: OpenAI-compatible and llama-server-native endpoints over a pyspec Engine.

    pyspec serve --tiny --types ngram-map-k --parallel 4      # 127.0.0.1:8080

or from Python:

    from pyspec.generation.engine import Engine
    from pyspec.server import serve
    serve(Engine.load("model.gguf", n_parallel=4), port=8080)

Needs the ``server`` extra (starlette, uvicorn).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["create_app", "serve"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    """See :func:`pyspec.server.app.create_app` (imported on use: starlette is an optional dependency)."""
    from pyspec.server.app import create_app as make

    return make(*args, **kwargs)


def serve(engine: Any, *, host: str = "127.0.0.1", port: int = 8080, model_name: str = "pyspec",
          api_key: str | None = None, defaults: Any = None, slot_save_path: str | Path | None = None,
          log_level: str = "warning") -> None:
    """Serve ``engine`` until interrupted (uvicorn), then close it."""
    import uvicorn

    app = create_app(engine, model_name=model_name, api_key=api_key, defaults=defaults,
                     slot_save_path=slot_save_path)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)
    finally:
        engine.close()
