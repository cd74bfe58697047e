"""Context and sequence state saved to files (and bytes) and loaded back (pyspec.core.state)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pyspec import Batch, Context
from pyspec.errors import StateFileError

PROMPT = "In a hole in the ground there lived a hobbit"


def decode(ctx: Context, tokens: list[int], seq_id: int = 0, pos0: int = 0) -> np.ndarray:
    batch = Batch(len(tokens), 0, 1)
    batch.add_sequence(tokens, pos0, seq_id)
    ctx.decode(batch)
    return ctx.get_logits_ith(-1).copy()


def new_ctx(model) -> Context:
    return Context(model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=2, kv_unified=True,
                   n_threads=1, n_threads_batch=1)


@pytest.fixture
def prompt(target_model) -> list[int]:
    return target_model.vocab.tokenize(PROMPT)


def test_whole_state_file_round_trip_continues_identically(target_model, prompt, tmp_path):
    path = tmp_path / "session.bin"
    nxt = prompt[-1]
    with new_ctx(target_model) as a, new_ctx(target_model) as b:
        decode(a, prompt)
        a.state_save_file(path, prompt)
        assert b.state_load_file(path) == prompt
        # at this revision a state holds the memory (and the architecture), not the outputs:
        # the logits of the last decode are not restored, and b has none to show
        with pytest.raises(IndexError):
            b.get_logits_ith(-1)
        assert b.memory.seq_pos_max(0) == len(prompt) - 1
        np.testing.assert_array_equal(decode(b, [nxt], pos0=len(prompt)), decode(a, [nxt], pos0=len(prompt)))


def test_whole_state_bytes_round_trip(target_model, prompt):
    with new_ctx(target_model) as a, new_ctx(target_model) as b:
        decode(a, prompt)
        data = a.state_get()
        assert len(data) > 1000
        b.state_set(data)
        assert b.memory.seq_pos_max(0) == len(prompt) - 1
        np.testing.assert_array_equal(decode(b, [7], pos0=len(prompt)), decode(a, [7], pos0=len(prompt)))


def test_sequence_state_file_moves_a_sequence_into_another(target_model, prompt, tmp_path):
    path = tmp_path / "seq0.bin"
    with new_ctx(target_model) as a, new_ctx(target_model) as b:
        decode(a, prompt, seq_id=0)
        written = a.state_seq_save_file(path, 0, prompt)
        assert written == path.stat().st_size
        assert b.state_seq_load_file(path, 1) == prompt
        assert b.memory.seq_pos_max(1) == len(prompt) - 1 and b.memory.seq_pos_max(0) == -1
        want = decode(a, [42], seq_id=0, pos0=len(prompt))
        np.testing.assert_array_equal(decode(b, [42], seq_id=1, pos0=len(prompt)), want)


def test_a_state_without_tokens_round_trips(target_model, prompt, tmp_path):
    with new_ctx(target_model) as a, new_ctx(target_model) as b:
        decode(a, prompt)
        a.state_save_file(tmp_path / "s.bin")
        a.state_seq_save_file(tmp_path / "q.bin", 0)
        assert b.state_load_file(tmp_path / "s.bin") == []
        assert b.state_seq_load_file(tmp_path / "q.bin", 0) == []


def test_bad_state_files_raise_instead_of_crashing(target_model, draft_model, prompt, tmp_path):
    with new_ctx(target_model) as a, new_ctx(target_model) as b:
        decode(a, prompt)
        a.state_save_file(tmp_path / "whole.bin", prompt)
        a.state_seq_save_file(tmp_path / "seq.bin", 0, prompt)
        whole = (tmp_path / "whole.bin").read_bytes()

        with pytest.raises(FileNotFoundError):
            b.state_load_file(tmp_path / "missing.bin")
        (tmp_path / "short.bin").write_bytes(b"ggsn")
        with pytest.raises(StateFileError, match="too short"):
            b.state_load_file(tmp_path / "short.bin")
        with pytest.raises(StateFileError, match="not a state file"):
            b.state_load_file(tmp_path / "seq.bin")  # a sequence file is not a whole-context file
        with pytest.raises(StateFileError, match="not a sequence state file"):
            b.state_seq_load_file(tmp_path / "whole.bin", 0)
        (tmp_path / "version.bin").write_bytes(whole[:4] + (99).to_bytes(4, "little") + whole[8:])
        with pytest.raises(StateFileError, match="version 99"):
            b.state_load_file(tmp_path / "version.bin")
        (tmp_path / "tokens.bin").write_bytes(whole[:8] + (10**6).to_bytes(4, "little") + whole[12:100])
        with pytest.raises(StateFileError, match="truncated"):
            b.state_load_file(tmp_path / "tokens.bin")
        # a good header over a body cut short or made of noise: llama.cpp's own checks refuse it
        decode(b, prompt)
        (tmp_path / "cut.bin").write_bytes(whole[: len(whole) // 2])
        with pytest.raises(StateFileError):
            b.state_load_file(tmp_path / "cut.bin")
        assert b.memory.seq_pos_max(0) == -1  # a failed restore leaves the memory empty
        head = whole[: 12 + 4 * len(prompt)]
        # noise where the architecture name starts: its length field would make llama.cpp
        # allocate gigabytes (3.6 GB for this seed) before finding the name is wrong
        rng = np.random.default_rng(0)
        (tmp_path / "noise.bin").write_bytes(head + rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())
        with pytest.raises(StateFileError, match="unreadable architecture"):
            b.state_load_file(tmp_path / "noise.bin")
        (tmp_path / "arch.bin").write_bytes(head + struct.pack("<I", 4) + b"gpt2" + whole[len(head) + 9:])
        with pytest.raises(StateFileError, match="a 'gpt2' model; this context runs a 'llama' model"):
            b.state_load_file(tmp_path / "arch.bin")
        # a sequence state claiming 2**31 cells: llama.cpp would reserve a batch that size first
        seq = (tmp_path / "seq.bin").read_bytes()
        body = 12 + 4 * len(prompt)
        cells = seq[:body] + seq[body:body + 4] + struct.pack("<I", 2**31) + seq[body + 8:]
        (tmp_path / "cells.bin").write_bytes(cells)
        with pytest.raises(StateFileError, match="corrupt: a count of 2147483648"):
            b.state_seq_load_file(tmp_path / "cells.bin", 1)
        (tmp_path / "seqcut.bin").write_bytes(seq[: len(seq) - 100])
        with pytest.raises(StateFileError, match="end of buffer"):
            b.state_seq_load_file(tmp_path / "seqcut.bin", 1)
        assert b.memory.seq_pos_max(1) == -1  # nothing half-loaded stays behind
    # a state of another model (other layer count)
    with new_ctx(draft_model) as d:
        with pytest.raises(StateFileError):
            d.state_load_file(tmp_path / "whole.bin")
        with pytest.raises(StateFileError):
            d.state_seq_load_file(tmp_path / "seq.bin", 0)


def test_bad_arguments_are_refused(target_model, prompt, tmp_path):
    with new_ctx(target_model) as a:
        decode(a, prompt)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            a.state_save_file(tmp_path / "x.bin", [1, 2, 10**9])
        with pytest.raises(ValueError, match="seq_id"):
            a.state_seq_save_file(tmp_path / "x.bin", 5)
        with pytest.raises(FileNotFoundError, match="does not exist"):
            a.state_save_file(tmp_path / "no" / "such" / "x.bin")
        with pytest.raises(IsADirectoryError):
            a.state_save_file(tmp_path)
        with pytest.raises(ValueError):
            a.state_set(b"")
