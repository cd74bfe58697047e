"""llama-server's /infill prompt: fill-in-the-middle tokens around the cursor, with extra files before them.

:func:`format_prompt_infill` follows server-common.cpp's ``format_prompt_infill`` statement for statement
(the FIM repo-level pattern, https://arxiv.org/pdf/2409.12186)::

    [FIM_REP]myproject
    [FIM_SEP]filename0
    extra chunk 0
    ...
    [FIM_SEP]filename
    [FIM_PRE]prefix[FIM_SUF]suffix[FIM_MID]prompt

The prefix keeps its last 3/4 of a batch, the suffix what is left of the batch's quarter after the
prompt, and the extra chunks fill what the context has left after a batch and twice ``n_predict``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["InfillInput", "fim_missing", "format_prompt_infill"]

NULL = -1  # LLAMA_TOKEN_NULL
# the separator of extra chunks when the model has no FIM_SEP token ("\n\n--- snippet ---\n\n")
_CHUNK_PREFIX = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class InfillInput:
    """An /infill body's text parts: each of prefix / suffix a text or texts and token ids mixed."""

    prefix: str | list[int | str]
    suffix: str | list[int | str]
    extra: list[tuple[str, str]]  # (filename, text) of each input_extra chunk
    prompt: str


def fim_missing(fim: dict[str, int]) -> str:
    """What the model lacks for infill, in llama-server's words ("" when it has the three tokens)."""
    return "".join(f"{what} token is missing. " for key, what in (("pre", "prefix"), ("suf", "suffix"),
                                                                  ("mid", "middle")) if fim[key] == NULL)


def _mixed(vocab: Any, p: str | Sequence[int | str]) -> list[int]:
    # tokenize_mixed with add_special false, parse_special false
    if isinstance(p, str):
        return list(vocab.tokenize(p, add_special=False, parse_special=False))
    out: list[int] = []
    for part in p:
        out += vocab.tokenize(part, add_special=False, parse_special=False) if isinstance(part, str) else [part]
    return out


def format_prompt_infill(vocab: Any, inp: InfillInput, n_batch: int, n_predict: int, n_ctx: int, spm_infill: bool,
                         tokens_prompt: Sequence[int]) -> list[int | str]:
    """Mirrors format_prompt_infill (server-common.cpp): the prompt tokens of an infill request."""
    fim = vocab.fim_tokens()

    def tok(text: str) -> list[int]:
        return list(vocab.tokenize(text, add_special=False, parse_special=False))

    extra_tokens: list[int] = []
    tokens_prefix = _mixed(vocab, inp.prefix)
    tokens_suffix = _mixed(vocab, inp.suffix)

    if fim["rep"] != NULL:
        extra_tokens.append(fim["rep"])
        extra_tokens += tok("myproject\n")
    for filename, text in inp.extra:
        if fim["sep"] != NULL:
            extra_tokens.append(fim["sep"])
            extra_tokens += tok(filename + "\n")
        else:
            extra_tokens += tok(_CHUNK_PREFIX)
        extra_tokens += tok(text)

    if fim["sep"] != NULL:
        extra_tokens.append(fim["sep"])
        extra_tokens += tok("filename\n")

    # for now pick FIM context to fit in a batch (ratio prefix:suffix = 3:1)
    n_prefix_take = min(len(tokens_prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(tokens_suffix), max(0, (n_batch // 4) - (2 + len(tokens_prompt))))
    # fill the rest of the context with extra chunks
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))

    tokens_prefix = tokens_prefix[len(tokens_prefix) - n_prefix_take:]
    tokens_suffix = tokens_suffix[:n_suffix_take]

    tokens_prefix = [fim["pre"], *tokens_prefix, *tokens_prompt]
    tokens_suffix = [fim["suf"], *tokens_suffix]

    embd_inp = tokens_suffix if spm_infill else tokens_prefix
    embd_end = tokens_prefix if spm_infill else tokens_suffix

    if vocab.add_bos:
        embd_inp = [vocab.bos, *embd_inp]

    # put the extra context before the FIM prefix
    embd_inp = extra_tokens[len(extra_tokens) - n_extra_take:] + embd_inp
    embd_inp += embd_end
    embd_inp.append(fim["mid"])
    return list(embd_inp)  # a prompt of token ids (a Prompt of the server's)
