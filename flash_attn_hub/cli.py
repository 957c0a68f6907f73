"""``python -m flash_attn_hub <command>``: one sub-command per module.

Each module named in ``COMMANDS`` exposes ``register(subparsers)``, which adds
its parser and sets ``func`` (called with the parsed namespace, returning an
exit code). Modules are imported lazily so that ``--help`` stays fast and a
command's heavy imports (torch, huggingface_hub) load only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "build": "flash_attn_hub.build",
    "check": "flash_attn_hub.check",
    "hub": "flash_attn_hub.hub",
    "publish": "flash_attn_hub.publish",
    "verify": "flash_attn_hub.verify",
    "release": "flash_attn_hub.release",
    "bench": "flash_attn_hub.bench",
    "tune": "flash_attn_hub.tune",
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flash_attn_hub", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            continue  # command not written yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = make_parser().parse_args(argv)
    args.argv = argv  # the command as given, for the pages that record what measured them
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
