"""Repositories of the embedded Hub, kept as bare git repositories.

Layout under the data directory::

    repos/<type>s/<namespace>/<name>.git   one bare repository per Hub repo
    token                                  the write token (mode 0600), when generated

Branches are kernel versions (``v3``), commits are the shas users pin. Every
write goes through git plumbing (``hash-object``, ``update-index``,
``write-tree``, ``commit-tree``, ``update-ref``) on a throw-away index, so a
commit is all-or-nothing: the branch moves with one compare-and-swap
``update-ref`` after the whole tree is written. Writes to one repository are
serialised by a lock (a thread lock plus ``flock`` on a file in the repository,
so two server processes over one data directory cannot interleave either), and
each commit is built on the branch tip read under that lock: two concurrent
commits to one branch both land, one on top of the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path

REPO_TYPES = ("kernel", "model")
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_ID_RE = re.compile(rf"^{_NAME}/{_NAME}$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
INITIAL_ATTRIBUTES = b"*.so binary\n*.bin binary\n"
_GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "flash-attn-hub",
    "GIT_AUTHOR_EMAIL": "hub@localhost",
    "GIT_COMMITTER_NAME": "flash-attn-hub",
    "GIT_COMMITTER_EMAIL": "hub@localhost",
}


class HubError(Exception):
    """An error with the Hub's status code and ``X-Error-Code`` (what huggingface_hub maps
    to its own exception types: RepoNotFound, RevisionNotFound, EntryNotFound)."""

    def __init__(self, status: int, message: str, code: str | None = None, commit: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.commit = commit  # sent as X-Repo-Commit with EntryNotFound


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tree entry: ``kind`` is "file" or "directory"; ``oid`` the git object id."""

    kind: str
    path: str
    oid: str
    size: int
    mode: str

    def to_json(self) -> dict:
        return {"type": self.kind, "oid": self.oid, "size": self.size, "path": self.path}


@dataclasses.dataclass(frozen=True)
class Operation:
    """One commit operation: ``kind`` is "file" (``content`` set), "deletedFile" or "deletedFolder"."""

    kind: str
    path: str
    content: bytes | None = None


def clean_path(path: str, *, what: str = "path") -> str:
    """A repository-relative path, or HubError 400 for one that could escape the repository
    (absolute, ``..``, ``.git``, backslashes, empty or ``.`` segments, control characters)."""
    if not isinstance(path, str) or not path:
        raise HubError(400, f"Invalid {what}: empty")
    if path.startswith("/") or "\\" in path or any(ord(c) < 32 for c in path):
        raise HubError(400, f"Invalid {what} {path!r}: must be relative, without backslashes or control characters")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", "..") or part.lower() == ".git":
            raise HubError(400, f"Invalid {what} {path!r}: segment {part!r} is not allowed")
    return path


def check_repo_id(repo_id: str) -> str:
    if not REPO_ID_RE.match(repo_id or "") or ".." in repo_id or repo_id.endswith(".git"):
        raise HubError(400, f"Invalid repo id {repo_id!r}: expected 'namespace/name'")
    return repo_id


def check_branch_name(branch: str) -> str:
    ok = (bool(branch) and not branch.startswith("-") and not COMMIT_RE.match(branch)
          and subprocess.run(["git", "check-ref-format", "--branch", branch],
                             capture_output=True).returncode == 0)
    if not ok:
        raise HubError(400, f"Invalid branch name {branch!r}")
    return branch


class GitStore:
    """All Hub repositories under ``root``; every method takes (repo_type, repo_id)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        (self.root / "repos").mkdir(parents=True, exist_ok=True)
        self._locks: dict[Path, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------
    def _git(self, repo: Path, *args: str, input: bytes | None = None, env: dict | None = None,
             check: bool = True) -> bytes:
        full_env = {**os.environ, **_GIT_IDENTITY, "GIT_CONFIG_NOSYSTEM": "1", **(env or {})}
        proc = subprocess.run(["git", "--literal-pathspecs", f"--git-dir={repo}", *args], input=input,
                              capture_output=True, env=full_env)
        if check and proc.returncode != 0:
            raise HubError(500, f"git {args[0]} failed: {proc.stderr.decode(errors='replace').strip()}")
        return proc.stdout

    def path_of(self, repo_type: str, repo_id: str) -> Path:
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Invalid repo type {repo_type!r}: expected one of {', '.join(REPO_TYPES)}")
        check_repo_id(repo_id)
        return self.root / "repos" / f"{repo_type}s" / f"{repo_id}.git"

    def repo(self, repo_type: str, repo_id: str) -> Path:
        """The path of an existing repository, or HubError 404 RepoNotFound."""
        try:
            path = self.path_of(repo_type, repo_id)
        except HubError:
            path = None
        if path is None or not (path / "HEAD").is_file():
            raise HubError(404, f"Repository {repo_id} ({repo_type}) not found", "RepoNotFound")
        return path

    @contextlib.contextmanager
    def _locked(self, path: Path):
        with self._locks_guard:
            lock = self._locks.setdefault(path, threading.Lock())
        with lock, open(path / "hub.lock", "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    # -- repositories and refs ------------------------------------------------------------------
    def create_repo(self, repo_type: str, repo_id: str) -> None:
        """Create an empty repository whose ``main`` holds one ``.gitattributes`` commit
        (as the Hub does); HubError 409 when it exists."""
        path = self.path_of(repo_type, repo_id)
        if (path / "HEAD").is_file():
            raise HubError(409, f"You already created this {repo_type} repo: {repo_id}")
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".creating-", dir=path.parent))
        try:
            subprocess.run(["git", "init", "--quiet", "--bare", "--initial-branch=main", str(staging)],
                           check=True, capture_output=True)
            self._commit_tree(staging, None, {".gitattributes": ("100644", self._write_blobs(
                staging, [INITIAL_ATTRIBUTES])[0])}, "initial commit", "main")
            try:
                staging.rename(path)  # atomic: a half-created repository is never visible
            except OSError:
                raise HubError(409, f"You already created this {repo_type} repo: {repo_id}") from None
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def refs(self, repo_type: str, repo_id: str) -> dict[str, list[tuple[str, str]]]:
        path = self.repo(repo_type, repo_id)
        out = self._git(path, "for-each-ref", "--format=%(refname)%00%(objectname)%00%(*objectname)",
                        "refs/heads", "refs/tags").decode()
        branches, tags = [], []
        for line in out.splitlines():
            ref, obj, peeled = line.split("\0")
            if ref.startswith("refs/heads/"):
                branches.append((ref[len("refs/heads/"):], obj))
            else:
                tags.append((ref[len("refs/tags/"):], peeled or obj))
        return {"branches": branches, "tags": tags}

    def resolve(self, repo_type: str, repo_id: str, revision: str) -> str:
        """Commit sha of a branch, tag or full commit sha; HubError 404 RevisionNotFound otherwise."""
        path = self.repo(repo_type, repo_id)
        candidates = [f"refs/heads/{revision}", f"refs/tags/{revision}"]
        if revision.startswith(("refs/heads/", "refs/tags/")):  # full ref names (GitRefInfo.ref)
            candidates.insert(0, revision)
        if COMMIT_RE.match(revision):
            candidates.insert(0, revision)
        if revision and not revision.startswith("-"):
            for candidate in candidates:
                out = self._git(path, "rev-parse", "--verify", "--quiet", f"{candidate}^{{commit}}", check=False)
                if out.strip():
                    return out.decode().strip()
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def branch_tip(self, path: Path, branch: str) -> str | None:
        out = self._git(path, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}^{{commit}}", check=False)
        return out.decode().strip() or None

    def create_branch(self, repo_type: str, repo_id: str, branch: str, starting_point: str | None) -> str:
        path = self.repo(repo_type, repo_id)
        check_branch_name(branch)
        start = self.resolve(repo_type, repo_id, starting_point or "main")
        with self._locked(path):
            if self.branch_tip(path, branch) is not None:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            self._git(path, "update-ref", f"refs/heads/{branch}", start, "0" * 40)
        return start

    def delete_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        path = self.repo(repo_type, repo_id)
        with self._locked(path):
            tip = self.branch_tip(path, branch)
            if tip is None or branch == "main":
                raise HubError(404 if tip is None else 403, f"Cannot delete branch {branch!r}",
                               "RevisionNotFound" if tip is None else None)
            self._git(path, "update-ref", "-d", f"refs/heads/{branch}", tip)

    def commit_date(self, repo_type: str, repo_id: str, commit: str) -> str:
        path = self.repo(repo_type, repo_id)
        stamp = int(self._git(path, "show", "-s", "--format=%ct", commit).decode().strip())
        return datetime.fromtimestamp(stamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")

    # -- trees and blobs -------------------------------------------------------------------------
    def _ls_tree(self, path: Path, *args: str) -> list[Entry]:
        out = self._git(path, "ls-tree", "-z", "-l", *args)
        entries = []
        for record in out.split(b"\0"):
            if not record:
                continue
            meta, name = record.split(b"\t", 1)
            mode, kind, oid, size = meta.decode().split()
            entries.append(Entry("directory" if kind == "tree" else "file", name.decode(), oid,
                                 0 if size == "-" else int(size), mode))
        return entries

    def entry(self, repo_type: str, repo_id: str, commit: str, path_in_repo: str) -> Entry | None:
        path = self.repo(repo_type, repo_id)
        clean_path(path_in_repo)
        found = self._ls_tree(path, commit, "--", path_in_repo)
        return next((e for e in found if e.path == path_in_repo), None)

    def tree(self, repo_type: str, repo_id: str, commit: str, path_in_repo: str = "",
             recursive: bool = False) -> list[Entry]:
        """Entries below ``path_in_repo`` ("" = root); HubError 404 EntryNotFound for a missing folder."""
        path = self.repo(repo_type, repo_id)
        flags = ["-r", "-t"] if recursive else []
        if not path_in_repo:
            return self._ls_tree(path, *flags, commit)
        clean_path(path_in_repo)
        head = self.entry(repo_type, repo_id, commit, path_in_repo)
        if head is None:
            raise HubError(404, f"Path {path_in_repo!r} not found", "EntryNotFound", commit)
        if head.kind == "file":
            return [head]
        return self._ls_tree(path, *flags, commit, "--", path_in_repo + "/")

    def read_blob(self, repo_type: str, repo_id: str, oid: str) -> bytes:
        return self._git(self.repo(repo_type, repo_id), "cat-file", "blob", oid)

    # -- commits ------------------------------------------------------------------------------------
    def _write_blobs(self, path: Path, contents: list[bytes]) -> list[str]:
        if not contents:
            return []
        with tempfile.TemporaryDirectory(prefix="blobs-") as tmp:
            names = []
            for i, content in enumerate(contents):
                name = os.path.join(tmp, str(i))
                with open(name, "wb") as handle:
                    handle.write(content)
                names.append(name)
            out = self._git(path, "hash-object", "-w", "--no-filters", "--stdin-paths",
                            input=("\n".join(names) + "\n").encode())
        return out.decode().split()

    def _commit_tree(self, path: Path, parent: str | None, files: dict[str, tuple[str, str]],
                     message: str, branch: str) -> str:
        with tempfile.TemporaryDirectory(prefix="index-") as tmp:
            env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
            records = b"".join(f"{mode} {oid}\t{name}".encode() + b"\0"
                               for name, (mode, oid) in sorted(files.items()))
            self._git(path, "update-index", "-z", "--index-info", input=records, env=env)
            tree = self._git(path, "write-tree", env=env).decode().strip()
        parents = ["-p", parent] if parent else []
        commit = self._git(path, "commit-tree", tree, *parents, "-F", "-", input=message.encode()).decode().strip()
        self._git(path, "update-ref", f"refs/heads/{branch}", commit, parent or "0" * 40)
        return commit

    def commit(self, repo_type: str, repo_id: str, branch: str, operations: list[Operation], *,
               summary: str, description: str = "", parent_commit: str | None = None) -> str:
        """Apply ``operations`` in order on the tip of ``branch`` and move the branch; returns the
        new commit sha. HubError 412 when ``parent_commit`` is given and is not the tip."""
        path = self.repo(repo_type, repo_id)
        for op in operations:
            clean_path(op.path.rstrip("/") if op.kind == "deletedFolder" else op.path)
        blobs = iter(self._write_blobs(path, [op.content for op in operations if op.kind == "file"]))
        with self._locked(path):
            tip = self.branch_tip(path, branch)
            if tip is None:
                raise HubError(404, f"Invalid rev id: {branch} (commits go to an existing branch)",
                               "RevisionNotFound")
            if parent_commit is not None and parent_commit != tip:
                raise HubError(412, f"A commit has happened since {parent_commit[:12]}: the tip of {branch} is "
                                    f"{tip[:12]}. Please refresh and try again.")
            files = {e.path: (e.mode, e.oid) for e in self._ls_tree(path, "-r", tip) if e.kind == "file"}
            for op in operations:
                if op.kind == "file":
                    prefix = op.path + "/"
                    if any(p.startswith(prefix) for p in files) or any(
                            "/".join(op.path.split("/")[:i]) in files for i in range(1, op.path.count("/") + 1)):
                        raise HubError(400, f"Cannot add {op.path!r}: it collides with an existing file or folder")
                    files[op.path] = ("100644", next(blobs))
                elif op.kind == "deletedFile":
                    if files.pop(op.path, None) is None:
                        raise HubError(404, f"A file with this name doesn't exist: {op.path}", "EntryNotFound", tip)
                elif op.kind == "deletedFolder":
                    prefix = op.path.rstrip("/") + "/"
                    doomed = [p for p in files if p.startswith(prefix)]
                    if not doomed:
                        raise HubError(404, f"A folder with this name doesn't exist: {op.path}", "EntryNotFound", tip)
                    for p in doomed:
                        del files[p]
                else:
                    raise HubError(400, f"Unsupported commit operation {op.kind!r}")
            message = summary + (f"\n\n{description}" if description else "")
            return self._commit_tree(path, tip, files, message, branch)
