#!/usr/bin/env python3
"""Fetch the pinned llama.cpp (revision e3a74b299) into vendor/llama.cpp.

The tree is the one the llama-cpp-python 0.3.30 source distribution carries
as vendor/llama.cpp. It is downloaded by package name from PyPI with pip,
checked against a known sha256, and only that folder is extracted. A second
run finds the tree in place and does nothing.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python==0.3.30"
ARCHIVE = "llama_cpp_python-0.3.30.tar.gz"
SHA256 = "798c9b42652d2e0bff5fe81e7e762089f425a99e67f66ffe5ae156957876e0d1"
REVISION = "e3a74b299"
INNER = "llama_cpp_python-0.3.30/vendor/llama.cpp/"

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / "vendor" / "llama.cpp"
STAMP = DEST / ".pyspec-revision"


def fail(msg: str) -> None:
    print(f"fetch_llama: error: {msg}", file=sys.stderr)
    sys.exit(1)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(dest_dir: Path) -> Path:
    # --no-binary keeps pip on the source archive; --no-build-isolation stops
    # pip from building cmake from source just to read the sdist's metadata.
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--no-binary", "llama-cpp-python", "--no-build-isolation",
        "-d", str(dest_dir), PACKAGE,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    archive = dest_dir / ARCHIVE
    if res.returncode != 0 or not archive.exists():
        fail(f"could not download {PACKAGE} from PyPI:\n{res.stderr.strip() or res.stdout.strip()}")
    return archive


def extract(archive: Path, tmp: Path) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(INNER)]
        if not members:
            fail(f"{ARCHIVE} holds no {INNER}")
        for m in members:
            m.name = m.name[len(INNER):]
            if not m.name:
                continue
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                fail(f"unsafe path in archive: {m.name}")
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse links leaving the tree
                tar.extract(m, tmp, filter="data")
            else:
                tar.extract(m, tmp)


def main() -> None:
    if STAMP.exists() and STAMP.read_text().strip() == REVISION:
        print(f"fetch_llama: vendor/llama.cpp is at {REVISION} already")
        return
    with tempfile.TemporaryDirectory() as td:
        td_path = Path(td)
        archive = download(td_path)
        got = sha256_of(archive)
        if got != SHA256:
            fail(f"sha256 mismatch for {ARCHIVE}: expected {SHA256}, got {got}")
        staging = td_path / "llama.cpp"
        staging.mkdir()
        extract(archive, staging)
        (staging / STAMP.name).write_text(REVISION + "\n")
        if DEST.exists():
            shutil.rmtree(DEST)
        DEST.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(DEST))
    print(f"fetch_llama: llama.cpp {REVISION} extracted into {DEST.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
