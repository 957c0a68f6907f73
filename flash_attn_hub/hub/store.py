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

Scratch files (an upload being decoded, a throw-away index, a repository being
created) live under ``tmp/`` in the data directory, never in the system's temp
folder, in a folder per store that holds an ``flock`` while the store is open:
a store opening the data directory removes the folders of stores that died
(``kill -9`` mid-upload) and leaves those of live ones alone. Downloads are
served from ``cache/blobs/``, blobs copied out of git once (content-addressed,
so every repository shares them and they never go stale).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import os
import re
import secrets
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
# git-check-ref-format's rules: no control characters, space, ~ ^ : ? * [ or backslash, no "..",
# "@{", "//", no component starting with "." or ending with ".lock", no leading or trailing "/",
# no trailing ".". (Leading "-" too: a revision must never read as an option.)
_BAD_REF = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//|(^|/)\.|\.lock(/|$)|^[/-]|/$|\.$|^@$")
# A branch is a file under refs/heads: its components must fit a file name (255 bytes, less
# git's ".lock"); 200 bytes for the whole name keeps well inside that.
MAX_REVISION_BYTES = 200
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
    """One commit operation: ``kind`` is "file" (``source`` set), "deletedFile" or "deletedFolder"."""

    kind: str
    path: str
    source: Path | None = None  # the file's content, a scratch file (see GitStore.scratch)


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (JSON can escape one)
        raise HubError(400, f"Invalid {what} {text!r}: not valid UTF-8") from None


def clean_path(path: str, *, what: str = "path") -> str:
    """A repository-relative path, or HubError 400 for one that could escape the repository
    (absolute, ``..``, ``.git``, backslashes, empty or ``.`` segments, control characters)."""
    if not isinstance(path, str) or not path:
        raise HubError(400, f"Invalid {what}: expected a non-empty string, got {path!r}")
    if len(_utf8(path, what)) > 4096:
        raise HubError(400, f"Invalid {what}: longer than 4096 bytes")
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


def check_revision(revision: str, *, what: str = "revision") -> str:
    """A branch, tag, full ref name or commit sha that git can only read as a ref name, or
    HubError 400 naming the rule it breaks (git revision syntax such as ``v1~1``, ``v1^``,
    ``a..b``, ``main:path``, ``@{1}`` is refused rather than evaluated)."""
    if not isinstance(revision, str) or not revision:
        raise HubError(400, f"Invalid {what}: expected a non-empty string, got {revision!r}")
    if len(_utf8(revision, what)) > MAX_REVISION_BYTES:
        raise HubError(400, f"Invalid {what} {revision[:40]!r}...: longer than {MAX_REVISION_BYTES} bytes")
    bad = _BAD_REF.search(revision)
    if bad is not None:
        raise HubError(400, f"Invalid {what} {revision!r}: {bad.group(0)!r} is not allowed in a ref name "
                            f"(revision expressions are not evaluated)")
    return revision


def check_branch_name(branch: str) -> str:
    check_revision(branch, what="branch name")
    ok = (not COMMIT_RE.match(branch) and not branch.startswith("refs/")
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
        self.scratch_dir, self._scratch_lock = _open_scratch(self.root / "tmp")
        self._blobs = self.root / "cache" / "blobs"
        # Commits are immutable, so what a path is at a commit never changes: downloads of a
        # pinned file skip git after the first one.
        self._entry_at_commit = functools.lru_cache(maxsize=8192)(self._entry_uncached)
        self._known_commits: set[tuple[Path, str]] = set()

    def close(self) -> None:
        """Remove this store's scratch folder (the next store over ``root`` would otherwise)."""
        if self._scratch_lock is None:
            return
        shutil.rmtree(self.scratch_dir, ignore_errors=True)
        Path(f"{self.scratch_dir}.lock").unlink(missing_ok=True)
        self._scratch_lock.close()
        self._scratch_lock = None

    @contextlib.contextmanager
    def scratch(self):
        """A fresh folder for temporary files inside the data directory, removed on exit."""
        path = Path(tempfile.mkdtemp(dir=self.scratch_dir))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # -- plumbing ---------------------------------------------------------------------------
    def _git(self, repo: Path, *args: str, input: bytes | None = None, env: dict | None = None,
             check: bool = True, stdout=subprocess.PIPE) -> bytes:
        full_env = {**os.environ, **_GIT_IDENTITY, "GIT_CONFIG_NOSYSTEM": "1", **(env or {})}
        proc = subprocess.run(["git", "--literal-pathspecs", f"--git-dir={repo}", *args], input=input,
                              stdout=stdout, stderr=subprocess.PIPE, env=full_env)
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
        with self.scratch() as tmp:
            staging = tmp / "repo.git"
            subprocess.run(["git", "init", "--quiet", "--bare", "--initial-branch=main", str(staging)],
                           check=True, capture_output=True)
            (tmp / "attributes").write_bytes(INITIAL_ATTRIBUTES)
            self._commit_tree(staging, None, {".gitattributes": ("100644", self._write_blobs(
                staging, [tmp / "attributes"])[0])}, "initial commit", "main")
            try:
                staging.rename(path)  # atomic: a half-created repository is never visible
            except OSError:
                raise HubError(409, f"You already created this {repo_type} repo: {repo_id}") from None

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
        check_revision(revision)
        is_sha = COMMIT_RE.match(revision) is not None
        if is_sha and (path, revision) in self._known_commits:
            return revision
        if not is_sha:
            tip = _loose_ref(path, revision if revision.startswith("refs/") else f"refs/heads/{revision}")
            if tip is not None:
                return tip
        candidates = [f"refs/heads/{revision}", f"refs/tags/{revision}"]
        if revision.startswith(("refs/heads/", "refs/tags/")):  # full ref names (GitRefInfo.ref)
            candidates.insert(0, revision)
        if is_sha:
            candidates.insert(0, revision)
        for candidate in candidates:
            out = self._git(path, "rev-parse", "--verify", "--quiet", f"{candidate}^{{commit}}", check=False)
            if out.strip():
                commit = out.decode().strip()
                if is_sha and commit == revision:
                    self._known_commits.add((path, commit))
                return commit
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
        check_revision(branch, what="branch")  # else "v1~1" would name v1's parent
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

    def _entry_uncached(self, path: Path, commit: str, path_in_repo: str) -> Entry | None:
        found = self._ls_tree(path, commit, "--", path_in_repo)
        return next((e for e in found if e.path == path_in_repo), None)

    def entry(self, repo_type: str, repo_id: str, commit: str, path_in_repo: str) -> Entry | None:
        """``path_in_repo`` at ``commit`` (a full sha, as :meth:`resolve` returns), or None."""
        path = self.repo(repo_type, repo_id)
        clean_path(path_in_repo)
        if not COMMIT_RE.match(commit):
            raise HubError(400, f"Invalid commit {commit!r}: expected 40 hex digits")
        return self._entry_at_commit(path, commit, path_in_repo)

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

    def blob_file(self, repo_type: str, repo_id: str, oid: str) -> Path:
        """A file holding blob ``oid`` of the repository, for serving (copied out of git on first
        use into ``cache/blobs``; written to a scratch file and renamed, so never seen half-written)."""
        path = self.repo(repo_type, repo_id)
        if not COMMIT_RE.match(oid):
            raise HubError(400, f"Invalid blob id {oid!r}")
        target = self._blobs / oid[:2] / oid[2:]
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with self.scratch() as tmp, open(tmp / "blob", "wb") as handle:
                self._git(path, "cat-file", "blob", oid, stdout=handle)
                os.replace(tmp / "blob", target)
        return target

    def read_blob(self, repo_type: str, repo_id: str, oid: str) -> bytes:
        return self.blob_file(repo_type, repo_id, oid).read_bytes()

    # -- commits ------------------------------------------------------------------------------------
    def _write_blobs(self, path: Path, sources: list[Path]) -> list[str]:
        if not sources:
            return []
        out = self._git(path, "hash-object", "-w", "--no-filters", "--stdin-paths",
                        input="".join(f"{source}\n" for source in sources).encode())
        return out.decode().split()

    def _commit_tree(self, path: Path, parent: str | None, files: dict[str, tuple[str, str]],
                     message: str, branch: str) -> str:
        with self.scratch() as tmp:
            env = {"GIT_INDEX_FILE": str(tmp / "index")}
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
        blobs = iter(self._write_blobs(path, [op.source for op in operations if op.kind == "file"]))
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


def _loose_ref(repo: Path, ref: str) -> str | None:
    """The commit a branch's loose ref file names (git's ``refs/heads/<name>``, which
    ``update-ref`` replaces by a rename, so it is never read half-written), or None where git
    keeps the ref elsewhere (packed refs, a symbolic ref): the caller then asks git. Saves a
    ``git rev-parse`` process on every request by branch. ``ref`` has passed check_revision."""
    if not ref.startswith("refs/heads/"):
        return None
    try:
        sha = (repo / ref).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return sha if COMMIT_RE.match(sha) else None


def _open_scratch(tmp: Path):
    """(folder, open lock file) for a new store's scratch files under ``tmp``, after removing the
    folders of stores that are gone. Each folder ``X`` has a lock file ``X.lock`` that its store
    holds an ``flock`` on while it lives; the kernel drops it when the process dies, however it
    dies. A guard lock makes the sweep and the creation one step for concurrent stores."""
    tmp.mkdir(parents=True, exist_ok=True)
    with open(tmp / ".guard", "a+b") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for lock_path in tmp.glob("*.lock"):
            with open(lock_path, "a+b") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live store's
                shutil.rmtree(tmp / lock_path.name[:-len(".lock")], ignore_errors=True)
                lock_path.unlink()
        for folder in tmp.iterdir():  # a folder whose lock file is gone: a sweep died half-way
            if folder.is_dir() and not (tmp / f"{folder.name}.lock").exists():
                shutil.rmtree(folder, ignore_errors=True)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        handle = open(tmp / f"{name}.lock", "a+b")
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        (tmp / name).mkdir()
    return tmp / name, handle
