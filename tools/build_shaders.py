#!/usr/bin/env python3
"""Build the shipped SPIR-V from shaders/ (same as `vkxsplit build-shaders`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vkxsplit.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["build-shaders", *sys.argv[1:]]))
