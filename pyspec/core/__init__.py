"""Core objects: thin classes owning llama.cpp's C handles (llama.h), numpy views over C buffers.

Nothing here imports the port (pyspec.common), the generation layer or the C++ reference.
"""

from pyspec.core.backend import Device, devices, system_info
from pyspec.core.batch import Batch, BatchView
from pyspec.core.context import Context
from pyspec.core.memory import Memory
from pyspec.core.model import Model
from pyspec.core.sampler import SamplerChain
from pyspec.core.vocab import Vocab

__all__ = ["Batch", "BatchView", "Context", "Device", "Memory", "Model", "SamplerChain", "Vocab", "devices",
           "system_info"]
