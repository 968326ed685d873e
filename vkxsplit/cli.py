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
from typing import Any

from .errors import VkxError

# Modules that add subcommands (each has register(subparsers)); missing ones are skipped so
# that a partial installation still offers what it has.
COMMAND_MODULES = (
    "vkxsplit.info",
    "vkxsplit.runner",
    "vkxsplit.bench",
    "vkxsplit.server",
    "vkxsplit.synth",
)


class Parser(argparse.ArgumentParser):
    """argparse without prefix abbreviations: ``-ngl 99`` is one option (never ``-n gl``),
    ``--temp`` never stands for ``--temperature``. Every subcommand's parser is one."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # allow_abbrev covers long options only: argparse still reads an unknown single-dash
        # "-n" as the one option it begins ("-ngl"), and "-hf" as "-h f" (a known one-letter
        # option and an attached value). Both are refused here (the second when the rest is a
        # word and not the letter repeated, as in -vv); "-n5" (a number attached) stays.
        argv = list(sys.argv[1:] if args is None else args)
        known = self._option_string_actions
        for a in argv:
            if a == "--":
                break
            if not a.startswith("-"):
                if self._subparsers is not None:
                    break  # the subcommand's own parser checks the rest
                continue
            if a[1:2] in ("-", "") or a in known or "=" in a or self._negative_number_matcher.match(a):
                continue
            longer = sorted(k for k in known if k.startswith(a) and not k.startswith("--"))
            if longer:  # argparse would take "-n" for the only option it begins, e.g. "-ngl"
                self.error(f"unrecognized option {a} (options are never abbreviated: {', '.join(longer)} "
                           "must be written whole)")
            if len(a) > 2:
                head, tail = a[:2], a[2:]
                if head in known and tail[0].isalpha() and set(a[1:]) != {a[1]}:
                    self.error(f"unrecognized option {a} (options are never abbreviated or combined; "
                               f"for {head} with the value {tail!r}, write {head} {tail})")
        return super().parse_known_args(args, namespace)


def _build_shaders(args: argparse.Namespace) -> int:
    from . import progress, shaders

    progress.enable()
    if args.check:
        problems = shaders.check_manifest()
        for p in problems:
            print(p)
        print("shaders: in sync with their SPIR-V" if not problems else
              f"shaders: {len(problems)} problem(s); run `vkxsplit build-shaders`")
        return 1 if problems else 0
    shaders.build(only=args.only, force=args.force, jobs=args.jobs)
    return 0


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is below 1")
    return v


def make_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="vkxsplit", description="Split LLM inference across the "
                                 "accelerators of one machine, with Vulkan as the hub.")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    p = sub.add_parser("build-shaders", help="compile shaders/ into the shipped SPIR-V and manifest")
    p.add_argument("--check", action="store_true", help="only report sources whose SPIR-V is stale")
    p.add_argument("--force", action="store_true", help="rebuild every variant")
    p.add_argument("--only", metavar="REGEX", help="rebuild only variants whose name matches")
    p.add_argument("-j", "--jobs", type=_positive, default=None, help="parallel compiler processes")
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
