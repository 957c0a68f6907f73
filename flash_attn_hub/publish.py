"""``python -m flash_attn_hub publish``: upload built variants to a Hub, as kernel-builder does.

Through ``huggingface_hub.HfApi``: create the ``kernel`` repo, create branch
``v<version>`` if missing, then ONE commit on that branch (its parent pinned to the
tip the checks below read, so nothing can slip in between); finally the kernel card
(``CARD.md``) as ``README.md`` on ``main``.

The branch carries only what a kernel repository serves (STYLE.md 14), the files
kernel-builder's ``upload`` sends plus the build's own description:

* ``build/<variant>/**`` of every built variant, the stale files of exactly those
  variants deleted (other variants on the branch, built elsewhere, stay);
* the top-level ``benchmarks/benchmark*.py`` (what ``kernels benchmark`` runs); any other
  file under ``benchmarks/`` on the branch is deleted (kernel-builder deletes only stale
  ``benchmark*`` files there, but earlier uploads of this tool sent the whole folder: run
  logs, notes, result folders and plots must not linger);
* ``build.toml``, ``flake.nix``, ``flake.lock`` and ``LICENSE`` where the source has them.

:func:`published_path_allowed` is that rule as a predicate over a repository path.

The version-bump rule, checked against what the branch serves before anything is
written: a branch ``vN`` only ever serves version ``N`` (every variant's
``metadata.json``), never loses a public name (``__all__`` of any variant it already
serves must stay in every uploaded variant's ``__all__``), and never drops a variant.
Breaking any of these needs ``N + 1``. A build whose metadata provenance is dirty is
refused unless ``allow_dirty``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Callable

from . import DEFAULT_REPO_ID, REPO_ROOT

REPO_TYPE = "kernel"
CARD_PATH = REPO_ROOT / "CARD.md"
BENCHMARKS_DIR = REPO_ROOT / "benchmarks"
# The build's description, published beside the variants when the source has them.
KERNEL_FILE_NAMES = ("build.toml", "flake.nix", "flake.lock", "LICENSE")
KERNEL_FILES = tuple(REPO_ROOT / name for name in KERNEL_FILE_NAMES)
_SKIPPED_PARTS = ("__pycache__",)


class PublishError(Exception):
    """A publish refused before anything was written (or a Hub error), with the reason."""


@dataclasses.dataclass(frozen=True)
class VariantState:
    """What one variant holds: version and public names from its files, and its file list."""

    version: int | None
    names: frozenset[str] | None
    files: frozenset[str]
    dirty: bool = False


@dataclasses.dataclass(frozen=True)
class PublishResult:
    repo_id: str
    version: int
    branch: str
    commit: str
    variants: tuple[str, ...]
    endpoint: str


def default_repo_id() -> str:
    """``[general.hub] repo-id`` of ``build.toml``, else ``DEFAULT_REPO_ID``."""
    path = REPO_ROOT / "build.toml"
    if path.is_file():
        with open(path, "rb") as handle:
            repo_id = tomllib.load(handle).get("general", {}).get("hub", {}).get("repo-id")
        if repo_id:
            return repo_id
    return DEFAULT_REPO_ID


def public_names(init_source: str) -> frozenset[str] | None:
    """The literal ``__all__`` of a module's source (``=``, ``+=`` and ``.extend`` of
    literals), or None when it has none."""
    names: list[str] | None = None
    for node in ast.parse(init_source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            names = list(ast.literal_eval(node.value))
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == "__all__":
            names = (names or []) + list(ast.literal_eval(node.value))
        elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "extend"
              and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "__all__"):
            names = (names or []) + list(ast.literal_eval(node.value.args[0]))
    return None if names is None else frozenset(names)


def benchmark_scripts(benchmarks_dir: Path) -> dict[str, Path]:
    """The files ``kernels benchmark`` runs: ``benchmarks_dir/benchmark*.py``, top level only."""
    return {p.name: p for p in sorted(Path(benchmarks_dir).glob("benchmark*.py")) if p.is_file()}


def published_path_allowed(path: str) -> bool:
    """Whether a file at ``path`` (relative to the repository root) belongs on a published
    branch: a variant's file, a top-level ``benchmarks/benchmark*.py``, a file of
    ``KERNEL_FILE_NAMES``, or what the Hub itself puts on every branch (``README.md`` and
    ``.gitattributes``, inherited from ``main`` when the branch is created)."""
    parts = path.split("/")
    if parts[0] == "build":
        return len(parts) >= 3 and "__pycache__" not in parts and not path.endswith(".pyc")
    if parts[0] == "benchmarks":
        return len(parts) == 2 and parts[1].startswith("benchmark") and parts[1].endswith(".py")
    return len(parts) == 1 and parts[0] in (*KERNEL_FILE_NAMES, "README.md", ".gitattributes")


def _files_under(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
            if p.is_file() and not any(part in _SKIPPED_PARTS for part in p.parts) and p.suffix != ".pyc"}


def _state_from_texts(metadata_text: str | None, init_text: str | None, files: frozenset[str]) -> VariantState:
    metadata = json.loads(metadata_text) if metadata_text is not None else {}
    dirty = bool(((metadata.get("provenance") or {}).get("kernel") or {}).get("dirty"))
    return VariantState(version=metadata.get("version"),
                        names=public_names(init_text) if init_text is not None else None,
                        files=files, dirty=dirty)


def local_variants(build_dir: Path) -> dict[str, tuple[Path, VariantState]]:
    """Every ``build_dir/<variant>/`` (a name kernels parses) with its state; a variant
    folder kernels could not load (no valid ``metadata.json``) is an error, not skipped."""
    from kernels._rust import Metadata
    from kernels.variants import parse_variant

    build_dir = Path(build_dir)
    if not build_dir.is_dir():
        raise PublishError(f"build_dir: {build_dir} is not a directory (run `python -m flash_attn_hub build`)")
    found = {}
    # Hidden folders (the compile cache build/.cache) are the build's own, not variants.
    for path in sorted(p for p in build_dir.iterdir()
                       if p.is_dir() and p.name not in _SKIPPED_PARTS and not p.name.startswith(".")):
        try:
            parse_variant(path.name)
        except ValueError:
            raise PublishError(f"build_dir: {path.name!r} is not a build variant name "
                               "(e.g. torch-cpu, torch-stable-abi211-cu130-x86_64-linux)") from None
        metadata_path = path / "metadata.json"
        if not metadata_path.is_file():
            raise PublishError(f"variant {path.name}: no metadata.json (uploading it would drop the variant)")
        try:
            Metadata.read_from_file(metadata_path)
        except (OSError, ValueError) as err:
            raise PublishError(f"variant {path.name}: kernels cannot read metadata.json: {err}") from None
        init = path / "__init__.py"
        state = _state_from_texts(metadata_path.read_text(), init.read_text() if init.is_file() else None,
                                  frozenset(_files_under(path)))
        found[path.name] = (path, state)
    if not found:
        raise PublishError(f"build_dir: no build variants in {build_dir} (run `python -m flash_attn_hub build`)")
    return found


def check_version_rule(version: int, remote: dict[str, VariantState], local: dict[str, VariantState]) -> list[str]:
    """Problems that forbid uploading ``local`` to branch ``v<version>`` serving ``remote``."""
    problems = []
    for name, state in sorted(local.items()):
        if state.version != version:
            problems.append(f"variant {name}: metadata.json version {state.version} != {version}")
    for name, state in sorted(remote.items()):
        if state.version != version:
            problems.append(f"branch v{version} serves {name} with metadata.json version {state.version}: "
                            f"refusing to mix versions on one branch")
    served_names = frozenset().union(*(s.names for s in remote.values() if s.names is not None))
    for name, state in sorted(local.items()):
        missing = served_names - (state.names or frozenset())
        if missing:
            problems.append(f"variant {name}: removes public name(s) {', '.join(sorted(missing))} that "
                            f"v{version} serves; removing a public name needs version {version + 1}")
    after = {**remote, **local}
    for name in sorted(remote):
        if "metadata.json" not in after[name].files:
            problems.append(f"variant {name}: the upload would drop a variant v{version} serves")
    return problems


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _remote_state(api, repo_id: str, commit: str) -> tuple[dict[str, VariantState], dict[str, set[str]]]:
    """Variants served at ``commit`` and the files of every top-level folder we manage."""
    from huggingface_hub import RepoFile
    from huggingface_hub.errors import EntryNotFoundError

    try:
        entries = [e for e in api.list_repo_tree(repo_id, repo_type=REPO_TYPE, revision=commit, recursive=True)
                   if isinstance(e, RepoFile)]
    except EntryNotFoundError:
        entries = []
    files_by_variant: dict[str, set[str]] = {}
    other: dict[str, set[str]] = {}
    for entry in entries:
        parts = entry.path.split("/")
        if parts[0] == "build" and len(parts) >= 3:
            files_by_variant.setdefault(parts[1], set()).add("/".join(parts[2:]))
        other.setdefault(parts[0], set()).add(entry.path)
    states = {}
    with tempfile.TemporaryDirectory(prefix="publish-") as cache:
        for variant, files in files_by_variant.items():
            texts = {}
            for name in ("metadata.json", "__init__.py"):
                if name in files:
                    local = api.hf_hub_download(repo_id, f"build/{variant}/{name}", repo_type=REPO_TYPE,
                                                revision=commit, cache_dir=cache)
                    texts[name] = Path(local).read_text()
            states[variant] = _state_from_texts(texts.get("metadata.json"), texts.get("__init__.py"),
                                                frozenset(files))
    return states, other


def publish(build_dir: Path, *, endpoint: str, token: str | None, repo_id: str | None = None,
            allow_dirty: bool = False, card: Path | None = CARD_PATH, benchmarks_dir: Path | None = BENCHMARKS_DIR,
            kernel_files: tuple[Path, ...] = KERNEL_FILES, log: Callable[[str], None] = print) -> PublishResult:
    """Publish every variant under ``build_dir`` to ``repo_id`` on branch ``v<version>``, with
    the benchmark scripts of ``benchmarks_dir`` and those of ``kernel_files`` that exist
    (None / ``()``: none), and ``card`` as ``README.md`` on ``main``."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    repo_id = repo_id or default_repo_id()
    local = local_variants(build_dir)
    versions = {state.version for _, state in local.values()}
    if len(versions) != 1 or not isinstance(next(iter(versions)), int):
        raise PublishError(f"build_dir: variants disagree on or lack an integer version: "
                           f"{ {name: state.version for name, (_, state) in local.items()} }")
    version = versions.pop()
    dirty = sorted(name for name, (_, state) in local.items() if state.dirty)
    if dirty and not allow_dirty:
        raise PublishError(f"variant(s) {', '.join(dirty)} were built from a dirty tree (metadata.json "
                           "provenance); commit first, or pass --allow-dirty")
    branch = f"v{version}"
    api = HfApi(endpoint=endpoint, token=token, library_name="flash-attn-hub")
    try:
        api.create_repo(repo_id, repo_type=REPO_TYPE, exist_ok=True)
        api.create_branch(repo_id, branch=branch, repo_type=REPO_TYPE, exist_ok=True)
        tip = next(b.target_commit for b in api.list_repo_refs(repo_id, repo_type=REPO_TYPE).branches
                   if b.name == branch)
        remote, remote_files = _remote_state(api, repo_id, tip)
        problems = check_version_rule(version, remote, {name: state for name, (_, state) in local.items()})
        if problems:
            raise PublishError(f"refusing to publish to {repo_id}@{branch}:\n  " + "\n  ".join(problems))
        operations: list = []
        for name, (path, _) in local.items():
            served = remote[name].files if name in remote else frozenset()
            operations += _replace_folder(f"build/{name}", _files_under(path), {f"build/{name}/{f}" for f in served})
        if benchmarks_dir is not None:
            operations += _replace_folder("benchmarks", benchmark_scripts(benchmarks_dir),
                                          remote_files.get("benchmarks", set()))
        for path in kernel_files:
            if Path(path).is_file():
                operations.append(CommitOperationAdd(path_in_repo=Path(path).name, path_or_fileobj=str(path)))
        log(f"publish: {repo_id}@{branch} <- {', '.join(local)} "
            f"({sum(isinstance(op, CommitOperationAdd) for op in operations)} files, "
            f"{sum(isinstance(op, CommitOperationDelete) for op in operations)} stale removed)")
        info = api.create_commit(repo_id, operations, repo_type=REPO_TYPE, revision=branch, parent_commit=tip,
                                 commit_message=f"Upload flash-attn v{version}: {', '.join(local)}")
        if card is not None and Path(card).is_file():
            _publish_card(api, repo_id, Path(card), log)
        elif card is not None:
            log(f"publish: no kernel card at {card}: README.md on main left as it is")
    except HfHubHTTPError as err:
        raise PublishError(f"the Hub at {endpoint} refused: {err}") from err
    return PublishResult(repo_id=repo_id, version=version, branch=branch, commit=info.oid,
                         variants=tuple(local), endpoint=endpoint)


def _replace_folder(prefix: str, files: dict[str, Path], remote: set[str]) -> list:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    ops = [CommitOperationAdd(path_in_repo=f"{prefix}/{rel}", path_or_fileobj=str(path))
           for rel, path in files.items()]
    wanted = {f"{prefix}/{rel}" for rel in files}
    ops += [CommitOperationDelete(path_in_repo=path) for path in sorted(remote - wanted)]
    return ops


def _publish_card(api, repo_id: str, card: Path, log: Callable[[str], None]) -> None:
    from huggingface_hub import CommitOperationAdd

    data = card.read_bytes()
    current = api.get_paths_info(repo_id, ["README.md"], repo_type=REPO_TYPE, revision="main")
    if current and getattr(current[0], "blob_id", None) == git_blob_oid(data):
        return
    api.create_commit(repo_id, [CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=data)],
                      repo_type=REPO_TYPE, revision="main", commit_message="Update the kernel card")
    log(f"publish: {repo_id}@main <- README.md (from {card.name})")


def run(args: argparse.Namespace) -> int:
    from .hub import start_embedded_hub

    server = None
    endpoint, token = args.endpoint, args.token
    if endpoint is None:
        server = start_embedded_hub()
        endpoint, token = server.endpoint, token or server.token
    try:
        result = publish(Path(args.build_dir), endpoint=endpoint, token=token, repo_id=args.repo_id,
                         allow_dirty=args.allow_dirty)
    except PublishError as err:
        print(f"publish: {err}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    print(f"publish: {result.repo_id}@{result.branch} = {result.commit} ({', '.join(result.variants)})")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("publish", help="upload the built variants to the Hub (branch v<version>)")
    parser.add_argument("--build-dir", default=str(REPO_ROOT / "build"), help="folder of build variants")
    parser.add_argument("--endpoint", help="Hub URL (default: the embedded Hub over its default data dir)")
    parser.add_argument("--repo-id", help=f"kernel repo (default: build.toml's, else {DEFAULT_REPO_ID})")
    parser.add_argument("--token", help="write token (default: the embedded Hub's, else $HF_TOKEN / saved login)")
    parser.add_argument("--allow-dirty", action="store_true", help="publish a build from a dirty tree")
    parser.set_defaults(func=run)
