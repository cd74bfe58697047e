"""Core objects: thin classes owning llama.cpp's C handles (llama.h), numpy views over C buffers.

Nothing here imports the port (pyspec.common), the generation layer or the C++ reference.
"""

from pyspec.core.adapters import LoraAdapter, load_control_vector
from pyspec.core.backend import Device, devices, system_info
from pyspec.core.batch import Batch, BatchView
from pyspec.core.chat import apply_chat_template, builtin_chat_templates
from pyspec.core.context import Context
from pyspec.core.memory import Memory
from pyspec.core.model import Model
from pyspec.core.quantize import quantize
from pyspec.core.sampler import CustomSampler, SamplerChain, TokenDataArray
from pyspec.core.threadpool import ThreadPool
from pyspec.core.vocab import Vocab

__all__ = ["Batch", "BatchView", "Context", "CustomSampler", "Device", "LoraAdapter", "Memory", "Model", "SamplerChain",
           "ThreadPool", "TokenDataArray", "Vocab", "apply_chat_template", "builtin_chat_templates", "devices",
           "load_control_vector", "quantize", "system_info"]
