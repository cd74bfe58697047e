"""``pyspec bench --prompt-set``: the named prompt sets, and chat prompts rendered with the target's template."""

from __future__ import annotations

import json

import pytest

from pyspec import Model, cli
from pyspec.cli.bench_prompts import ALL, BUILTIN_PROMPTS, PROMPT_SETS, ChatPrompt, prompt_inputs, prompt_set
from pyspec.generation import chat as chat_mod
from pyspec.generation.chat import render_chat, tokenize_chat
from pyspec.testing import models as tm


def test_all_is_every_set_but_builtin_in_order_and_an_unknown_name_lists_the_sets():
    assert prompt_set("builtin") == list(BUILTIN_PROMPTS)
    assert prompt_set(ALL) == [p for name in ("code", "prose", "repetitive", "chat") for p in PROMPT_SETS[name]]
    assert all(PROMPT_SETS[name] for name in PROMPT_SETS)
    with pytest.raises(ValueError, match=r"unknown prompt set 'poetry' \(known: builtin, code, .*chat, all\)"):
        prompt_set("poetry")
    assert prompt_set("chat, prose") == [*PROMPT_SETS["chat"], *PROMPT_SETS["prose"]]  # in the order given


def test_a_chat_prompt_is_rendered_with_the_models_template_and_its_special_tokens_parsed():
    chat = ChatPrompt((("user", "Hi there"),))
    with Model(tm.make_chat_target(), vocab_only=True) as m:
        texts, inputs = prompt_inputs(m, ["plain text", chat])
        vocab = m.vocab
        assert texts[0] == inputs[0] == "plain text"  # a text prompt goes to the generator as it is
        assert texts[1] == render_chat(m, [{"role": "user", "content": "Hi there"}])
        assert "[INST] Hi there [/INST]" in texts[1]
        toks = inputs[1]
        assert toks == tokenize_chat(vocab, texts[1])
        # the template wrote "<s>": one BOS token, not its text, and none added before it
        assert toks[0] == vocab.bos and toks.count(vocab.bos) == 1
        assert vocab.tokenize(texts[1], add_special=False)[0] != vocab.bos


def test_bench_runs_a_prompt_set_and_the_chat_set_reaches_the_cpp_loop_as_the_same_tokens(tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.setattr(chat_mod, "_warned", set())  # the fallback warns once per model file and process
    js = tmp_path / "bench.json"
    argv = ["bench", "--tiny", "--types", "ngram-simple", "--engines", "fixed,loop", "--n-predict", "16",
            "--repeat", "1", "--n-prompts", "2", "--quiet", "--json", str(js)]
    with pytest.warns(UserWarning, match="no chat template"):  # the tiny target has none: its architecture's
        assert cli.main([*argv, "--prompt-set", "chat"]) == 0
    data = json.loads(js.read_text())
    assert len(data["prompts"]) == 2
    assert all(p.startswith("<|start_header_id|>user<|end_header_id|>") for p in data["prompts"])
    assert "Rewrite this sentence in the past tense" in data["prompts"][0]
    rows = {(r["type"], r["engine"]): r for r in data["rows"]}
    assert rows[("ngram-simple", "fixed")]["identical"] is True  # the port and the C++ loop read the same tokens
    assert rows[("ngram-simple", "fixed")]["n_drafted"] > 0

    assert cli.main([*argv, "--prompt-set", "repetitive"]) == 0
    assert json.loads(js.read_text())["prompts"] == list(PROMPT_SETS["repetitive"][:2])


def test_bench_takes_a_prompt_set_or_a_prompt_file_not_both(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("hello")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--tiny", "--prompt-set", "code", "--prompt-file", str(f)])
    assert "not allowed with argument" in capsys.readouterr().err
    assert cli.main(["bench", "--tiny", "--prompt-set", "code,poetry"]) == 1
    assert "--prompt-set: unknown prompt set 'poetry' (known: builtin" in capsys.readouterr().err


def test_run_bench_refuses_an_empty_prompt_list_before_it_runs_anything():
    from pyspec.cli import bench

    with pytest.raises(ValueError, match="no prompts to run"):
        bench.run_bench(None, [], prompts=[])  # type: ignore[arg-type]
