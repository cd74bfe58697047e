"""pyspec: llama.cpp speculative decoding from Python.

The layers, bottom up: ``pyspec.ffi`` (cffi declarations of llama.h and the
library handles: the raw route), ``pyspec.core`` (objects owning C handles),
``pyspec.common`` (the line-for-line port of llama.cpp's common/speculative.cpp
and the files it needs), ``pyspec.generation`` (the generation loop over the
port or the C++ reference), ``pyspec.reference`` (the C++ side and the parity
harness), ``pyspec.cli`` (the command line). Importing pyspec opens no library:
llama.cpp is loaded on the first call into it.

    from pyspec import CommonParamsSpeculative, CommonSpeculativeType, Context, Model, generate
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
    ModelLoadError,
    PyspecError,
    RpcConnectionError,
    RpcError,
    RpcUnavailableError,
    SpeculativeError,
)
from pyspec.generation import (
    Completion,
    Engine,
    GenerationStats,
    ImplStats,
    Request,
    RequestHandle,
    SequenceResult,
    SpeculativeGenerator,
    generate,
    greedy_sampling,
)
from pyspec.version import LLAMA_CPP_REVISION, __version__

__all__ = [
    "LLAMA_CPP_REVISION",
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
    "Device",
    "Engine",
    "GenerationStats",
    "ImplStats",
    "LibraryNotFoundError",
    "Memory",
    "Model",
    "ModelLoadError",
    "PyspecError",
    "Request",
    "RequestHandle",
    "RpcConnectionError",
    "RpcError",
    "RpcUnavailableError",
    "SamplerChain",
    "SequenceResult",
    "SpeculativeError",
    "SpeculativeGenerator",
    "Vocab",
    "__version__",
    "devices",
    "generate",
    "greedy_sampling",
    "system_info",
]
