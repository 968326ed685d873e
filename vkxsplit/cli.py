"""The ``vkxsplit`` command line.

Each subcommand lives in the module that owns its concept and registers itself through a
``register(subparsers)`` function (listed in ``COMMAND_MODULES``); this file only wires them
and turns :class:`~vkxsplit.errors.VkxError` into a two-line message and an exit code:
environment problems never print a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from .errors import VkxError

# Modules that add subcommands (each has register(subparsers)); missing ones are skipped so
# that a partial installation still offers what it has.
COMMAND_MODULES = (
    "vkxsplit.info",
    "vkxsplit.runner",
    "vkxsplit.synth",
)


def _build_shaders(args: argparse.Namespace) -> int:
    from . import shaders

    if args.check:
        problems = shaders.check_manifest()
        for p in problems:
            print(p)
        print("shaders: in sync with their SPIR-V" if not problems else
              f"shaders: {len(problems)} problem(s); run `vkxsplit build-shaders`")
        return 1 if problems else 0
    shaders.build(only=args.only, force=args.force, jobs=args.jobs)
    return 0


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vkxsplit", description="Split LLM inference across the "
                                 "accelerators of one machine, with Vulkan as the hub.")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("build-shaders", help="compile shaders/ into the shipped SPIR-V and manifest")
    p.add_argument("--check", action="store_true", help="only report sources whose SPIR-V is stale")
    p.add_argument("--force", action="store_true", help="rebuild every variant")
    p.add_argument("--only", metavar="REGEX", help="rebuild only variants whose name matches")
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiler processes")
    p.set_defaults(func=_build_shaders)
    for mod_name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as exc:
            if exc.name == mod_name:
                continue
            raise
        if hasattr(mod, "register"):
            mod.register(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = make_parser()
    args = ap.parse_args(argv)
    level = logging.WARNING - 10 * args.verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except VkxError as exc:
        print(f"vkxsplit: error: {exc}", file=sys.stderr)
        if os.environ.get("VKXSPLIT_TRACEBACK"):
            raise
        return exc.exit_code
    except KeyboardInterrupt:
        print("vkxsplit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
