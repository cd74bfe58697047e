"""The judge's helper (scripts/llama_server_tests.sh): local models for llama.cpp's server tests, the
server wrapper both servers run behind, and the side-by-side report.

llama.cpp's server tests (vendor/llama.cpp/tools/server/tests) start LLAMA_SERVER_BIN_PATH with
llama-server's command line and name their models on the hub (``--hf-repo`` / ``--hf-file``). Nothing
can be downloaded here, so ``prepare`` makes local stand-ins once (the tiny models of
pyspec.testing.models, copies with extra metadata, the bundled Gemma 3 270M) and writes a wrapper
executable; ``wrap`` (what that executable runs) replaces the hub options by ``-m PATH`` and execs
llama-server or ``pyspec serve`` with the rest of the words unchanged, so both servers get the same
models and the same flags. ``report`` reads the per-test records the pytest shim
(llama_server_tests_shim.py) wrote and prints both results side by side.

Only the standard library is imported at the top: ``wrap`` runs once per server start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# hub (repo without its ":quant" tag, file or "") -> local stand-in; an unlisted one makes the wrapper
# exit with an error, so the test fails the same way for both servers
HUB: dict[tuple[str, str], str] = {
    ("ggml-org/models", "tinyllamas/stories260K.gguf"): "story",
    ("ggml-org/test-model-stories260K", ""): "story",
    ("ggml-org/test-model-stories260K-infill", ""): "infill",
    ("ggml-org/models", "bert-bge-small/ggml-model-f16.gguf"): "embedding",
    ("ggml-org/stories15M_MOE", "stories15M_MOE-F16.gguf"): "story",
    ("ggml-org/models", "tinyllamas/split/stories15M-q8_0-00001-of-00003.gguf"): "split",
    ("ggml-org/tinygemma3-GGUF", ""): "gemma",
}
# download_file(url) of the tests, by the url's file name
DOWNLOADS: dict[str, str] = {
    "stories15M-q4_0.gguf": "draft",  # test_speculative's draft for stories15M_MOE
    "moe_shakespeare15M.gguf": "lora",  # test_lora's adapter for stories15M_MOE
}
POOLING_MEAN = 1  # llama_pooling_type


def _with_metadata(src: Path, dst: Path, extra: dict[str, int]) -> Path:
    """A copy of the GGUF ``src`` with uint32 keys added (written once)."""
    if dst.exists():
        return dst
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    meta = {k: MetadataDetails(gguf.GGUFValueType.UINT32, v) for k, v in extra.items()}
    copy_with_new_metadata(reader, writer, meta, [])
    tmp.rename(dst)
    return dst


def prepare(work: Path) -> dict[str, str]:
    """Makes the stand-ins (cached beside the tiny models) and the wrapper; returns name -> path."""
    from pyspec.testing import derived
    from pyspec.testing import models as tm

    cache = tm.cache_dir() / f"llama-server-tests-{tm.GENERATOR_VERSION}"
    cache.mkdir(parents=True, exist_ok=True)
    story = tm.make_cyclic_target()  # greedy text never reaches EOS: n_predict-long answers
    fim = {f"tokenizer.ggml.fim_{k}_token_id": v for k, v in derived.FIM_TOKENS.items()}
    paths = {
        "story": story,
        "infill": _with_metadata(story, cache / "infill.gguf", fim),
        "embedding": _with_metadata(tm.make_target(), cache / "embedding.gguf", {"llama.pooling_type": POOLING_MEAN}),
        "draft": tm.make_cyclic_draft(),
    }
    lora = cache / "lora.gguf"
    if not lora.exists():
        derived.make_lora(lora, targets=("output.weight", "blk.0.attn_q.weight"))
    paths["lora"] = lora
    split = sorted((cache / "split").glob("pyspec-split-*-of-*.gguf"))
    if not split:
        (cache / "split").mkdir(exist_ok=True)
        split = derived.make_split_target(cache / "split")
    paths["split"] = split[0]
    try:
        import pyspec

        paths["gemma"] = Path(pyspec.bundled_model())
    except Exception as e:  # the model package is optional: tests that need it fail for both
        print(f"no bundled model ({e}): the tinygemma3 preset stays unmapped", file=sys.stderr)
    out = {k: str(v) for k, v in paths.items()}
    work.mkdir(parents=True, exist_ok=True)
    (work / "models.json").write_text(json.dumps(out, indent=1), encoding="utf-8")
    wrapper = work / "server-wrapper"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" wrap "$@"\n',
                       encoding="utf-8")
    wrapper.chmod(0o755)
    return out


def translate(argv: list[str], models: dict[str, str]) -> list[str]:
    """llama-server's words with ``--hf-repo R --hf-file F`` replaced by ``-m PATH``; KeyError if unmapped."""
    out: list[str] = []
    repo = file = None
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in ("-hf", "-hfr", "--hf-repo") and i + 1 < len(argv):
            repo = argv[i + 1]
            i += 2
        elif word in ("-hff", "--hf-file") and i + 1 < len(argv):
            file = argv[i + 1]
            i += 2
        else:
            out.append(word)
            i += 1
    if repo is not None:
        key = (repo.split(":")[0], file or "")
        if key not in HUB or HUB[key] not in models:
            raise KeyError(f"no local stand-in for hub model {key}")
        out = ["-m", models[HUB[key]], *out]
    return out


def wrap(argv: list[str]) -> None:
    """Execs the server named by $JUDGE_SERVER (llama or pyspec) on the translated command line."""
    models = json.loads(Path(os.environ["JUDGE_MODELS"]).read_text(encoding="utf-8"))
    try:
        args = translate(argv, models)
    except KeyError as e:
        print(f"judge wrapper: {e.args[0]}", file=sys.stderr)
        sys.exit(2)
    if os.environ.get("JUDGE_SERVER") == "llama":
        binary = os.environ["JUDGE_LLAMA_SERVER"]
        os.execv(binary, [binary, *args])
    # JUDGE_PYSPEC_ARGS: words added to pyspec serve's command line, to see what an option changes
    # (``--fixed-draft``: llama.cpp's draft lengths instead of the cost-aware ones); the report's runs use none
    extra = os.environ.get("JUDGE_PYSPEC_ARGS", "").split()
    os.execv(sys.executable, [sys.executable, "-m", "pyspec", "serve", *args, *extra])


# --------------------------------------------------------------------------- the report


def _load(path: Path) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(collected test ids, id -> its worst phase record) of one server's run of one file."""
    ids: list[str] = []
    res: dict[str, dict[str, str]] = {}
    if not path.exists():
        return ids, res
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec["kind"] == "collected":
            ids.extend(rec["ids"])
            continue
        old = res.get(rec["id"])
        if old is None or rank[rec["outcome"]] > rank[old["outcome"]]:
            res[rec["id"]] = rec
    return ids, res


def _short(outcome: str | None) -> str:
    return {"passed": "PASS", "failed": "FAIL", "error": "ERROR", "skipped": "skip", None: "not run"}[outcome]


def report(work: Path, files: list[str]) -> int:
    totals: dict[str, int] = {}
    regressions: list[tuple[str, str]] = []
    for f in files:
        ids_l, llama = _load(work / "results" / "llama" / f"{f}.jsonl")
        ids_p, pys = _load(work / "results" / "pyspec" / f"{f}.jsonl")
        ids = list(dict.fromkeys([*ids_l, *ids_p]))
        counts = dict.fromkeys(("both pass", "llama only", "pyspec only", "hub text", "both fail", "skipped",
                                "not run"), 0)
        print(f"\n== {f}  ({len(ids)} tests)")
        print(f"  {'test':70} {'llama-server':12} {'pyspec':12}")
        for tid in ids:
            lr, pr = llama.get(tid), pys.get(tid)
            lo, po = (lr or {}).get("outcome"), (pr or {}).get("outcome")
            note = ""
            if lo is None or po is None:
                cat = "not run"
            elif lo == "skipped" or po == "skipped":
                cat = "skipped"
            elif lo == po == "passed":
                cat = "both pass"
            elif lo == "passed":
                cat = "llama only"
                note = (pr or {}).get("reason", "")
                regressions.append((tid, note))
            elif po == "passed":
                cat = "pyspec only"
            elif "match_regex" in (lr or {}).get("source", ""):
                cat, note = "hub text", "asserts the hub model's text"
            else:
                cat = "both fail"
                note = (lr or {}).get("reason", "")
            counts[cat] += 1
            name = tid.split("::", 1)[-1]
            print(f"  {name[:70]:70} {_short(lo):12} {_short(po):12} {note[:100]}")
        counted = len(ids) - counts["hub text"] - counts["skipped"] - counts["not run"]
        print("  " + ", ".join(f"{k}: {v}" for k, v in counts.items()) +
              f"; counted {counted}: llama-server passes {counts['both pass'] + counts['llama only']}, "
              f"pyspec passes {counts['both pass'] + counts['pyspec only']}")
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
    print("\n== summary: " + ", ".join(f"{k}: {v}" for k, v in totals.items()))
    print(f"== llama-server passes, pyspec fails ({len(regressions)}):")
    for tid, why in regressions:
        print(f"  {tid}: {why}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["wrap"]:
        wrap(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("prepare")
    sp.add_argument("--work", type=Path, required=True)
    sr = sub.add_parser("report")
    sr.add_argument("--work", type=Path, required=True)
    sr.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        for name, path in prepare(args.work).items():
            print(f"{name:10} {path}")
        return 0
    return report(args.work, args.files)


if __name__ == "__main__":
    sys.exit(main())
