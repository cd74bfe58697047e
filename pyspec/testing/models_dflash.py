"""Tiny DFlash and DSpark drafters (architecture ``dflash``) for the cyclic target.

llama.cpp 0c1e57098 adds two speculative types that share one C++ struct,
``common_speculative_impl_draft_dflash``: ``draft-dflash`` (block diffusion: the
draft decodes ``[id_last, <mask> * (n_max)]`` in one non-causal pass over a KV
cache that ``process()`` filled with the target's layer-input features) and
``draft-dspark`` (the same body plus a Markov head that chains the block's
logits, and a confidence head). ``common_speculative_types_from_gguf`` tells
them apart by the tensor ``markov_w1.weight``.

- ``cyclic-dflash``: a DFlash drafter for ``cyclic-target`` (models.make_cyclic_target):
  reads the inputs of target layers 1, 2, 3, block size 8, mask token 3.
- ``cyclic-dspark``: the same drafter plus a Markov head (rank 32) and a
  confidence head.
- ``cyclic-dspark-bonus``: ``cyclic-dspark`` with ``dflash.sample_from_anchor`` =
  false (SpecForge's bonus-anchor layout: the block is ``[id_last, <mask> * n_max]``
  as for DFlash and slot 0 is no prediction).
- ``cyclic-dflash-shared``: ``cyclic-dflash`` without ``token_embd`` and
  ``output``: like the published DFlash drafters it borrows the target's through
  ``ctx_other`` (a context on it needs ``ctx_other=`` the cyclic target's context).

The first two carry their own ``token_embd`` and ``output``, so a context on them
needs no ``ctx_other``; all have the target's n_embd (64), as they must: the encoder
input width is ``n_target_layers * n_embd`` of the *draft*, while speculative.cpp
sends rows of ``n_target_layers * n_embd`` of the *target*.

The weights follow the cyclic map (models.cyclic_successor): the query weights
are zero, so every block position attends evenly over the draft cache; the mask
token's embedding row is zero, so the attention output of a mask position points
along the anchor's embedding, and the head reads ``succ(id_last)`` off it. The
DFlash draft is then right about its first token and mostly wrong afterwards;
the DSpark Markov head adds a bias towards ``succ(previous token)`` at each
block position, so its whole block follows the cycle. The target features enter
the cache through a small encoder-norm gain (``DFLASH_FEATURE_GAIN``): they move
the logits a little without changing the argmax.

File names carry models.GENERATOR_VERSION and DFLASH_GENERATOR_VERSION: bump the
latter whenever the bytes a generator here writes change.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pyspec.testing.models import (
    GENERATOR_VERSION,
    cache_dir,
    cyclic_successor,
    gguf_module,
    llama_vocab_kv,
    make_cyclic_target,
)

__all__ = [
    "DFLASH_ARCH",
    "DFLASH_BLOCK_SIZE",
    "DFLASH_GENERATOR_VERSION",
    "DFLASH_MASK_TOKEN",
    "DFLASH_TARGET_LAYERS",
    "DSPARK_MARKOV_RANK",
    "make_all_dflash",
    "make_cyclic_dflash",
    "make_cyclic_dflash_shared",
    "make_cyclic_dspark",
    "make_cyclic_dspark_bonus",
]

DFLASH_GENERATOR_VERSION = "d1"

DFLASH_ARCH = "dflash"  # LLM_ARCH_DFLASH (src/llama-arch.cpp); both types use it

# The shapes of models.py (its cyclic target: llama, 4 layers, n_embd 64), kept equal on purpose.
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 4  # V carries the whole anchor embedding: one KV head per query head
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 192
N_CTX_TRAIN = 4096
RMS_EPS = 1e-5
ROPE_BASE = 10000.0
TARGET_N_LAYER = 4  # models.TARGET_LAYERS

DFLASH_LAYERS = 1
# inputs of the cyclic target's layers 1, 2, 3 (llama_set_embeddings_layer_inp on ctx_tgt)
DFLASH_TARGET_LAYERS = (1, 2, 3)
# dflash.block_size: the trained block; draft-dflash clamps n_max to block_size - 1, draft-dspark
# (anchor-first) to block_size
DFLASH_BLOCK_SIZE = 8
# tokenizer.ggml.mask_token_id: a byte token (<0x00>), neither the unknown token nor a cycle token,
# so a test can tell that llama_vocab_mask read the key
DFLASH_MASK_TOKEN = 3
DSPARK_MARKOV_RANK = 32

DFLASH_SEED = 20240607 + 40
DFLASH_LOGIT_SCALE = 0.6  # models.CYCLIC_LOGIT_SCALE: succ(t) scores about 8 * 0.6
DFLASH_OTHER_ROW_SCALE = 0.3  # models.CYCLIC_OTHER_ROW_SCALE
DFLASH_EMBD_NOISE = 0.3  # models.CYCLIC_EMBD_NOISE
# attn_output = gain * I: the mean over n cache cells shrinks the anchor's share to 1/n, and the
# FFN (DFLASH_FFN_SCALE) must stay far below it for n up to the training context
DFLASH_ATTN_OUT_GAIN = 64.0
DFLASH_FFN_SCALE = 1e-3
DFLASH_SHARED_ATTN_OUT_GAIN = 512.0  # cyclic-dflash-shared: the anchor against the target's mask embedding
DFLASH_FEATURE_GAIN = 0.01  # enc.output_norm gain: the injected V rows stay small against the anchor's
DSPARK_MARKOV_PEAK = 12.0  # Markov bias of succ(prev); other cycle tokens get about N(0, (peak / sqrt(rank))^2)
DSPARK_CONF_BIAS = 1.0  # sigmoid(1) = 0.73: confidences around it, spread by small random weights


# ---------------------------------------------------------------------------
# writing (the same steps as models.py's private writer)
# ---------------------------------------------------------------------------


def _model_path(kind: str) -> Path:
    return cache_dir() / f"pyspec-tiny-{kind}-{GENERATOR_VERSION}-{DFLASH_GENERATOR_VERSION}.gguf"


def _write_atomic(path: Path, fill: Callable[[Any], None]) -> None:
    """Write a GGUF through a temp file in the same folder, then rename it into place."""
    gguf = gguf_module()
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.chmod(0o644)  # mkstemp makes it private; a cache may be shared
    try:
        writer = gguf.GGUFWriter(tmp, DFLASH_ARCH)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _make(kind: str, fill: Callable[[Any], None]) -> Path:
    path = _model_path(kind)
    if not path.is_file():
        _write_atomic(path, fill)
    return path


@functools.lru_cache(maxsize=1)
def _vocab() -> tuple[int, np.ndarray]:
    """(n_vocab, token_type of every token) of the shared vocabulary."""
    kv = {k: v for k, v, _, _ in llama_vocab_kv()}
    return len(kv["tokenizer.ggml.tokens"]), np.asarray(kv["tokenizer.ggml.token_type"])


def _add_kv(writer: Any, name: str) -> None:
    """general.*, the hyper-parameters llama_model_dflash::load_arch_hparams reads, the vocabulary."""
    gguf = gguf_module()
    n_vocab, _ = _vocab()
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(DFLASH_LAYERS)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(RMS_EPS)  # required by load_arch_hparams
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(n_vocab)
    # required: "DFlash model requires 'target_layers' in GGUF metadata"; written as int32 like
    # eagle3.target_layers (get_arr into std::vector<int32_t>)
    writer.add_array(f"{DFLASH_ARCH}.target_layers", list(DFLASH_TARGET_LAYERS))
    # u32 for hparams.dflash_block_size; speculative.cpp reads it back as a string (atoi)
    writer.add_uint32(f"{DFLASH_ARCH}.block_size", DFLASH_BLOCK_SIZE)
    for key, value, vtype, sub_type in llama_vocab_kv():
        writer.add_key_value(key, value, vtype, sub_type)
    writer.add_mask_token_id(DFLASH_MASK_TOKEN)


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------


def _mat(rng: np.random.Generator, n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
    # numpy shape = reversed ggml ne (rows = outputs); std scale/sqrt(n_in), as models._Weights.mat
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    return (w * np.float32(scale / np.sqrt(n_in))).astype(np.float16)


@functools.lru_cache(maxsize=1)
def _dflash_tensors() -> tuple[tuple[str, np.ndarray], ...]:
    """The DFlash body shared by both drafters, in file order."""
    n_vocab, token_type = _vocab()
    succ, cycles = cyclic_successor()
    states = np.sort(np.fromiter((t for cyc in cycles for t in cyc), dtype=np.int64))
    rng = np.random.default_rng(DFLASH_SEED)

    # the cyclic target's construction with this drafter's own keys: token t's row is the key of
    # succ(t) plus noise, a cycle token's head row is its key; control / byte tokens score 0
    keys = rng.standard_normal((n_vocab, N_EMBD), dtype=np.float32)
    keys[states] /= np.sqrt((keys[states] ** 2).mean(axis=1, keepdims=True))
    embd = keys[succ] + np.float32(DFLASH_EMBD_NOISE) * rng.standard_normal((n_vocab, N_EMBD), dtype=np.float32)
    embd[DFLASH_MASK_TOKEN] = 0.0  # a mask position's residual is its attention output alone
    head = np.float32(DFLASH_OTHER_ROW_SCALE / np.sqrt(N_EMBD)) * rng.standard_normal(
        (n_vocab, N_EMBD), dtype=np.float32)
    head[states] = keys[states] * np.float32(DFLASH_LOGIT_SCALE / np.sqrt(N_EMBD))
    head[token_type != 1] = 0.0

    n_embd_enc = len(DFLASH_TARGET_LAYERS) * N_EMBD
    eye = np.eye(N_EMBD, dtype=np.float32)
    out: list[tuple[str, np.ndarray]] = [
        ("token_embd.weight", embd.astype(np.float16)),
        ("output.weight", head.astype(np.float16)),
        ("output_norm.weight", np.ones(N_EMBD, dtype=np.float32)),
        # encoder: fc [n_layers * n_embd -> n_embd], then RMS norm with a small gain (enc.output_norm)
        ("fc.weight", _mat(rng, N_EMBD, n_embd_enc)),
        ("enc.output_norm.weight", np.full(N_EMBD, DFLASH_FEATURE_GAIN, dtype=np.float32)),
    ]
    for il in range(DFLASH_LAYERS):
        blk = f"blk.{il}"
        out += [
            (f"{blk}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32)),
            # zero queries: every block position attends evenly over the whole draft cache
            (f"{blk}.attn_q.weight", np.zeros((N_HEAD * HEAD_DIM, N_EMBD), dtype=np.float16)),
            (f"{blk}.attn_k.weight", _mat(rng, N_HEAD_KV * HEAD_DIM, N_EMBD)),
            (f"{blk}.attn_v.weight", eye.astype(np.float16)),
            (f"{blk}.attn_output.weight", (DFLASH_ATTN_OUT_GAIN * eye).astype(np.float16)),
            # required per-head norms of the dflash graph (Qwen3-style backbone)
            (f"{blk}.attn_q_norm.weight", np.ones(HEAD_DIM, dtype=np.float32)),
            (f"{blk}.attn_k_norm.weight", np.ones(HEAD_DIM, dtype=np.float32)),
            (f"{blk}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32)),
            (f"{blk}.ffn_gate.weight", _mat(rng, N_FF, N_EMBD)),
            (f"{blk}.ffn_up.weight", _mat(rng, N_FF, N_EMBD)),
            (f"{blk}.ffn_down.weight", _mat(rng, N_EMBD, N_FF, DFLASH_FFN_SCALE)),
        ]
    return tuple(out)


def _dspark_tensors() -> Iterator[tuple[str, np.ndarray]]:
    """The Markov head (markov_w1 / markov_w2) and the confidence head (conf_proj) of DSpark."""
    n_vocab, token_type = _vocab()
    succ, cycles = cyclic_successor()
    states = np.sort(np.fromiter((t for cyc in cycles for t in cyc), dtype=np.int64))
    rng = np.random.default_rng(DFLASH_SEED + 1)
    r = DSPARK_MARKOV_RANK
    mkeys = rng.standard_normal((n_vocab, r), dtype=np.float32)
    mkeys /= np.sqrt((mkeys**2).mean(axis=1, keepdims=True))  # RMS 1: mkeys[s] . mkeys[s] = r
    # bias(prev)[v] = markov_w2[v] . markov_w1[prev] = peak / r * mkeys[v] . mkeys[succ(prev)]
    w1 = mkeys[succ]
    w2 = mkeys * np.float32(DSPARK_MARKOV_PEAK / r)
    w2[token_type != 1] = 0.0
    keep = np.zeros(n_vocab, dtype=bool)
    keep[states] = True
    w2[~keep] = 0.0  # only cycle tokens get a bias: the rest stay below the cycle
    yield "markov_w1.weight", w1.astype(np.float16)  # ggml {rank, n_vocab}
    yield "markov_w2.weight", w2.astype(np.float16)  # ggml {rank, n_vocab_draft}
    # conf = sigmoid(conf_proj . [h; markov_w1[prev]] + b): ggml {n_embd + rank, 1}
    yield "conf_proj.weight", (0.05 * rng.standard_normal((1, N_EMBD + r), dtype=np.float32)).astype(np.float32)
    yield "conf_proj.bias", np.full(1, DSPARK_CONF_BIAS, dtype=np.float32)


def _add_tensors(writer: Any, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
    for name, data in tensors:
        writer.add_tensor(name, data)


# ---------------------------------------------------------------------------
# the makers
# ---------------------------------------------------------------------------


def make_cyclic_dflash() -> Path:
    """A DFlash drafter for ``cyclic-target`` (architecture ``dflash``, 1 layer, no Markov head).

    common_speculative_types_from_gguf classifies it as draft-dflash. Its
    first draft token is usually succ(id_last), the rest usually repeat it.
    """

    def fill(writer: Any) -> None:
        _add_kv(writer, "pyspec-tiny-cyclic-dflash")
        _add_tensors(writer, _dflash_tensors())

    return _make("cyclic-dflash", fill)


def make_cyclic_dspark() -> Path:
    """A DSpark drafter for ``cyclic-target``: the DFlash body plus Markov and confidence heads.

    ``markov_w1.weight`` makes common_speculative_types_from_gguf classify it as
    draft-dspark. ``dflash.sample_from_anchor`` = true (anchor-first: the block
    is ``[id_last, <mask> * (n_max - 1)]`` and every position is a draft
    token); ``dflash.has_confidence_head`` = true, so ``p_min > 0`` is allowed
    and truncates the block where the confidence drops below it.
    """

    return _make("cyclic-dspark", _dspark_fill("pyspec-tiny-cyclic-dspark", sample_from_anchor=True))


def make_cyclic_dspark_bonus() -> Path:
    """``cyclic-dspark`` with ``dflash.sample_from_anchor`` = false: the bonus-anchor layout.

    The block is ``[id_last, <mask> * n_max]`` (n_max clamped to block_size - 1), slot 0 passes
    through the Markov head unbiased and is not read; the draft is the Markov chain from
    position 1 on, which follows the cycle.
    """
    return _make("cyclic-dspark-bonus", _dspark_fill("pyspec-tiny-cyclic-dspark-bonus", sample_from_anchor=False))


def _dspark_fill(name: str, sample_from_anchor: bool) -> Callable[[Any], None]:
    def fill(writer: Any) -> None:
        _add_kv(writer, name)
        writer.add_bool(f"{DFLASH_ARCH}.sample_from_anchor", sample_from_anchor)
        writer.add_bool(f"{DFLASH_ARCH}.has_confidence_head", True)
        _add_tensors(writer, _dflash_tensors())
        _add_tensors(writer, _dspark_tensors())

    return fill


def make_cyclic_dflash_shared() -> Path:
    """``cyclic-dflash`` without ``token_embd`` and ``output``: the decoder borrows the cyclic target's
    (``ctx_other``), as the published DFlash drafters do.

    The target's mask row is not zero: ``attn_v`` projects its direction out (the
    mask positions add nothing to the attention output) and ``attn_output`` has the
    larger gain DFLASH_SHARED_ATTN_OUT_GAIN, so that the anchor's share of the
    attention output outweighs the mask embedding in a mask position's residual for
    caches up to a few hundred cells: the first draft token is then succ(id_last).
    """
    gguf = gguf_module()
    reader = gguf.GGUFReader(make_cyclic_target())
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    u = np.asarray(embd.data, dtype=np.float32).reshape(-1, N_EMBD)[DFLASH_MASK_TOKEN]
    u = u / np.linalg.norm(u)
    eye = np.eye(N_EMBD, dtype=np.float32)
    own = {
        "blk.0.attn_v.weight": (eye - np.outer(u, u)).astype(np.float16),
        "blk.0.attn_output.weight": (DFLASH_SHARED_ATTN_OUT_GAIN * eye).astype(np.float16),
    }

    def fill(writer: Any) -> None:
        _add_kv(writer, "pyspec-tiny-cyclic-dflash-shared")
        _add_tensors(writer, ((n, own.get(n, t)) for n, t in _dflash_tensors() if n not in _BORROWED))

    return _make("cyclic-dflash-shared", fill)


_BORROWED = ("token_embd.weight", "output.weight")  # what a drafter may take from the target (ctx_other)


def make_all_dflash() -> dict[str, Path]:
    """Every model of this module, by name."""
    return {"cyclic-dflash": make_cyclic_dflash(), "cyclic-dspark": make_cyclic_dspark(),
            "cyclic-dspark-bonus": make_cyclic_dspark_bonus(), "cyclic-dflash-shared": make_cyclic_dflash_shared()}
