"""The package version and the llama.cpp it is built from: one home for each.

pyproject.toml reads ``__version__`` from here (scikit-build-core's regex
metadata provider); scripts/fetch_llama.py and CMakeLists.txt read the pins.
"""

__all__ = ["LLAMA_CPP_REVISION", "LLAMA_CPP_SDIST", "LLAMA_CPP_SDIST_SHA256", "__version__"]

__version__ = "0.2.0"

# llama.cpp (ggml-org) at this revision is exactly the tree that this source
# distribution on PyPI carries as vendor/llama.cpp; the archive's sha256 pins it.
LLAMA_CPP_REVISION = "e3a74b299"
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.30"
LLAMA_CPP_SDIST_SHA256 = "798c9b42652d2e0bff5fe81e7e762089f425a99e67f66ffe5ae156957876e0d1"
