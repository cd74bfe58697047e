"""C-parity: the side-by-side harness that runs one scenario through the C++ reference and the
Python port and compares them call by call. It sits above ``generation`` and ``reference`` and
below the command line."""

from pyspec.parity.harness import (
    Divergence,
    ParityReport,
    ParityScenario,
    assert_parity,
    build_contexts,
    continued_prompt,
    run_parity,
)

__all__ = ["Divergence", "ParityReport", "ParityScenario", "assert_parity", "build_contexts",
           "continued_prompt", "run_parity"]
