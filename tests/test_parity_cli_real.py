"""pyspec parity --real: the real model (gemma3 270M) drafts only for the types it can serve."""

from __future__ import annotations

import pytest

from pyspec.cli import parity


@pytest.mark.parametrize("types", ["draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark"])
def test_real_refuses_the_types_whose_drafter_the_real_model_lacks(types):
    args = parity._parser().parse_args(["--real", "--types", types])
    with pytest.raises(SystemExit, match="no EAGLE3 head, no MTP block and no DFlash / DSpark drafter"):
        parity.scenarios(args)


def test_real_takes_the_real_model_for_a_type_it_can_serve(monkeypatch, tmp_path):
    from pyspec.generation import contexts

    real = tmp_path / "gemma3-270m.gguf"  # stands for the packaged model (model_paths checks it exists)
    real.write_bytes(b"GGUF")
    monkeypatch.setattr(contexts, "default_model_path", lambda: real)
    args = parity._parser().parse_args(["--real", "--types", "draft-simple"])
    (sc,) = parity.scenarios(args)
    assert sc.target == str(real) and sc.draft is None  # no draft file: the harness drafts with the target
