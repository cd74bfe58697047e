"""The C++ side: llama.cpp's own common_speculative_* / common_sampler_* (libpyspec_ref),
the generation loop written in C++, and the parity harness that runs a scenario through
the C++ and the Python port and compares them call by call.

The reference library is opened on first use of anything here, not at ``import pyspec``.
"""

__all__: list[str] = []
