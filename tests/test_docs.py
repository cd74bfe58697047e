"""The README and docs/*.md: every relative link resolves, and every ```python block runs.

A block runs as written, in a subprocess from an empty temporary folder, so an example cannot rot.
An HTML comment on the line before a block changes how it is tested:

- ``<!-- test: slow -->``: it needs the real model (Gemma 3 270M); it runs in the slow tier only;
- ``<!-- test: skip REASON -->``: it needs what a test machine lacks (a GPU, a network peer, a
  running server, files of your own); it is compiled, not run, and must say why.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# a block that needs no GPU or peer should run; the skip marker stays the exception
MAX_SKIPPED = 6
# the slowest tiny-model block loads two models and generates; the real model takes longer
TIMEOUT_S = 600

FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!--\s*test:\s*(\w+)\s*(.*?)\s*-->$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mark: str  # "", "slow" or "skip"
    reason: str

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the test marker on the line before it."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mk = MARK.match(prev)
        out.append(Block(doc, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                         mk.group(1) if mk else "", mk.group(2) if mk else ""))
        i = j + 1
    return out


def prose(doc: Path) -> str:
    """The text outside fenced blocks: links inside code are code, not links."""
    keep: list[str] = []
    inside = False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            keep.append(line)
    return "\n".join(keep)


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces to dashes."""
    out: set[str] = set()
    for line in prose(doc).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            out.add(slug)
    return out


PY_BLOCKS = [b for d in DOCS for b in blocks(d) if b.lang == "python"]


def test_docs_exist() -> None:
    # the README's "Where next" points into these; an empty docs/ would pass every other test here
    assert len(DOCS) >= 10, [d.name for d in DOCS]
    assert PY_BLOCKS, "no python block found"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    dead = []
    for target in LINK.findall(prose(doc)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            dead.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not dead, f"{doc.name}: " + "; ".join(dead)


def test_markers_are_known_and_skips_give_a_reason() -> None:
    bad = [b.name for b in PY_BLOCKS if b.mark not in ("", "slow", "skip")]
    assert not bad, f"unknown test marker before {bad}"
    no_reason = [b.name for b in PY_BLOCKS if b.mark == "skip" and len(b.reason.split()) < 2]
    assert not no_reason, f"a skipped block must say why: {no_reason}"
    skipped = [b.name for b in PY_BLOCKS if b.mark == "skip"]
    assert len(skipped) <= MAX_SKIPPED, f"too many blocks that never run: {skipped}"


@pytest.mark.parametrize("block", PY_BLOCKS, ids=lambda b: b.name)
def test_python_block_compiles(block: Block) -> None:
    # the blocks that do not run here are at least valid Python
    compile(block.code, block.name, "exec")


def _run(block: Block, cwd: Path) -> None:
    r = subprocess.run([sys.executable, "-c", block.code], cwd=cwd, capture_output=True, text=True,
                       timeout=TIMEOUT_S, check=False)
    assert r.returncode == 0, f"{block.name} failed:\n{block.code}\n--- stderr ---\n{r.stderr[-4000:]}"


@pytest.mark.slow  # each block in a subprocess of its own
@pytest.mark.parametrize("block", [b for b in PY_BLOCKS if b.mark == ""], ids=lambda b: b.name)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    _run(block, tmp_path)


# the subcommands the docs' shell blocks use: each must exist (its --help exits 0); bash blocks are not run
SUBCOMMANDS = sorted({m for d in DOCS for b in blocks(d) if b.lang == "bash"
                      for m in re.findall(r"python3? -m pyspec(?: -v)? ([a-z][a-z-]*)", b.code)})


@pytest.mark.slow  # a subprocess per subcommand
def test_shell_blocks_name_real_subcommands() -> None:
    assert "serve" in SUBCOMMANDS, SUBCOMMANDS
    for sub in SUBCOMMANDS:
        r = subprocess.run([sys.executable, "-m", "pyspec", sub, "--help"], capture_output=True, text=True,
                           timeout=120, check=False)
        assert r.returncode == 0, f"python -m pyspec {sub} --help: {r.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in PY_BLOCKS if b.mark == "slow"], ids=lambda b: b.name)
def test_python_block_runs_real_model(block: Block, tmp_path: Path) -> None:
    _run(block, tmp_path)
