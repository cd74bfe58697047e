"""Applications of the port: the generation loop (the llama.cpp server's speculative loop),
the engines it drives (the Python port or the C++ reference), its statistics, and the
one builder of models and contexts for a set of speculative types."""

from pyspec.generation.driver import SpeculativeGenerator, generate, greedy_sampling
from pyspec.generation.statistics import GenerationStats, ImplStats, SequenceResult

__all__ = ["GenerationStats", "ImplStats", "SequenceResult", "SpeculativeGenerator", "generate", "greedy_sampling"]
