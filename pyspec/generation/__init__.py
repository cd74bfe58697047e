"""Applications of the port: the serving engine (the llama.cpp server's slot loop: continuous
batching, prefix reuse, chat, logprobs), the generator that steps it for a fixed set of
prompts, the speculative backends it drives (the Python port or the C++ reference), its
statistics, and the one builder of models and contexts for a set of speculative types."""

from pyspec.generation.driver import SpeculativeGenerator, generate, greedy_sampling
from pyspec.generation.engine import Engine
from pyspec.generation.requests import Completion, Delta, Request, RequestHandle, RequestStats, TokenLogprob
from pyspec.generation.statistics import GenerationStats, ImplStats, SequenceResult

__all__ = [
    "Completion",
    "Delta",
    "Engine",
    "GenerationStats",
    "ImplStats",
    "Request",
    "RequestHandle",
    "RequestStats",
    "SequenceResult",
    "SpeculativeGenerator",
    "TokenLogprob",
    "generate",
    "greedy_sampling",
]
