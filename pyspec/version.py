"""The package version and the llama.cpp it is built from: one home for each.

pyproject.toml reads ``__version__`` from here (scikit-build-core's regex
metadata provider); scripts/fetch_llama.py and CMakeLists.txt read the pins.
"""

__all__ = ["LLAMA_CPP_REVISION", "LLAMA_CPP_SDIST", "LLAMA_CPP_SDIST_SHA256", "__version__"]

__version__ = "0.2.0"

# llama.cpp (ggml-org) at this revision is exactly the tree that this source
# distribution on PyPI carries as vendor/llama.cpp; the archive's sha256 pins it.
LLAMA_CPP_REVISION = "0c1e57098"
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
LLAMA_CPP_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
