"""Tiny, deterministic, random-weight GGUF models for tests.

Every model is written on demand with the PyPI ``gguf`` writer (the
``testing`` extra) into a cache folder (``~/.cache/pyspec/models``, or
``$PYSPEC_MODEL_CACHE``) and reused afterwards; nothing here is committed. All
models share one real vocabulary, llama.cpp's ``ggml-vocab-llama-spm.gguf``
(SPM, 32000 tokens; the build installs it into the package), so any two of them
are compatible for speculative decoding.

- ``target``: llama architecture, 4 layers.
- ``draft``: llama architecture, the target's first 2 layers with the same
  embeddings and head (a "layer-skip" draft), so it agrees with the target
  often but not always: acceptance is neither 0 nor 1.
- ``eagle3``: an EAGLE3 head for ``target`` (reads the inputs of target layers
  1, 2, 3; borrows the target's token embeddings; has its own lm_head and a
  ``d2t`` map).
- ``mtp``: a qwen35 (hybrid gated-delta-net + attention) model with one
  NextN/MTP block, for a second context of type ``LLAMA_CONTEXT_TYPE_MTP``.
- ``cyclic-target``: llama architecture, 4 layers, wired so that the next
  token is mostly a fixed function of the last one (a "successor" map made of
  short cycles over a few hundred ordinary tokens): greedy decoding falls into
  a repeating cycle after a token or two, so the n-gram speculative types find
  matches in the history and their drafts are accepted.
- ``cyclic-draft``: the cyclic target's first 2 layers (same embeddings and
  head), a draft-simple draft for it.
- ``cyclic-eagle3``: an EAGLE3 head for ``cyclic-target`` (same wiring as
  ``eagle3``).

File names carry ``GENERATOR_VERSION``: bump it whenever the bytes a generator
writes change, so that stale cached files are not reused.
"""

from __future__ import annotations

import functools
import os
import struct
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "EAGLE3_TARGET_LAYERS",
    "GENERATOR_VERSION",
    "cache_dir",
    "cyclic_successor",
    "gguf_module",
    "llama_cpp_dir",
    "llama_tensors",
    "llama_vocab_kv",
    "make_all",
    "make_chat_target",
    "make_cyclic_draft",
    "make_cyclic_eagle3",
    "make_cyclic_target",
    "make_draft",
    "make_eagle3",
    "make_mtp",
    "make_target",
    "tiny_model_paths",
    "vocab_source",
    "write_eagle3_with_layers",
    "write_empty",
    "write_llama",
    "write_random_bytes",
    "write_truncated",
]

GENERATOR_VERSION = "v2"

VOCAB_FILE = "ggml-vocab-llama-spm.gguf"
_DATA_DIR = Path(__file__).with_name("data")  # filled by the build, never committed

# Shared shapes. The vocabulary (32000 rows) dominates the file sizes.
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2  # grouped-query attention, as in most real targets
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 192
N_CTX_TRAIN = 4096
RMS_EPS = 1e-5
ROPE_BASE = 10000.0

TARGET_LAYERS = 4
DRAFT_LAYERS = 2
# Inputs of target layers 1, 2, 3: low / mid / high features, as the converter
# picks [2, n/2, n-3] for a real 32-layer target.
EAGLE3_TARGET_LAYERS = (1, 2, 3)

# qwen35 (MTP) shapes: 3 gated-delta-net layers, then 1 full-attention layer,
# then the NextN block (block_count = 5).
MTP_TRUNK_LAYERS = 4
MTP_FULL_ATTN_INTERVAL = 4
MTP_ROPE_DIM = 8  # partial rotary, like Qwen3.5
MTP_ROPE_SECTIONS = [2, 1, 1, 0]  # sums to MTP_ROPE_DIM / 2
SSM_CONV_KERNEL = 4
SSM_STATE = 16  # head_k_dim == head_v_dim
SSM_GROUPS = 2  # linear-attention key heads
SSM_V_HEADS = 4  # linear-attention value heads (time_step_rank)
SSM_INNER = SSM_STATE * SSM_V_HEADS

# Logit scale of the lm_head: large enough that the top token often holds most
# of the probability mass (drafts pass a p_min test), small enough to keep ties
# and sampling meaningful.
LOGIT_SCALE = 6.0
# Residual-update scales. Each layer adds a small update to the token
# embedding, so the next token depends mostly, not only, on the last one. The
# drafts are wired to see exactly that (the draft keeps the first layers, the
# EAGLE3 and MTP heads copy the token embedding to the target's lm_head), so
# about half of the first draft tokens match the target's greedy choice
# (measured: draft 33/48, eagle3 27/48, mtp 27/47), and the greedy stream
# still varies (46-48 distinct tokens in 48 greedy steps).
EARLY_LAYER_SCALE = 0.15  # target layers the draft keeps
LATE_LAYER_SCALE = 0.1  # target layers past the draft's
MTP_TRUNK_SCALE = 0.05  # qwen35 trunk layers
MTP_HEAD_SCALE = 0.05  # qwen35 NextN block's attention / FFN

SEED = 20240607

# The cyclic models. CYCLIC_N_STATES ordinary tokens (type NORMAL) are split into
# cycles of CYCLIC_MIN_LEN..CYCLIC_MAX_LEN tokens; every other token points at
# one of them. Token t's embedding is the "key" of succ(t) plus noise, and the
# head row of a cycle token is its key (unit length times CYCLIC_LOGIT_SCALE), so
# the head reads succ(t) off the residual stream; the layers add small updates.
# Logits: about 8 * CYCLIC_LOGIT_SCALE for succ(t), about N(0, scale^2) for the
# other cycle tokens: greedy follows the cycle, temperature 0.8 / top-k 40 leaves
# it now and then (p(succ) around 0.7) for another cycle.
CYCLIC_SEED = SEED + 10
CYCLIC_N_STATES = 256
CYCLIC_MIN_LEN = 5
CYCLIC_MAX_LEN = 12
CYCLIC_EMBD_NOISE = 0.3  # per-element noise on top of the successor's key (RMS 1)
CYCLIC_LOGIT_SCALE = 0.6
CYCLIC_OTHER_ROW_SCALE = 0.3  # logit std of the non-cycle tokens (never the argmax)
CYCLIC_LAYER_SCALE = 0.1


# ---------------------------------------------------------------------------
# locations
# ---------------------------------------------------------------------------


def llama_cpp_dir() -> Path:
    """A llama.cpp source tree: ``$PYSPEC_LLAMA_CPP`` or the checkout's ``vendor/llama.cpp``."""
    env = os.environ.get("PYSPEC_LLAMA_CPP")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "vendor" / "llama.cpp"
    if not (path / "models").is_dir():
        raise FileNotFoundError(
            f"llama.cpp source tree not found at {path}; run scripts/fetch_llama.py or set PYSPEC_LLAMA_CPP"
        )
    return path


def cache_dir() -> Path:
    """Folder of generated models: ``$PYSPEC_MODEL_CACHE`` or ``~/.cache/pyspec/models``."""
    env = os.environ.get("PYSPEC_MODEL_CACHE")
    path = Path(env) if env else Path.home() / ".cache" / "pyspec" / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def vocab_source() -> Path:
    """The GGUF whose ``tokenizer.*`` entries every test model copies.

    The build installs llama.cpp's vocabulary file into the package (an installed
    pyspec makes its test models anywhere); a source checkout without a build
    falls back to the fetched tree (or ``$PYSPEC_LLAMA_CPP``). Both are the same bytes.
    """
    packaged = _packaged_vocab()
    if packaged.is_file():
        return packaged
    try:
        path = llama_cpp_dir() / "models" / VOCAB_FILE
    except FileNotFoundError:
        path = packaged
    if not path.is_file():
        raise FileNotFoundError(
            f"vocabulary file {VOCAB_FILE} not found (looked in {packaged} and the llama.cpp tree); "
            "build the package (pip install .) or run scripts/fetch_llama.py")
    return path


def _packaged_vocab() -> Path:
    # an editable install runs these sources, and the package __path__ adds the install
    # tree that holds the data folder (as pyspec.ffi.lib_dir finds the libraries)
    package = sys.modules[__name__.rpartition(".")[0]]
    for folder in getattr(package, "__path__", ()):
        candidate = Path(folder) / "data" / VOCAB_FILE
        if candidate.is_file():
            return candidate
    return _DATA_DIR / VOCAB_FILE


def gguf_module() -> Any:
    """The PyPI ``gguf`` writer (the ``testing`` extra), whose 0.19 files the pinned llama.cpp loads."""
    try:
        import gguf
    except ImportError:
        raise ImportError("the test models need the PyPI package 'gguf': pip install 'llama-pyspec[testing]'") from None
    return gguf


# ---------------------------------------------------------------------------
# vocabulary
# ---------------------------------------------------------------------------


# GGUF value type ids -> numpy dtype, for the scalar and array values of the header
_GGUF_NUMPY = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8",
}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_BOOL = 8, 9, 7


@functools.lru_cache(maxsize=1)
def llama_vocab_kv() -> tuple[tuple[str, Any, Any, Any], ...]:
    """(key, value, type, sub_type) of every ``tokenizer.*`` entry of the vocab file.

    A small header parser instead of gguf-py's GGUFReader: the reader builds a
    numpy view per array element and takes seconds on a 32000-token vocabulary.
    """
    gguf = gguf_module()
    buf = vocab_source().read_bytes()
    magic, _version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF":
        raise ValueError(f"{vocab_source()} is not a GGUF file")
    off = 24

    def string() -> str:
        nonlocal off
        (n,) = struct.unpack_from("<Q", buf, off)
        off += 8 + n
        return buf[off - n : off].decode("utf-8")

    def value(vtype: int) -> Any:
        nonlocal off
        if vtype == _GGUF_STRING:
            return string()
        dtype = np.dtype(_GGUF_NUMPY[vtype])
        off += dtype.itemsize
        v = np.frombuffer(buf, dtype, 1, off - dtype.itemsize)[0].item()
        return bool(v) if vtype == _GGUF_BOOL else v

    out = []
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, off)
        off += 4
        sub_type = None
        if vtype == _GGUF_ARRAY:
            sub_type, n = struct.unpack_from("<IQ", buf, off)
            off += 12
            if sub_type == _GGUF_STRING:
                val: Any = [string() for _ in range(n)]
            else:
                dtype = np.dtype(_GGUF_NUMPY[sub_type])
                val = np.frombuffer(buf, dtype, n, off).tolist()
                off += n * dtype.itemsize
        else:
            val = value(vtype)
        if key.startswith("tokenizer."):
            st = None if sub_type is None else gguf.GGUFValueType(sub_type)
            out.append((key, val, gguf.GGUFValueType(vtype), st))
    return tuple(out)


def _n_vocab() -> int:
    for key, value, _, _ in llama_vocab_kv():
        if key == "tokenizer.ggml.tokens":
            return len(value)
    raise ValueError(f"{vocab_source()} has no tokenizer.ggml.tokens")


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------


class _Weights:
    """Seeded random tensors, numpy shape = reversed ggml ``ne`` (rows = outputs)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def mat(self, n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
        # std scale/sqrt(n_in): a unit-RMS input gives outputs of RMS ~scale
        w = self.rng.standard_normal((n_out, n_in), dtype=np.float32)
        return (w * np.float32(scale / np.sqrt(n_in))).astype(np.float16)

    def embd(self, n_rows: int, n_embd: int) -> np.ndarray:
        return self.rng.standard_normal((n_rows, n_embd), dtype=np.float32).astype(np.float16)

    def norm(self, n: int) -> np.ndarray:
        # around 1 like trained RMSNorm gains; f32 because ggml's norm ops expect it
        return (1.0 + 0.1 * self.rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def vec(self, n: int, lo: float, hi: float) -> np.ndarray:
        return self.rng.uniform(lo, hi, n).astype(np.float32)

    def conv(self, channels: int, kernel: int) -> np.ndarray:
        # ssm_conv1d stays f32, as the converter keeps it
        w = self.rng.standard_normal((channels, kernel), dtype=np.float32)
        return (w / np.float32(np.sqrt(kernel))).astype(np.float32)


def _llama_layer(w: _Weights, il: int, scale: float) -> Iterator[tuple[str, np.ndarray]]:
    blk = f"blk.{il}"
    yield f"{blk}.attn_norm.weight", w.norm(N_EMBD)
    yield f"{blk}.attn_q.weight", w.mat(N_HEAD * HEAD_DIM, N_EMBD, 2.0)
    yield f"{blk}.attn_k.weight", w.mat(N_HEAD_KV * HEAD_DIM, N_EMBD, 2.0)
    yield f"{blk}.attn_v.weight", w.mat(N_HEAD_KV * HEAD_DIM, N_EMBD)
    yield f"{blk}.attn_output.weight", w.mat(N_EMBD, N_HEAD * HEAD_DIM, scale)
    yield f"{blk}.ffn_norm.weight", w.norm(N_EMBD)
    yield f"{blk}.ffn_gate.weight", w.mat(N_FF, N_EMBD)
    yield f"{blk}.ffn_up.weight", w.mat(N_FF, N_EMBD)
    yield f"{blk}.ffn_down.weight", w.mat(N_EMBD, N_FF, 2.0 * scale)


@functools.lru_cache(maxsize=1)
def llama_tensors() -> tuple[tuple[str, np.ndarray], ...]:
    """All tensors of the target, in file order; the draft takes a prefix of its layers."""
    n_vocab = _n_vocab()
    w = _Weights(SEED)
    out: list[tuple[str, np.ndarray]] = [
        ("token_embd.weight", w.embd(n_vocab, N_EMBD)),
        ("output_norm.weight", w.norm(N_EMBD)),
        # untied head: with output == token_embd a random model would echo its input token
        ("output.weight", w.mat(n_vocab, N_EMBD, LOGIT_SCALE)),
    ]
    for il in range(TARGET_LAYERS):
        out.extend(_llama_layer(w, il, EARLY_LAYER_SCALE if il < DRAFT_LAYERS else LATE_LAYER_SCALE))
    return tuple(out)


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------


def _model_path(kind: str) -> Path:
    return cache_dir() / f"pyspec-tiny-{kind}-{GENERATOR_VERSION}.gguf"


def _write_atomic(path: Path, fill: Callable[[Any], None], arch: str) -> None:
    """Write a GGUF through a temp file in the same folder, then rename it into place."""
    gguf = gguf_module()
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.chmod(0o644)  # mkstemp makes it private; a cache may be shared
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _add_common_kv(writer: Any, name: str, n_layer: int, n_head_kv: int = N_HEAD_KV) -> None:
    """general.* and the hyper-parameters every architecture here reads, plus the vocabulary."""
    gguf = gguf_module()
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_vocab_size(_n_vocab())
    for key, value, vtype, sub_type in llama_vocab_kv():
        writer.add_key_value(key, value, vtype, sub_type)


def _add_tensors(writer: Any, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
    for name, data in tensors:
        writer.add_tensor(name, data)


def _make(kind: str, arch: str, fill: Callable[[Any], None]) -> Path:
    path = _model_path(kind)
    if not path.is_file():
        _write_atomic(path, fill, arch)
    return path


def make_target() -> Path:
    """The llama target: 4 layers, n_embd 64, GQA 4/2, f16 weights."""

    def fill(writer: Any) -> None:
        _add_common_kv(writer, "pyspec-tiny-target", TARGET_LAYERS)
        writer.add_rope_dimension_count(HEAD_DIM)
        _add_tensors(writer, llama_tensors())

    return _make("target", "llama", fill)


def make_draft() -> Path:
    """The llama draft: the target's first 2 layers, same embeddings, head and vocabulary."""

    def fill(writer: Any) -> None:
        _add_common_kv(writer, "pyspec-tiny-draft", DRAFT_LAYERS)
        writer.add_rope_dimension_count(HEAD_DIM)
        _add_tensors(
            writer,
            (
                (name, data)
                for name, data in llama_tensors()
                if not name.startswith("blk.") or int(name.split(".")[1]) < DRAFT_LAYERS
            ),
        )

    return _make("draft", "llama", fill)


def _eagle3_fill(name: str, seed: int, head: tuple[tuple[str, np.ndarray], ...]) -> Callable[[Any], None]:
    """The writer of an EAGLE3 head for the llama target whose tensors are ``head``."""
    n_vocab = _n_vocab()
    n_embd_tgt = N_EMBD  # the borrowed token embeddings fix n_embd to the target's
    n_head_kv = N_HEAD  # V must carry the whole token embedding
    tgt = dict(head)

    def fill(writer: Any) -> None:
        _add_common_kv(writer, name, 1, n_head_kv=n_head_kv)
        writer.add_rope_dimension_count(HEAD_DIM)
        writer.add_array("eagle3.target_layers", list(EAGLE3_TARGET_LAYERS))
        writer.add_uint32("eagle3.target_hidden_size", n_embd_tgt)
        writer.add_bool("eagle3.norm_before_residual", True)

        w = _Weights(seed)
        d2t = w.rng.permutation(n_vocab).astype(np.int64)
        eye = np.eye(N_EMBD, dtype=np.float32)

        def from_embd(m: np.ndarray, g_scale: float) -> np.ndarray:
            # attention input is [norm(token embd) ; norm(g)]: mostly read the first half
            g_part = w.mat(m.shape[0], N_EMBD, g_scale).astype(np.float32)
            return np.concatenate([m.astype(np.float32), g_part], axis=1).astype(np.float16)

        qk = w.mat(N_HEAD * HEAD_DIM, N_EMBD, 2.5)  # same for q and k: self-attention wins
        _add_tensors(
            writer,
            (
                ("fc.weight", w.mat(N_EMBD, len(EAGLE3_TARGET_LAYERS) * n_embd_tgt, 0.5)),
                ("output_norm.weight", tgt["output_norm.weight"]),
                # draft row i scores target token d2t[i]
                ("output.weight", tgt["output.weight"][d2t]),
                # the converter stores d2t as absolute target ids, int64
                ("d2t", d2t),
                ("blk.0.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32)),
                ("blk.0.attn_norm_2.weight", 0.1 * w.norm(N_EMBD)),
                ("blk.0.attn_q.weight", from_embd(qk, 0.1)),
                ("blk.0.attn_k.weight", from_embd(qk, 0.1)),
                ("blk.0.attn_v.weight", from_embd(eye, 0.1)),
                ("blk.0.attn_output.weight", (4.0 * eye + w.mat(N_EMBD, N_EMBD, 0.1)).astype(np.float16)),
                ("blk.0.ffn_norm.weight", w.norm(N_EMBD)),
                ("blk.0.ffn_gate.weight", w.mat(N_FF, N_EMBD)),
                ("blk.0.ffn_up.weight", w.mat(N_FF, N_EMBD)),
                ("blk.0.ffn_down.weight", w.mat(N_EMBD, N_FF, 0.2)),
            ),
        )

    return fill


def make_eagle3() -> Path:
    """An EAGLE3 head for the target (architecture ``eagle3``, 1 decoder layer).

    Like the EAGLE3 heads of Llama 3.1 8B it has no ``token_embd`` (the decoder
    borrows the target's through ``ctx_other``), its own ``output`` and a
    ``d2t`` map (here a permutation of the full vocabulary, so every logit
    stays finite while the mapping is still exercised).

    The weights are random but wired so that drafts are sometimes right: the
    attention mostly attends to its own position and copies the token
    embedding into the residual, and the head is the target's head (rows
    reordered through ``d2t``), so the draft predicts roughly what the target
    would predict from the last token alone. ``norm_before_residual`` keeps
    the fed-back hidden state from piling up over autoregressive steps.

    At this llama.cpp revision ``llama_decode`` splits an EAGLE3 decoder batch
    with the encoder's row width (``n_embd_inp`` = 3 * n_embd), so only the
    first ubatch of a draft-context decode reads the right ``embd`` rows; give
    the draft context ``n_ubatch >= n_batch`` (and ``kv_unified=True`` for
    several sequences) or the drafts are garbage.
    """
    return _make("eagle3", "eagle3", _eagle3_fill("pyspec-tiny-eagle3", SEED + 3, llama_tensors()))


# ---------------------------------------------------------------------------
# cyclic models: greedy output that repeats
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cyclic_plan() -> tuple[np.ndarray, np.ndarray, tuple[tuple[int, ...], ...]]:
    """(succ over the whole vocabulary, the cycle tokens, the cycles)."""
    n_vocab = _n_vocab()
    token_type = dict((k, v) for k, v, _, _ in llama_vocab_kv())["tokenizer.ggml.token_type"]
    normal = np.flatnonzero(np.asarray(token_type) == 1)  # no control, byte or unknown tokens
    rng = np.random.default_rng(CYCLIC_SEED)
    states = rng.choice(normal, CYCLIC_N_STATES, replace=False)
    cycles: list[tuple[int, ...]] = []
    i = 0
    while i < len(states):
        n = int(rng.integers(CYCLIC_MIN_LEN, CYCLIC_MAX_LEN + 1))
        if len(states) - i - n < CYCLIC_MIN_LEN:
            n = len(states) - i  # the last cycle takes the rest
        cycles.append(tuple(int(t) for t in states[i : i + n]))
        i += n
    succ = states[rng.integers(0, len(states), n_vocab)].astype(np.int64)  # every token enters a cycle
    for cyc in cycles:
        for k, t in enumerate(cyc):
            succ[t] = cyc[(k + 1) % len(cyc)]
    return succ, np.sort(states), tuple(cycles)


def cyclic_successor() -> tuple[np.ndarray, tuple[tuple[int, ...], ...]]:
    """The map the cyclic models follow: ``succ[t]`` for every token id, and the cycles."""
    succ, _, cycles = _cyclic_plan()
    return succ.copy(), cycles


@functools.lru_cache(maxsize=1)
def _cyclic_tensors() -> tuple[tuple[str, np.ndarray], ...]:
    """All tensors of the cyclic target, in file order; the cyclic draft takes its first layers."""
    n_vocab = _n_vocab()
    succ, states, _ = _cyclic_plan()
    w = _Weights(CYCLIC_SEED + 1)
    keys = w.rng.standard_normal((n_vocab, N_EMBD), dtype=np.float32)  # rows of the cycle tokens are used
    keys[states] /= np.sqrt((keys[states] ** 2).mean(axis=1, keepdims=True))  # RMS 1
    embd = keys[succ] + np.float32(CYCLIC_EMBD_NOISE) * w.rng.standard_normal((n_vocab, N_EMBD), dtype=np.float32)
    # head: a cycle token's row is its key, unit length * scale (the normed residual has length
    # sqrt(N_EMBD), so succ(t) scores about sqrt(N_EMBD) * scale); other rows are small noise
    head = np.float32(CYCLIC_OTHER_ROW_SCALE / np.sqrt(N_EMBD)) * w.rng.standard_normal(
        (n_vocab, N_EMBD), dtype=np.float32)
    head[states] = keys[states] * np.float32(CYCLIC_LOGIT_SCALE / np.sqrt(N_EMBD))
    special = np.asarray(dict((k, v) for k, v, _, _ in llama_vocab_kv())["tokenizer.ggml.token_type"]) != 1
    head[special] = 0.0  # control / byte tokens (eos among them) score 0, far below the top-k
    out: list[tuple[str, np.ndarray]] = [
        ("token_embd.weight", embd.astype(np.float16)),
        ("output_norm.weight", np.ones(N_EMBD, dtype=np.float32)),
        ("output.weight", head.astype(np.float16)),
    ]
    for il in range(TARGET_LAYERS):
        out.extend(_llama_layer(w, il, CYCLIC_LAYER_SCALE))
    return tuple(out)


def make_cyclic_target() -> Path:
    """A llama target (4 layers, like ``target``) whose greedy output falls into short cycles.

    The next token is mostly ``cyclic_successor()[0][last token]``: after the
    prompt, greedy decoding enters one of the cycles (5 to 12 tokens long)
    and repeats it, which gives the n-gram speculative types matches to draft
    from. Sampling (temperature 0.8, top-k 40) follows the map most of the
    time and jumps to other cycles now and then.
    """

    def fill(writer: Any) -> None:
        _add_common_kv(writer, "pyspec-tiny-cyclic-target", TARGET_LAYERS)
        writer.add_rope_dimension_count(HEAD_DIM)
        _add_tensors(writer, _cyclic_tensors())

    return _make("cyclic-target", "llama", fill)


def make_cyclic_draft() -> Path:
    """The cyclic target's first 2 layers, same embeddings, head and vocabulary (draft-simple)."""

    def fill(writer: Any) -> None:
        _add_common_kv(writer, "pyspec-tiny-cyclic-draft", DRAFT_LAYERS)
        writer.add_rope_dimension_count(HEAD_DIM)
        _add_tensors(
            writer,
            (
                (name, data)
                for name, data in _cyclic_tensors()
                if not name.startswith("blk.") or int(name.split(".")[1]) < DRAFT_LAYERS
            ),
        )

    return _make("cyclic-draft", "llama", fill)


# A Llama-2-style chat template (written for these tests): [INST] turns, an optional
# <<SYS>> block in the first turn, BOS before each user turn, EOS after each answer.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if m['role'] == 'user' %}{{ bos_token }}[INST] "
    "{% if loop.first and system is defined %}<<SYS>>\n{{ system }}\n<</SYS>>\n\n{% endif %}"
    "{{ m['content'] | trim }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] | trim }} {{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "{% endfor %}"
)


def make_chat_target() -> Path:
    """``cyclic-target`` with a chat template (tokenizer.chat_template, see CHAT_TEMPLATE): for the engine,
    the chat rendering and the server."""

    def fill(writer: Any) -> None:
        _add_common_kv(writer, "pyspec-tiny-chat-target", TARGET_LAYERS)
        writer.add_rope_dimension_count(HEAD_DIM)
        writer.add_chat_template(CHAT_TEMPLATE)
        _add_tensors(writer, _cyclic_tensors())

    return _make("chat-target", "llama", fill)


def make_cyclic_eagle3() -> Path:
    """An EAGLE3 head for ``cyclic-target``, wired like ``eagle3`` (see make_eagle3 for the ubatch caveat).

    It borrows the token embeddings of the target it runs with: use it with
    ``cyclic-target`` as ``ctx_other``.
    """
    fill = _eagle3_fill("pyspec-tiny-cyclic-eagle3", CYCLIC_SEED + 3, _cyclic_tensors())
    return _make("cyclic-eagle3", "eagle3", fill)


def _qwen35_attn(w: _Weights, blk: str, scale: float) -> Iterator[tuple[str, np.ndarray]]:
    # attn_q holds query and gate interleaved per head: 2 * head_dim rows per head
    yield f"{blk}.attn_q.weight", w.mat(2 * N_HEAD * HEAD_DIM, N_EMBD, 2.0)
    yield f"{blk}.attn_k.weight", w.mat(N_HEAD_KV * HEAD_DIM, N_EMBD, 2.0)
    yield f"{blk}.attn_v.weight", w.mat(N_HEAD_KV * HEAD_DIM, N_EMBD)
    yield f"{blk}.attn_output.weight", w.mat(N_EMBD, N_HEAD * HEAD_DIM, scale)
    yield f"{blk}.attn_q_norm.weight", w.norm(HEAD_DIM)
    yield f"{blk}.attn_k_norm.weight", w.norm(HEAD_DIM)


def _qwen35_ffn(w: _Weights, blk: str, scale: float) -> Iterator[tuple[str, np.ndarray]]:
    yield f"{blk}.ffn_gate.weight", w.mat(N_FF, N_EMBD)
    yield f"{blk}.ffn_up.weight", w.mat(N_FF, N_EMBD)
    yield f"{blk}.ffn_down.weight", w.mat(N_EMBD, N_FF, 2.0 * scale)


def _qwen35_tensors() -> Iterator[tuple[str, np.ndarray]]:
    n_vocab = _n_vocab()
    w = _Weights(SEED + 4)
    output_norm = w.norm(N_EMBD)
    yield "token_embd.weight", w.embd(n_vocab, N_EMBD)
    yield "output_norm.weight", output_norm
    yield "output.weight", w.mat(n_vocab, N_EMBD, LOGIT_SCALE)

    key_dim = SSM_STATE * SSM_GROUPS
    conv_dim = 2 * key_dim + SSM_INNER
    for il in range(MTP_TRUNK_LAYERS):
        blk = f"blk.{il}"
        yield f"{blk}.attn_norm.weight", w.norm(N_EMBD)
        yield f"{blk}.post_attention_norm.weight", w.norm(N_EMBD)
        if (il + 1) % MTP_FULL_ATTN_INTERVAL == 0:
            yield from _qwen35_attn(w, blk, MTP_TRUNK_SCALE)
        else:
            # gated delta net
            yield f"{blk}.attn_qkv.weight", w.mat(conv_dim, N_EMBD)
            yield f"{blk}.attn_gate.weight", w.mat(SSM_INNER, N_EMBD)
            yield f"{blk}.ssm_conv1d.weight", w.conv(conv_dim, SSM_CONV_KERNEL)
            yield f"{blk}.ssm_dt.bias", w.vec(SSM_V_HEADS, -0.5, 0.5)
            # ssm_a = -exp(A_log) < 0, so the state decays instead of blowing up
            yield f"{blk}.ssm_a", -w.vec(SSM_V_HEADS, 0.5, 4.0)
            yield f"{blk}.ssm_beta.weight", w.mat(SSM_V_HEADS, N_EMBD)
            yield f"{blk}.ssm_alpha.weight", w.mat(SSM_V_HEADS, N_EMBD)
            yield f"{blk}.ssm_norm.weight", w.norm(SSM_STATE)
            yield f"{blk}.ssm_out.weight", w.mat(N_EMBD, SSM_INNER, MTP_TRUNK_SCALE)
        yield from _qwen35_ffn(w, blk, MTP_TRUNK_SCALE)

    # The NextN block: a full-attention decoder layer plus the eh_proj wiring.
    # eh_proj mostly passes the (normed) token embedding and the block adds
    # little, so with the target's own head the block predicts roughly what
    # the target predicts from the last token alone: drafts are sometimes right.
    blk = f"blk.{MTP_TRUNK_LAYERS}"
    yield f"{blk}.attn_norm.weight", w.norm(N_EMBD)
    yield f"{blk}.post_attention_norm.weight", w.norm(N_EMBD)
    yield from _qwen35_attn(w, blk, MTP_HEAD_SCALE)
    yield from _qwen35_ffn(w, blk, MTP_HEAD_SCALE)
    eh_proj = np.concatenate(
        [np.eye(N_EMBD, dtype=np.float32) + w.mat(N_EMBD, N_EMBD, 0.05), w.mat(N_EMBD, N_EMBD, 0.1)], axis=1
    )
    yield f"{blk}.nextn.eh_proj.weight", eh_proj.astype(np.float16)
    yield f"{blk}.nextn.enorm.weight", np.ones(N_EMBD, dtype=np.float32)
    yield f"{blk}.nextn.hnorm.weight", w.norm(N_EMBD)
    yield f"{blk}.nextn.shared_head_norm.weight", output_norm


def make_mtp() -> Path:
    """A qwen35 target with one NextN/MTP block (``qwen35.nextn_predict_layers`` = 1).

    qwen35 is the simplest dense architecture with an MTP graph at this
    revision (cohere2moe and step35 are MoE); it is hybrid (3 gated-delta-net
    layers, 1 attention layer) and supports recurrent-state rollback, which is
    what speculative decoding on such targets needs.
    """

    def fill(writer: Any) -> None:
        _add_common_kv(writer, "pyspec-tiny-mtp", MTP_TRUNK_LAYERS + 1)
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_rope_dimension_count(MTP_ROPE_DIM)
        writer.add_rope_dimension_sections(MTP_ROPE_SECTIONS)
        writer.add_ssm_conv_kernel(SSM_CONV_KERNEL)
        writer.add_ssm_state_size(SSM_STATE)
        writer.add_ssm_group_count(SSM_GROUPS)
        writer.add_ssm_time_step_rank(SSM_V_HEADS)
        writer.add_ssm_inner_size(SSM_INNER)
        writer.add_full_attention_interval(MTP_FULL_ATTN_INTERVAL)
        writer.add_nextn_predict_layers(1)
        _add_tensors(writer, _qwen35_tensors())

    return _make("mtp", "qwen35", fill)


def make_all() -> dict[str, Path]:
    """Every model, by name."""
    return {
        "target": make_target(),
        "draft": make_draft(),
        "eagle3": make_eagle3(),
        "mtp": make_mtp(),
        "cyclic-target": make_cyclic_target(),
        "cyclic-draft": make_cyclic_draft(),
        "cyclic-eagle3": make_cyclic_eagle3(),
        "chat-target": make_chat_target(),
    }


def tiny_model_paths(types: str | Sequence[Any] = "none") -> tuple[Path, Path | None]:
    """(target, draft) of the tiny models for a set of speculative types, made on first use.

    ``types``: names as :func:`pyspec.generation.contexts.parse_types` takes them, or the types
    themselves (a union of several sets, as the bench loads, may hold two draft types: draft-mtp
    wins, then draft-eagle3, then draft-dspark / draft-dflash, as in ``draft_kind``). The target is the
    tiny cyclic llama, whose greedy output repeats itself so n-gram drafts are accepted (the
    tiny qwen35 MTP model for draft-mtp); the draft is its cyclic draft (draft-simple), its
    EAGLE3 head (draft-eagle3), its DFlash drafter (draft-dflash) or its DSpark drafter
    (draft-dspark), else None. Pass them to the library as plain paths
    (``load_models(types, model=target, draft=draft)``, ``Engine.load(target, draft=draft)``):
    the library below the command line never imports this module.
    """
    from pyspec.common.params import CommonSpeculativeType as T
    from pyspec.generation.contexts import draft_kind, parse_types  # test support may import any layer
    from pyspec.suffix.names import split_suffix_type
    from pyspec.testing.models_dflash import make_cyclic_dflash, make_cyclic_dspark  # it imports this module

    # "suffix" (pyspec's own type) needs no model of its own: the target is the cyclic one
    parsed: list[Any] = parse_types(split_suffix_type(types)[0]) if isinstance(types, str) else list(types)
    kind = draft_kind(parsed)
    if kind == "dflash":
        kind = "dspark" if T.DRAFT_DSPARK in parsed else "dflash"
    target = make_mtp() if kind == "mtp" else make_cyclic_target()
    draft = {"draft": make_cyclic_draft, "eagle3": make_cyclic_eagle3, "dflash": make_cyclic_dflash,
             "dspark": make_cyclic_dspark}.get(kind)
    return target, (draft() if draft is not None else None)


# ---------------------------------------------------------------------------
# broken files for error tests
# ---------------------------------------------------------------------------


def write_llama(path: Path, arch: str = "llama", vocab_kv: Any = None, n_layer: int = 2) -> Path:
    """The tiny draft's tensors under another architecture name and/or vocabulary (hostile-file tests)."""
    gguf = gguf_module()
    kv = llama_vocab_kv() if vocab_kv is None else vocab_kv

    def fill(w: Any) -> None:
        w.add_name("pyspec-hostile")
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        w.add_context_length(N_CTX_TRAIN)
        w.add_embedding_length(N_EMBD)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(N_FF)
        w.add_head_count(N_HEAD)
        w.add_head_count_kv(N_HEAD_KV)
        w.add_layer_norm_rms_eps(RMS_EPS)
        w.add_rope_freq_base(ROPE_BASE)
        w.add_rope_dimension_count(HEAD_DIM)
        for key, value, vtype, sub_type in kv:
            w.add_key_value(key, value, vtype, sub_type)
        for name, data in llama_tensors():
            if not name.startswith("blk.") or int(name.split(".")[1]) < n_layer:
                w.add_tensor(name, data)

    _write_atomic(path, fill, arch)
    return path


def write_empty(path: str | os.PathLike[str]) -> Path:
    """A zero-byte file."""
    out = Path(path)
    out.write_bytes(b"")
    return out


def write_truncated(path: str | os.PathLike[str]) -> Path:
    """The first half of the target model: a valid header, tensor data cut short."""
    out = Path(path)
    data = make_target().read_bytes()
    out.write_bytes(data[: len(data) // 2])
    return out


def write_random_bytes(path: str | os.PathLike[str], n: int = 4096) -> Path:
    """``n`` seeded random bytes (no GGUF magic)."""
    out = Path(path)
    data = np.random.default_rng(SEED + 99).integers(0, 256, n, dtype=np.uint8).tobytes()
    if data[:4] == b"GGUF":  # never by chance a plausible header
        data = b"\0" + data[1:]
    out.write_bytes(data)
    return out


def write_eagle3_with_layers(path: Path, layers: tuple[int, ...]) -> Path:
    """The tiny EAGLE3 head, but reading len(layers) target layers."""
    gguf = gguf_module()
    n_vocab = _n_vocab()
    rng = np.random.default_rng(5)

    def mat(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float16)

    def fill(w: Any) -> None:
        w.add_name("pyspec-hostile-eagle3")
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        w.add_context_length(N_CTX_TRAIN)
        w.add_embedding_length(N_EMBD)
        w.add_block_count(1)
        w.add_feed_forward_length(N_FF)
        w.add_head_count(N_HEAD)
        w.add_head_count_kv(N_HEAD)
        w.add_layer_norm_rms_eps(RMS_EPS)
        w.add_rope_freq_base(ROPE_BASE)
        w.add_rope_dimension_count(HEAD_DIM)
        w.add_array("eagle3.target_layers", list(layers))
        w.add_uint32("eagle3.target_hidden_size", N_EMBD)
        for key, value, vtype, sub_type in llama_vocab_kv():
            w.add_key_value(key, value, vtype, sub_type)
        e = N_EMBD
        for name, data in (
            ("fc.weight", mat(e, len(layers) * e)),
            ("output_norm.weight", np.ones(e, np.float32)),
            ("output.weight", mat(n_vocab, e)),
            ("d2t", np.arange(n_vocab, dtype=np.int64)),
            ("blk.0.attn_norm.weight", np.ones(e, np.float32)),
            ("blk.0.attn_norm_2.weight", np.ones(e, np.float32)),
            ("blk.0.attn_q.weight", mat(e, 2 * e)),
            ("blk.0.attn_k.weight", mat(e, 2 * e)),
            ("blk.0.attn_v.weight", mat(e, 2 * e)),
            ("blk.0.attn_output.weight", mat(e, e)),
            ("blk.0.ffn_norm.weight", np.ones(e, np.float32)),
            ("blk.0.ffn_gate.weight", mat(N_FF, e)),
            ("blk.0.ffn_up.weight", mat(N_FF, e)),
            ("blk.0.ffn_down.weight", mat(e, N_FF)),
        ):
            w.add_tensor(name, data)

    _write_atomic(path, fill, "eagle3")
    return path
