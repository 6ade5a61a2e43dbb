"""`stalepipe checkpoint convert OLD NEW`: older checkpoints into today's format (rundir.convert)."""

from __future__ import annotations

import argparse

from stalepipe.cli.common import Subparsers


def _add_checkpoint(sub: Subparsers) -> None:
    p = sub.add_parser("checkpoint", help="convert an older version's checkpoint")
    checkpoint_sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    c = checkpoint_sub.add_parser(
        "convert",
        help="rewrite a checkpoint of format 1 or 2 (pickles) as format 3 (safetensors, JSON)",
        description="Read an older checkpoint once (a DCP directory with a pickled .metadata, "
        "or a ckpt_<step>.pt file), in a child process with a memory cap and a hardened "
        "unpickler, and write it as today's format to NEW, checked as any load checks it. "
        "OLD is not changed. Convert only checkpoints whose origin you know: the hardening "
        "refuses what a DCP checkpoint never holds, but a pickle is still a program.",
    )
    c.add_argument("old", metavar="OLD", help="the older checkpoint (directory or .pt file)")
    c.add_argument("new", metavar="NEW", help="where the converted checkpoint goes (new path)")
    c.set_defaults(fn=cmd_convert)


def cmd_convert(args: argparse.Namespace, extra: list[str]) -> int:
    from stalepipe.training.rundir.convert import convert

    print(f"converted {args.old} -> {convert(args.old, args.new)}")
    return 0
