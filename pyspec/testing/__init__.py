"""Test support: tiny deterministic GGUF models written on demand (see pyspec.testing.models)."""

__all__: list[str] = []
