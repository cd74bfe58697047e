"""pyspec: low-level Python bindings over llama.cpp for speculative decoding.

The core objects own C handles and free them deterministically; the port of
llama.cpp's ``common/speculative.cpp`` lives in :mod:`pyspec.speculative`.
"""

from pyspec.backend import Device, devices, system_info
from pyspec.batch import Batch, BatchFullError
from pyspec.context import Context
from pyspec.errors import ClosedError, ConcurrentUseError, ContextError, DecodeError, ModelLoadError, PyspecError, SpeculativeError
from pyspec.model import Model
from pyspec.sampler import SamplerChain
from pyspec.vocab import Vocab

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BatchFullError",
    "ClosedError",
    "ConcurrentUseError",
    "Context",
    "ContextError",
    "DecodeError",
    "Device",
    "Model",
    "ModelLoadError",
    "PyspecError",
    "SamplerChain",
    "SpeculativeError",
    "Vocab",
    "devices",
    "system_info",
]
