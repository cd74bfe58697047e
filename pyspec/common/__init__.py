"""The port of llama.cpp's ``common/`` files, file for file.

``vendor/llama.cpp/common/X.cpp`` <-> ``pyspec/common/X.py``: speculative,
sampling, ngram_cache, ngram_map, ngram_mod, common; ``params`` holds the
parameter structs and enums of common.h. The port keeps llama.cpp's names, so
a reader with the C++ file open beside the Python one finds each line's twin.
"""

__all__: list[str] = []
