"""``python -m flash_attn_hub release``: build -> check -> publish -> verify in one command.

With no ``--endpoint`` it starts the embedded Hub itself (data kept across runs in
``~/.cache/flash-attn-hub/hub``, an ephemeral port, the repo's org reported as a
trusted kernel publisher), so on a machine with no GPU and no network it ends with
the kernel on branch ``v<version>``, loaded back in a fresh process through
``kernels.get_kernel`` and through transformers (a tiny GQA Llama with
``attn_implementation="<repo>@v<version>"``). It then prints how to serve that Hub
again and the lines that load what was published.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import REPO_ROOT
from .publish import PublishError, default_repo_id, publish


class ReleaseError(Exception):
    """A stage failed; the message names it."""


def _stage(index: int, name: str, detail: str, started: float) -> None:
    print(f"[{index}/4] {name:<8} {detail} ({time.monotonic() - started:.1f} s)", flush=True)


def _check(variant_dir: Path) -> str:
    """Run the build engineer's checks on ``variant_dir``; returns a one-line summary."""
    try:
        from .check import check_variant
    except ImportError as err:
        raise ReleaseError(f"check: flash_attn_hub.check.check_variant(variant_dir) is not available ({err})") from None
    problems = list(check_variant(variant_dir) or [])
    if problems:
        raise ReleaseError("check failed:\n  " + "\n  ".join(str(p) for p in problems))
    return f"{variant_dir.name}: import without a GPU, op names, relative imports, ABI ok"


def release(*, build_dir: Path, endpoint: str | None, token: str | None, repo_id: str, data_dir: Path | None,
            allow_dirty: bool, transformers: bool = True) -> dict:
    from .build import build_variant
    from .hub import default_data_dir, start_embedded_hub
    from .verify import verify

    started = time.monotonic()
    variant_dir = Path(build_variant(build_dir))
    _stage(1, "build", f"{variant_dir}", started)

    started = time.monotonic()
    _stage(2, "check", _check(variant_dir), started)

    server = None
    if endpoint is None:
        data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        server = start_embedded_hub(data_dir, token=token, trusted_orgs=[repo_id.split("/")[0]])
        endpoint, token = server.endpoint, server.token
        print(f"        embedded Hub over {data_dir} at {endpoint}", flush=True)
    try:
        started = time.monotonic()
        try:
            result = publish(build_dir, endpoint=endpoint, token=token, repo_id=repo_id, allow_dirty=allow_dirty,
                             log=lambda line: print(f"        {line}", flush=True))
        except PublishError as err:
            raise ReleaseError(f"publish failed: {err}") from None
        _stage(3, "publish", f"{result.repo_id}@{result.branch} = {result.commit}", started)

        started = time.monotonic()
        proc = verify(result.repo_id, result.version, endpoint, transformers=transformers)
        if proc.returncode != 0:
            raise ReleaseError(f"verify failed (exit {proc.returncode})")
        _stage(4, "verify", f"kernels{' + transformers' if transformers else ''} loaded v{result.version}",
               started)
    finally:
        if server is not None:
            server.stop()
    return {"result": result, "data_dir": data_dir if server is not None else None, "endpoint": endpoint}


def _print_usage(result, data_dir: Path | None, endpoint: str) -> None:
    repo, version, sha = result.repo_id, result.version, result.commit
    org = repo.split("/")[0]
    url = "http://127.0.0.1:8765" if data_dir is not None else endpoint
    print(f"\nPublished {repo} v{version} at {sha} ({', '.join(result.variants)}).")
    if data_dir is not None:
        print("Serve this Hub again:")
        print(f"  python -m flash_attn_hub hub serve --data {data_dir} --port 8765 --trust {org}")
    print("Load what was published (kernels):")
    print(f"  HF_ENDPOINT={url} python -c 'from kernels import get_kernel; "
          f"fa = get_kernel(\"{repo}\", version={version}); print(fa.flash_attn_func)'")
    print(f"  pinned build: get_kernel(\"{repo}\", revision=\"{sha}\")")
    print("Load it in transformers (same HF_ENDPOINT; the model itself must be local or on this Hub):")
    print(f"  model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=\"{repo}@v{version}\")")
    print(f"  pinned build: attn_implementation=\"{repo}@{sha}\"")


def run(args: argparse.Namespace) -> int:
    repo_id = args.repo_id or default_repo_id()
    try:
        out = release(build_dir=Path(args.build_dir), endpoint=args.endpoint, token=args.token, repo_id=repo_id,
                      data_dir=Path(args.data) if args.data else None, allow_dirty=args.allow_dirty,
                      transformers=not args.no_transformers)
    except ReleaseError as err:
        print(f"release: {err}", file=sys.stderr)
        return 1
    _print_usage(out["result"], out["data_dir"], out["endpoint"])
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("release", help="build, check, publish and verify in one command")
    parser.add_argument("--build-dir", default=str(REPO_ROOT / "build"), help="where variants are built")
    parser.add_argument("--endpoint", help="Hub URL (default: start the embedded Hub)")
    parser.add_argument("--data", help="embedded Hub data directory (default ~/.cache/flash-attn-hub/hub)")
    parser.add_argument("--repo-id", help="kernel repo (default: build.toml's)")
    parser.add_argument("--token", help="write token (default: the embedded Hub's, else $HF_TOKEN)")
    parser.add_argument("--allow-dirty", action="store_true", help="release a build from a dirty tree")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers load check")
    parser.set_defaults(func=run)
