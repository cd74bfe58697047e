"""The C++ side: bindings of llama.cpp's own common_speculative_* / common_sampler_*
(libpyspec_ref) and of the generation loop written in C++. The parity harness that runs a
scenario through the C++ and the Python port lives above, in ``pyspec.parity``.

The reference library is opened on first use of anything here, not at ``import pyspec``.
"""

__all__: list[str] = []
