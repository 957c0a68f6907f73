"""``python -m flash_attn_hub tune fwd|bwd``: search the Triton kernels' tile configs on this
GPU and write the measured best into the tables the package ships
(``torch-ext/flash_attn/_triton/triton_{fwd,bwd}_configs.json``). ``common.py`` holds the
search, the timing and the tuning file; ``fwd.py`` / ``bwd.py`` the candidates and problems of
each kernel.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from . import bwd, common, fwd

    parser = subparsers.add_parser("tune", help="tune the Triton kernels' tiles on this GPU (writes the tables)",
                                   description=__doc__.split("\n\n")[0])
    kernels = parser.add_subparsers(dest="kernel", required=True, metavar="{fwd,bwd}")
    for name, module in (("fwd", fwd), ("bwd", bwd)):
        sub = kernels.add_parser(name, help=f"the Triton {'forward' if name == 'fwd' else 'backward'} kernel",
                                 description=module.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=module.__doc__.split("\n\n", 1)[1])
        common.add_arguments(sub, sorted(module.HEADS))
        sub.set_defaults(func=module.run)
