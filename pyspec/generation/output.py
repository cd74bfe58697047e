"""Tokens out: text pieces, stop strings, what may be streamed, logprobs, the final result (the server's
process_token, populate_token_probs and send_final_response, tools/server/server-context.cpp). The engine calls
these per new token (Engine._emit) and when a request ends; the decision to end (end of generation, budget,
context) stays with the engine's step."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from pyspec.core.vocab import Vocab
from pyspec.generation.requests import Completion, TokenLogprob
from pyspec.generation.slots import Job

__all__ = ["TokenPieces", "append_text", "completion", "decode_piece", "draft_stop_cut", "find_stop", "partial_stop",
           "release_text", "token_logprob"]


class TokenPieces:
    """Each token's piece (without special tokens' text) and whether it ends generation, asked of the
    vocabulary once per token: a vocabulary does not change."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._info: dict[int, tuple[bytes, bool]] = {}

    def get(self, tok: int) -> tuple[bytes, bool]:
        info = self._info.get(tok)
        if info is None:
            info = self._info[tok] = (self.vocab.token_to_piece_bytes(tok, special=False), self.vocab.is_eog(tok))
        return info


def decode_piece(job: Job, piece: bytes) -> str:
    """A token's piece as text; the bytes of an incomplete UTF-8 character wait in ``job.pending`` for the rest."""
    if job.pending:
        piece = job.pending + piece
    try:
        text = piece.decode("utf-8")
        job.pending = b""
    except UnicodeDecodeError:
        job.pending, text = piece, ""  # wait for the rest of the character
    return text


def append_text(job: Job, text: str) -> bool:
    """Add ``text`` to the job's text; True when a stop string now occurs (the text is cut before it)."""
    before = len(job.text)
    job.text += text
    hit, word = find_stop(job.text, job.stop, max(0, before - job.stop_longest)) if job.stop else (-1, "")
    if hit >= 0:
        job.text = job.text[:hit]
        job.stopping_word = word
        return True
    return False


def release_text(job: Job, ended: bool) -> str:
    """The text not yet streamed that can no longer turn into a stop string (all of it once the request ended)."""
    end = len(job.text) if ended or not job.stop else len(job.text) - partial_stop(job.text, job.stop)
    out = job.text[job.n_sent : end] if end > job.n_sent else ""
    job.n_sent = max(job.n_sent, end)
    return out


def token_logprob(logits: np.ndarray, vocab: Vocab, tok: int, n_probs: int) -> TokenLogprob:
    """The token's log-probability and the n_probs most likely tokens: log-softmax of one row of the target's logits."""
    row = logits.astype(np.float64)
    m = row.max()
    lse = m + np.log(np.exp(row - m).sum())
    top: list[tuple[int, str, bytes, float]] = []
    if n_probs > 0:
        ids = np.argpartition(-row, n_probs - 1)[:n_probs] if n_probs < row.size else np.arange(row.size)
        ids = ids[np.argsort(-row[ids], kind="stable")]
        for i in ids.tolist():
            b = vocab.token_to_piece_bytes(i, special=True)
            top.append((i, b.decode("utf-8", "replace"), b, float(row[i] - lse)))
    b = vocab.token_to_piece_bytes(tok, special=True)
    return TokenLogprob(tok, b.decode("utf-8", "replace"), b, float(row[tok] - lse), top)


def find_stop(text: str, stop: Sequence[str], start: int) -> tuple[int, str]:
    """The earliest position at or after ``start`` where a stop string occurs, and that string; (-1, "") if none."""
    best, word = -1, ""
    for w in stop:
        i = text.find(w, start)
        if i >= 0 and (best < 0 or i < best):
            best, word = i, w
    return best, word


def draft_stop_cut(job: Job, pieces: TokenPieces, draft: Sequence[int]) -> int:
    """How many of ``draft``'s tokens are worth verifying for ``job``: up to the first that ends its generation,
    an end-of-generation token or the one whose text completes a stop string. Verifying past it cannot change
    the output (if it is accepted the request ends there, and what follows it is dropped), only cost rows: a
    copying drafter runs on through the stop string of the text it copies (a file's closing fence, an agent's
    ``Result:``).

    Matched on bytes (the text so far that a stop string may begin in, the bytes of an incomplete character,
    then the pieces), so no piece is decoded. A cut that comes early (a stop string inside bytes that never
    decode) changes only what is verified, never the output."""
    n = len(draft)
    infos = [pieces.get(t) for t in draft]
    for i, (_, is_eog) in enumerate(infos):
        if is_eog:
            n = i + 1
            break
    if not job.stop or n == 0:
        return n
    head = job.text[-(job.stop_longest - 1):].encode() if job.stop_longest > 1 else b""
    head += job.pending
    hay = head + b"".join(piece for piece, _ in infos[:n])
    ends = [i + len(w) for w in (w.encode() for w in job.stop) if (i := hay.find(w)) >= 0]
    if not ends:
        return n
    end = min(ends) - len(head)  # draft bytes up to the end of the first stop string
    at = 0
    for k, (piece, _) in enumerate(infos[:n]):
        at += len(piece)
        if at >= end:
            return k + 1
    return n


def partial_stop(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string (held back when streaming)."""
    n = 0
    for w in stop:
        for k in range(min(len(w) - 1, len(text)), n, -1):
            if text.endswith(w[:k]):
                n = k
                break
    return n


def completion(job: Job, slot_id: int) -> Completion:
    """The request's final result (the server's send_final_response): its text, tokens, stop, logprobs and stats."""
    st = job.stats
    st.n_gen = len(job.generated)
    if job.t_first:
        st.t_gen_ms = (time.perf_counter() - job.t_first) * 1e3
    return Completion(job.handle.id, job.prompt, job.generated, job.text, job.stop_reason, job.stopping_word,
                      slot_id, job.logprobs, st, job.truncated)
