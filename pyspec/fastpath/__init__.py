"""The fast paths: C shortcuts that give the port's results with less work, kept apart from the
line-for-line port (pyspec.common) so that it reads like the C++.

The generation layer chooses them (pyspec.generation.backends); each has an equivalence test
against the port and the C++ reference (tests/test_fastpath.py).
"""

__all__: list[str] = []
