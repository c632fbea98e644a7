"""Command line: ``python -m autocast demo`` (the main job), ``python -m autocast policy``
(the default policy as Markdown) and ``python -m autocast diagnose`` (the numerics debugger
on the demo's model)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from autocast import __version__
from autocast._src.policy.table import describe_default_policy

_POLICY_DOC_HEAD = """\
# The default policy

What `autocast.amp` does with each primitive unless given another `amp_policy`: the table
docs/default_policy.md holds and explains (a test checks that page against this one).

"""


def _policy(_: argparse.Namespace) -> None:
    sys.stdout.write(_POLICY_DOC_HEAD + describe_default_policy() + "\n")


def _demo_module(needs: tuple[str, ...]) -> Any:
    """The demo, or a clear exit naming what to install: it trains with optax, shows progress
    with tqdm and plots with matplotlib, none of which ``pip install jax-autocast`` brings."""
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(
            f"this command needs {', '.join(missing)}, which the demo extra brings: "
            "pip install 'jax-autocast[demo]'"
        )
    from autocast._src.demo import run

    return run


def _refuse(command: str, message: str) -> None:
    """One line on stderr and exit status 1, before anything is computed or written."""
    sys.exit(f"python -m autocast {command}: {message}")


def _unusable_folder(out: str) -> str | None:
    """Why ``out`` cannot become the demo's folder, or None: the nearest existing part of
    the path must be a folder this process may write in (checked, not created, so that a
    refusal writes nothing)."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--out {out!r} is a file; give a folder (new or existing) for the plot and figures"
    existing = path
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        return f"--out {out!r} cannot be made: {existing!r} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--out {out!r} cannot be made: {existing!r} is not writable"
    return None


def _demo(args: argparse.Namespace) -> None:
    if args.steps < 1:
        _refuse("demo", f"--steps must be a whole number of training steps >= 1, got {args.steps}")
    unusable = _unusable_folder(args.out)
    if unusable:
        _refuse("demo", unusable)
    try:  # where permissions do not tell (a read-only file system, /proc), making it does
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        _refuse("demo", f"--out {args.out!r} cannot be made: {e.strerror or e}")
    _demo_module(("optax", "matplotlib", "tqdm")).run(steps=args.steps, out=args.out)
    print(f"plot and figures written to {args.out}/")


def _diagnose(args: argparse.Namespace) -> None:
    if args.rows < 1:
        _refuse("diagnose", f"--rows must be a number of table rows >= 1, got {args.rows}")
    demo = _demo_module(("optax",))
    print(demo.diagnose_demo(args.dtype, harmful=not args.default_policy, rows=args.rows))


def main(argv: list[str] | None = None) -> None:
    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m autocast", description="jax-autocast tools", formatter_class=defaults
    )
    parser.add_argument("--version", action="version", version=f"jax-autocast {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("policy", help="print the default policy table as Markdown").set_defaults(
        run=_policy
    )
    demo = commands.add_parser(
        "demo", help="train a small GPT five ways and compare them", formatter_class=defaults
    )
    demo.add_argument("--steps", type=int, default=600, help="training steps per run")
    demo.add_argument("--out", default="autocast-demo", help="folder for the plot and figures")
    demo.set_defaults(run=_demo)
    diagnose = commands.add_parser(
        "diagnose",
        help="find where mixed precision hurts the demo's gradient (float16, a harmful policy)",
        formatter_class=defaults,
    )
    diagnose.add_argument(
        "--dtype", default="float16", choices=("float16", "bfloat16"), help="amp's compute dtype"
    )
    diagnose.add_argument(
        "--default-policy", action="store_true", help="diagnose the default policy instead"
    )
    diagnose.add_argument("--rows", type=int, default=12, help="table rows to print")
    diagnose.set_defaults(run=_diagnose)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
