"""The embedded Hub: a Hub-compatible server on 127.0.0.1 for publishing and loading
the kernel without network access.

``python -m flash_attn_hub hub serve [--data DIR] [--port P] [--token T] [--trust ORG]``

Repos live as bare git repositories under ``DIR`` (default
``~/.cache/flash-attn-hub/hub``) and survive restarts. Reads are open; writes need
the token (``--token``, else the one saved in ``DIR/token``, created on first use).
The organisations given with ``--trust`` (default: the project's own org) are
reported as ``trustedKernelPublisher``, so ``kernels.get_kernel`` and transformers
load them without ``trust_remote_code`` / ``allow_all_kernels``.

Every repository is public: reads are open to whoever reaches the port, and a request
to create a private one is refused (400) rather than accepted and served openly.
The server is uvicorn + Starlette (see :mod:`.server` for why); ``hub serve`` runs it
in the foreground, ``release`` and the tests in a background thread.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from .. import DEFAULT_REPO_ID
from .server import HubServer, Limits
from .store import GitStore, HubError

__all__ = ["HubServer", "GitStore", "HubError", "Limits", "default_data_dir", "load_or_create_token",
           "make_hub", "start_embedded_hub", "register"]

DEFAULT_TRUSTED_ORG = DEFAULT_REPO_ID.split("/")[0]


def default_data_dir() -> Path:
    """``$XDG_CACHE_HOME/flash-attn-hub/hub`` (``~/.cache/...`` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "flash-attn-hub" / "hub"


def load_or_create_token(data_dir: Path) -> str:
    """The write token saved in ``data_dir/token``, generated (mode 0600) on first use."""
    path = Path(data_dir) / "token"
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = "hf_local_" + secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token


def make_hub(data_dir: Path | None = None, *, port: int = 0, token: str | None = None,
             trusted_orgs: list[str] | None = None, host: str = "127.0.0.1", limits: Limits = Limits()) -> HubServer:
    """The Hub over ``data_dir``, bound to ``host:port`` (``port=0``: an ephemeral port), not yet
    serving; ``server.endpoint`` is its URL, ``server.token`` the write token."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    token = token or load_or_create_token(data_dir)
    trusted = frozenset(trusted_orgs if trusted_orgs is not None else [DEFAULT_TRUSTED_ORG])
    store = GitStore(data_dir)
    try:
        return HubServer((host, port), store, token=token, trusted_orgs=trusted, limits=limits)
    except BaseException:
        store.close()
        raise


def start_embedded_hub(data_dir: Path | None = None, **kwargs) -> HubServer:
    """:func:`make_hub` serving in a background thread; ``server.stop()`` ends it."""
    return make_hub(data_dir, **kwargs).start()


def _serve(args: argparse.Namespace) -> int:
    data_dir = Path(args.data) if args.data else default_data_dir()
    server = make_hub(data_dir, port=args.port, token=args.token, trusted_orgs=args.trust or None)
    print(f"Hub serving {data_dir} at {server.endpoint} (trusted publishers: "
          f"{', '.join(sorted(server.trusted_orgs)) or 'none'})", flush=True)
    print(f"  export HF_ENDPOINT={server.endpoint}", flush=True)
    if not args.token:
        print(f"  write token: {data_dir / 'token'}", flush=True)
    try:
        server.serve_forever()  # until SIGINT/SIGTERM, once the requests in flight have finished
    except KeyboardInterrupt:  # uvicorn re-raises the signal it handled once it has shut down
        pass
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("hub", help="the embedded Hub-compatible server")
    sub = parser.add_subparsers(dest="hub_command", required=True, metavar="HUB_COMMAND")
    serve = sub.add_parser("serve", help="serve the git-backed Hub on 127.0.0.1")
    serve.add_argument("--data", help=f"data directory (default {default_data_dir()})")
    serve.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 = ephemeral)")
    serve.add_argument("--token", help="write token (default: DATA/token, generated on first use)")
    serve.add_argument("--trust", action="append", metavar="ORG",
                       help=f"organisation reported as a trusted kernel publisher (repeatable; "
                            f"default {DEFAULT_TRUSTED_ORG})")
    serve.set_defaults(func=_serve)
