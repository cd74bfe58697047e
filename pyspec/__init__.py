"""pyspec: llama.cpp speculative decoding from Python.

The front door is :class:`LLM`: a model path (:func:`bundled_model` is the real
model the project supplies) and a speculative type in, :class:`Completion`
(text, tokens and the speculative statistics in ``.stats``) out::

    import pyspec
    with pyspec.LLM(pyspec.bundled_model(), speculative="ngram-map-k") as llm:
        print(llm.complete("The capital of France is", max_tokens=32).text)

The layers, bottom up (each uses only those below it): ``pyspec.ffi`` (cffi
declarations of llama.h and the library handles: the raw route) and
``pyspec.core`` (objects owning C handles) < ``pyspec.common`` (the
line-for-line port of llama.cpp's common/speculative.cpp and the files it
needs) < ``pyspec.fastpath`` (the port's hot paths in C) < ``pyspec.reference``
(the C++ side) < ``pyspec.generation`` (the engine over the port or the C++
reference) < ``pyspec.parity`` (the side-by-side harness) < ``pyspec.llm``,
``pyspec.cli``, ``pyspec.server`` (the entry points). Importing pyspec opens no
library: llama.cpp is loaded on the first call into it.

``generate``, ``SpeculativeGenerator``, ``SequenceResult`` and ``GenerationStats``
are deprecated (a DeprecationWarning when used): use :class:`LLM` or
:class:`Engine`, and :class:`Completion`.
"""

from pyspec.common.params import (
    CommonParamsSampling,
    CommonParamsSpeculative,
    CommonParamsSpeculativeDraft,
    CommonParamsSpeculativeNgramCache,
    CommonParamsSpeculativeNgramMap,
    CommonParamsSpeculativeNgramMod,
    CommonSamplerType,
    CommonSpeculativeType,
)
from pyspec.core import Batch, BatchView, Context, Device, Memory, Model, SamplerChain, Vocab, devices, system_info
from pyspec.errors import (
    BatchFullError,
    ClosedError,
    ConcurrentUseError,
    ContextError,
    DecodeError,
    LibraryNotFoundError,
    MissingModelPackage,
    ModelLoadError,
    PyspecError,
    RpcConnectionError,
    RpcError,
    RpcUnavailableError,
    SpeculativeError,
)
from pyspec.generation import (
    Completion,
    Delta,
    Engine,
    GenerationStats,
    ImplStats,
    Request,
    RequestHandle,
    RequestStats,
    SequenceResult,
    SpeculativeGenerator,
    generate,
    greedy_sampling,
)
from pyspec.llm import LLM, bundled_model
from pyspec.version import LLAMA_CPP_REVISION, __version__

__all__ = [
    "LLAMA_CPP_REVISION",
    "LLM",
    "Batch",
    "BatchFullError",
    "BatchView",
    "ClosedError",
    "CommonParamsSampling",
    "CommonParamsSpeculative",
    "CommonParamsSpeculativeDraft",
    "CommonParamsSpeculativeNgramCache",
    "CommonParamsSpeculativeNgramMap",
    "CommonParamsSpeculativeNgramMod",
    "CommonSamplerType",
    "CommonSpeculativeType",
    "Completion",
    "ConcurrentUseError",
    "Context",
    "ContextError",
    "DecodeError",
    "Delta",
    "Device",
    "Engine",
    "GenerationStats",
    "ImplStats",
    "LibraryNotFoundError",
    "Memory",
    "MissingModelPackage",
    "Model",
    "ModelLoadError",
    "PyspecError",
    "Request",
    "RequestHandle",
    "RequestStats",
    "RpcConnectionError",
    "RpcError",
    "RpcUnavailableError",
    "SamplerChain",
    "SequenceResult",
    "SpeculativeError",
    "SpeculativeGenerator",
    "Vocab",
    "__version__",
    "bundled_model",
    "devices",
    "generate",
    "greedy_sampling",
    "system_info",
]
