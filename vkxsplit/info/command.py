"""The ``vkxsplit info`` subcommand: its arguments, and the report printed as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .render import render_text
from .report import collect


def _cmd_info(args: argparse.Namespace) -> int:
    report = collect(device=args.device, surface=args.surface)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render_text(report))
    sys.stdout.flush()
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "info", help="what this machine can split with what (Vulkan devices, interop, backends)",
        description="A vulkaninfo-style report of the Vulkan hub devices, their interop handles, "
        "the kernels each would run, the backends found and how each would attach. "
        "Paste it into bug reports. The --json schema is in docs/INFO.md.")
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema in docs/INFO.md)")
    p.add_argument("--device", type=int, metavar="N", help="show only physical device N (and use it as hub)")
    p.add_argument("--surface", action="store_true",
                   help="also create a window surface (GLFW) and report presentation support")
    p.set_defaults(func=_cmd_info)
