"""Vocabulary access (llama_vocab_* of llama.h) for a loaded model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pyspec.ffi import ffi, llama

# the longest text tokenize() takes: 8 MiB, some 2 million tokens, more than any context holds
MAX_TEXT_BYTES = 8 << 20

if TYPE_CHECKING:
    from pyspec.core.model import Model

__all__ = ["Vocab"]


class Vocab:
    """The vocabulary of a Model; valid while the model is open."""

    def __init__(self, model: Model) -> None:
        self._model = model
        self._n_tokens: int | None = None
        # token -> piece (lstrip 0), per value of `special`: a vocabulary does not change, and
        # the generation loop asks for every token it emits
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})
        self._max_piece: int | None = None

    @property
    def ptr(self):
        return llama.llama_model_get_vocab(self._model.ptr)

    @property
    def n_tokens(self) -> int:
        if self._n_tokens is None:
            self._n_tokens = int(llama.llama_vocab_n_tokens(self.ptr))
        return self._n_tokens

    def __len__(self) -> int:
        return self.n_tokens

    @property
    def type(self) -> int:
        return llama.llama_vocab_type(self.ptr)

    @property
    def bos(self) -> int:
        return llama.llama_vocab_bos(self.ptr)

    @property
    def eos(self) -> int:
        return llama.llama_vocab_eos(self.ptr)

    @property
    def eot(self) -> int:
        return llama.llama_vocab_eot(self.ptr)

    @property
    def nl(self) -> int:
        return llama.llama_vocab_nl(self.ptr)

    @property
    def add_bos(self) -> bool:
        return bool(llama.llama_vocab_get_add_bos(self.ptr))

    @property
    def add_eos(self) -> bool:
        return bool(llama.llama_vocab_get_add_eos(self.ptr))

    @property
    def add_sep(self) -> bool:
        return bool(llama.llama_vocab_get_add_sep(self.ptr))

    @property
    def sep(self) -> int:
        """Mirrors llama_vocab_sep: the sentence separator, or -1 (LLAMA_TOKEN_NULL)."""
        return int(llama.llama_vocab_sep(self.ptr))

    @property
    def pad(self) -> int:
        return int(llama.llama_vocab_pad(self.ptr))

    @property
    def mask(self) -> int:
        return int(llama.llama_vocab_mask(self.ptr))

    def fim_tokens(self) -> dict[str, int]:
        """The fill-in-the-middle tokens {pre, suf, mid, pad, rep, sep} (-1 where the model has none)."""
        return {name: int(getattr(llama, f"llama_vocab_fim_{name}")(self.ptr))
                for name in ("pre", "suf", "mid", "pad", "rep", "sep")}

    def check_token(self, token: int) -> int:
        """Return token as int; TypeError for what is not an integer, ValueError if it is outside the vocabulary."""
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise TypeError(f"a token id must be an integer, got {token!r:.40}")
        t = int(token)
        n = self.n_tokens
        if not 0 <= t < n:
            raise ValueError(f"token {t} is outside the vocabulary (0..{n - 1})")
        return t

    def is_eog(self, token: int) -> bool:
        return bool(llama.llama_vocab_is_eog(self.ptr, self.check_token(token)))

    def is_control(self, token: int) -> bool:
        return bool(llama.llama_vocab_is_control(self.ptr, self.check_token(token)))

    def get_text(self, token: int) -> str:
        return ffi.string(llama.llama_vocab_get_text(self.ptr, self.check_token(token))).decode("utf-8", "replace")

    def get_text_bytes(self, token: int) -> bytes:
        return ffi.string(llama.llama_vocab_get_text(self.ptr, self.check_token(token)))

    def get_score(self, token: int) -> float:
        return float(llama.llama_vocab_get_score(self.ptr, self.check_token(token)))

    def get_attr(self, token: int) -> int:
        return int(llama.llama_vocab_get_attr(self.ptr, self.check_token(token)))

    def max_piece_bytes(self) -> int:
        """The longest token's text, in bytes (special tokens' included; read once)."""
        if self._max_piece is None:
            ptr, buf = self.ptr, ffi.new("char[]", 256)
            self._max_piece = max((abs(llama.llama_token_to_piece(ptr, t, buf, 256, 0, True))
                                   for t in range(self.n_tokens)), default=1)
        return max(1, self._max_piece)

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False,
                 max_tokens: int | None = None) -> list[int]:
        """Mirrors llama_tokenize (llama.h), growing the buffer as common_tokenize does.

        ValueError for a text over MAX_TEXT_BYTES: llama.cpp's tokenizer holds some 50 bytes per byte of text
        while it works (840 MiB for 16 MiB on Gemma 3), and a failed allocation there aborts the process.
        ``max_tokens``: ValueError, before any work, for a text too long to give so few tokens (more bytes than
        twice as many of the vocabulary's longest tokens): with ``parse_special`` llama.cpp's tokenizer takes
        time quadratic in the special tokens it finds (100,000 "<s>" took 43 s on a busy 2-core machine)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if len(data) > MAX_TEXT_BYTES:
            raise ValueError(f"text of {len(data)} bytes is too long to tokenize (at most {MAX_TEXT_BYTES} bytes)")
        if max_tokens is not None and len(data) > 2 * (max_tokens + 2) and \
                len(data) > 2 * (max_tokens + 2) * self.max_piece_bytes():
            raise ValueError(f"text of {len(data)} bytes is longer than {max_tokens} tokens can be "
                             f"(the longest token has {self.max_piece_bytes()} bytes)")
        n_max = len(data) + 2 * int(add_special) + 1
        buf = ffi.new("llama_token[]", n_max)
        n = llama.llama_tokenize(self.ptr, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            if n == -(2**31):
                raise ValueError("tokenization result does not fit in int32")
            n_max = -n
            buf = ffi.new("llama_token[]", n_max)
            n = llama.llama_tokenize(self.ptr, data, len(data), buf, n_max, add_special, parse_special)
        return list(ffi.unpack(buf, n))

    def token_to_piece_bytes(self, token: int, special: bool = True, lstrip: int = 0) -> bytes:
        """Mirrors llama_token_to_piece (llama.h): raw bytes, which may be part of a UTF-8 character."""
        t = self.check_token(token)
        ptr = self.ptr  # a closed model raises here, also for a piece read before
        if lstrip == 0:
            cache = self._pieces[bool(special)]
            piece = cache.get(t)
            if piece is None:
                piece = cache[t] = self._piece(ptr, t, special, 0)
            return piece
        return self._piece(ptr, t, special, lstrip)

    @staticmethod
    def _piece(ptr, t: int, special: bool, lstrip: int) -> bytes:
        buf = ffi.new("char[]", 64)
        n = llama.llama_token_to_piece(ptr, t, buf, 64, lstrip, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = llama.llama_token_to_piece(ptr, t, buf, -n, lstrip, special)
        return ffi.unpack(buf, n)

    def token_to_piece(self, token: int, special: bool = True) -> str:
        return self.token_to_piece_bytes(token, special).decode("utf-8", "replace")

    def detokenize(self, tokens: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Mirrors llama_detokenize (llama.h)."""
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        if arr.size and (arr.min() < 0 or arr.max() >= self.n_tokens):
            bad = int(arr[(arr < 0) | (arr >= self.n_tokens)][0])
            self.check_token(bad)
        toks = ffi.from_buffer("llama_token[]", arr)
        cap = max(16, arr.size * 8)
        buf = ffi.new("char[]", cap)
        n = llama.llama_detokenize(self.ptr, toks, arr.size, buf, cap, remove_special, unparse_special)
        if n < 0:
            cap = -n
            buf = ffi.new("char[]", cap)
            n = llama.llama_detokenize(self.ptr, toks, arr.size, buf, cap, remove_special, unparse_special)
        return ffi.unpack(buf, n).decode("utf-8", "replace")
