"""The HTTP side of the embedded Hub: the subset of the Hugging Face Hub API that
huggingface_hub 2.4, kernels 0.17 and transformers 5.22 call, over :class:`GitStore`.

Routes (``{t}`` is ``kernels`` or ``models``; revisions and paths arrive URL-quoted):

====================================================  ======================================
``GET  /api/whoami-v2``                               the token's user (401 without a valid one)
``POST /api/repos/create``                            create a public repo (write)
``POST /api/validate-yaml``                           README front matter must be a mapping
``GET  /api/organizations/{org}/overview``            ``trustedKernelPublisher`` for trusted orgs
``GET  /api/{t}/{repo}[/revision/{rev}]``             repo info at a revision (``sha``)
``GET  /api/{t}/{repo}/refs``                         branches and tags
``GET  /api/{t}/{repo}/tree/{rev}[/{path}]``          listing (``recursive``), one page
``POST /api/{t}/{repo}/paths-info/{rev}``             entries for form field ``paths``
``POST /api/{t}/{repo}/preupload/{rev}``              always ``uploadMode: regular`` (no LFS/Xet)
``POST /api/{t}/{repo}/commit/{rev}``                 NDJSON commit, ``parentCommit`` checked (write)
``POST|DELETE /api/{t}/{repo}/branch/{branch}``       create (``startingPoint``) / delete (write)
``HEAD|GET /{kernels/}{repo}/resolve/{rev}/{path}``   file bytes (``Range``), ``X-Repo-Commit``, ``ETag``
====================================================  ======================================

Errors carry the Hub's ``X-Error-Code`` / ``X-Error-Message`` headers and a JSON
``{"error": ...}`` body, which huggingface_hub turns into RepositoryNotFoundError,
RevisionNotFoundError, RemoteEntryNotFoundError or HfHubHTTPError (401 uses the
message the client reserves for bad credentials, so it is not mistaken for a missing repo).
Every malformed request gets a 4xx that names what is wrong; a 5xx is a bug here.

The stack, and why
------------------
The server is an ASGI application served by **uvicorn** (h11), written with
**Starlette**'s request and response classes. Before, it was ``http.server``, and
everything a public-facing server needs was ours to write and got written badly: HTTP
framing (a bad ``Content-Length`` or chunk size got no answer), socket timeouts (none:
each idle connection held a thread), the listen backlog (5: fifty concurrent downloads
waited on SYN retries), byte ranges (``bytes=-3`` served the first bytes) and disconnects
(logged as internal errors). uvicorn brings h11's framing checks (400), an event loop in
which an idle connection costs a socket and not a thread, ``timeout_keep_alive``,
``limit_concurrency`` (503 past it) and a real backlog; Starlette's ``FileResponse``
serves ``Range`` (suffix ranges, 416) and ``HEAD`` from a file. What stays ours is the
Hub's routes, the git store, and the request limits in :mod:`.inputs`.

Routing reads the raw path, not Starlette's router: huggingface_hub quotes a revision as
one segment (``refs%2Fpr%2F1``), and the decoded path Starlette routes on would make it
indistinguishable from the path after it. Blocking git calls run in Starlette's thread
pool, so the event loop keeps accepting while git works. :class:`HubServer` runs uvicorn
in a background thread (``start``/``stop``, for ``release`` and tests) or in the
foreground (``serve_forever``, for ``hub serve``), on a socket it binds itself so the
port is known (and a port in use is an error) before it returns.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hmac
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, unquote_to_bytes

import h11
import uvicorn
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from . import inputs
from .inputs import ClientDisconnect, field, json_object
from .store import COMMIT_RE, REPO_TYPES, GitStore, HubError, Operation, check_revision, clean_path

log = logging.getLogger("flash_attn_hub.hub")

_TYPE_BY_PLURAL = {"kernels": "kernel", "models": "model"}
_URL_PREFIX = {"kernel": "kernels/", "model": ""}
BAD_CREDENTIALS = "Invalid credentials in Authorization header"
PRIVATE_REFUSED = ("Private repositories are not supported by this Hub: it serves every repository to anyone "
                   "who can reach it (reads need no token), so create a public one")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one client may cost the server."""

    max_upload_bytes: int = 1 << 30  # one commit's NDJSON body (files travel inline, base64)
    max_json_bytes: int = 4 << 20  # any other body (preupload lists 256 files a call)
    idle_timeout_s: float = 30.0  # longest wait for the next chunk of a body
    keep_alive_s: float = 10.0  # a connection with no request in progress (new, idle or mid-head)
    # uvicorn's limit_concurrency: past it, requests get 503. Open connections count, idle ones
    # too until keep_alive_s reaps them, so it sits well above any real client count; what it
    # bounds is a flood (each request in flight may hold up to max_json_bytes).
    max_connections: int = 1024
    backlog: int = 1024  # pending connections the kernel queues before accept()
    drain_bytes: int = 1 << 20  # unread body discarded to keep a refused client's connection


def _ascii(text: str) -> str:
    """``text`` as a header value: printable ASCII (others become ``?``), no edge spaces."""
    return "".join(c if " " <= c <= "~" else "?" for c in text[:1000]).strip()


def error_response(err: HubError, extra: dict | None = None) -> JSONResponse:
    headers = {"X-Error-Message": _ascii(err.message)}
    if err.code:
        headers["X-Error-Code"] = err.code
    if err.commit:
        headers["X-Repo-Commit"] = err.commit
    return JSONResponse({"error": err.message, **(extra or {})}, err.status, headers)


class HubApp:
    """The ASGI application: the Hub's routes over ``store``; writes need ``Bearer <token>``."""

    def __init__(self, store: GitStore, *, token: str, trusted_orgs: frozenset[str] = frozenset(),
                 user: str = "hub-admin", limits: Limits = Limits()):
        if not token:
            raise ValueError("token: the embedded Hub needs a write token (got an empty one)")
        self.store = store
        self.token = token
        self.trusted_orgs = frozenset(trusted_orgs)
        self.user = user
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        request = Request(scope, receive)
        try:
            response = await self._dispatch(request)
        except ClientDisconnect:
            return  # nobody is left to answer
        await response(scope, receive, send)

    async def _dispatch(self, request: Request) -> Response:
        method = request.method
        try:
            parts = [unquote_to_bytes(p).decode("utf-8") for p in request.scope["raw_path"].decode("latin-1")
                     .split("?")[0].split("/")[1:]]
        except UnicodeDecodeError:
            return error_response(HubError(400, "Bad request: the path is not valid UTF-8 once unquoted"))
        drain = True
        try:
            response = await self._route(request, method, parts)
        except HubError as err:
            response = error_response(err)
            drain = err.status not in (408, 413)  # the body was too slow or too large already
        except ClientDisconnect:
            raise
        except Exception as err:  # a bug here: answer in the Hub's format, keep the traceback
            log.exception("internal error on %s %s", method, request.url.path)
            response = error_response(HubError(500, f"Internal error: {type(err).__name__}: {err}"))
        # A body the route did not read (a refused request) is read and dropped if it is small, so
        # the connection can serve the next request; otherwise the connection closes. Not when the
        # client waits for "100 Continue": reading would invite the body the route refused.
        limits = self.limits
        drain = drain and request.headers.get("expect", "").lower() != "100-continue"
        if not (drain and await inputs.drain(request, limit=limits.drain_bytes, idle_timeout=limits.idle_timeout_s)):
            if inputs.has_body(request) and not getattr(request.state, "body_read", False):
                response.headers["Connection"] = "close"
        return response

    def _require_write(self, request: Request) -> None:
        given = request.headers.get("authorization", "")
        token = given[len("Bearer "):] if given.startswith("Bearer ") else ""
        if not token or not hmac.compare_digest(token.encode(), self.token.encode()):
            raise HubError(401, BAD_CREDENTIALS)

    async def _json_body(self, request: Request, what: str) -> dict:
        raw = await inputs.read_body(request, limit=self.limits.max_json_bytes,
                                     idle_timeout=self.limits.idle_timeout_s, what=what)
        return json_object(raw, what)

    def _base_url(self, request: Request) -> str:
        host = request.headers.get("host") or "{}:{}".format(*request.scope["server"])
        return f"http://{host}"

    # -- routing ---------------------------------------------------------------------------
    async def _route(self, request: Request, method: str, parts: list[str]) -> Response:
        if parts[:1] == ["api"]:
            head = parts[1:]
            if head == ["whoami-v2"] and method == "GET":
                return self._whoami(request)
            if head == ["repos", "create"] and method == "POST":
                self._require_write(request)
                payload = await self._json_body(request, "Repo creation request")
                return await run_in_threadpool(self._create_repo, request, payload)
            if head == ["validate-yaml"] and method == "POST":
                payload = await self._json_body(request, "validate-yaml request")
                return await run_in_threadpool(self._validate_yaml, payload)
            if len(head) == 3 and head[0] == "organizations" and head[2] == "overview" and method == "GET":
                org = head[1]
                return JSONResponse({"name": org, "fullname": org, "avatarUrl": "", "isVerified": False,
                                     "trustedKernelPublisher": org in self.trusted_orgs})
            if len(head) >= 3 and head[0] in _TYPE_BY_PLURAL:
                return await self._repo_api(request, method, _TYPE_BY_PLURAL[head[0]], f"{head[1]}/{head[2]}",
                                            head[3:])
        else:
            repo_type = "kernel" if parts[:1] == ["kernels"] else "model"
            rest = parts[1:] if repo_type == "kernel" else parts
            if len(rest) >= 5 and rest[2] == "resolve" and method in ("GET", "HEAD"):
                return await self._resolve(request, repo_type, f"{rest[0]}/{rest[1]}", rest[3],
                                           "/".join(rest[4:]))
        raise HubError(404, f"No route for {method} /{'/'.join(parts)}")

    async def _repo_api(self, request: Request, method: str, repo_type: str, repo_id: str,
                        rest: list[str]) -> Response:
        store = self.store
        action = rest[0] if rest else ""
        if method == "GET" and action in ("", "revision"):
            revision = "/".join(rest[1:]) if action else "main"
            return await run_in_threadpool(self._info, repo_type, repo_id, revision)
        if method == "GET" and action == "refs" and len(rest) == 1:
            return await run_in_threadpool(self._refs, repo_type, repo_id)
        if method == "GET" and action == "tree" and len(rest) >= 2:
            recursive = request.query_params.get("recursive", "false").lower() in ("1", "true")
            return await run_in_threadpool(self._tree, repo_type, repo_id, rest[1], "/".join(rest[2:]).strip("/"),
                                           recursive)
        if method == "POST" and action == "paths-info" and len(rest) >= 2:
            raw = await inputs.read_body(request, limit=self.limits.max_json_bytes,
                                         idle_timeout=self.limits.idle_timeout_s, what="paths-info form")
            return await run_in_threadpool(self._paths_info, repo_type, repo_id, "/".join(rest[1:]), raw)
        if method == "POST" and action == "preupload" and len(rest) >= 2:
            payload = await self._json_body(request, "Preupload request")
            return await run_in_threadpool(self._preupload, repo_type, repo_id, "/".join(rest[1:]), payload)
        if method == "POST" and action == "commit" and len(rest) >= 2:
            return await self._commit(request, repo_type, repo_id, "/".join(rest[1:]))
        if action == "branch" and len(rest) >= 2 and method in ("POST", "DELETE"):
            self._require_write(request)
            branch = "/".join(rest[1:])
            if method == "DELETE":
                await run_in_threadpool(store.delete_branch, repo_type, repo_id, branch)
            else:
                payload = await self._json_body(request, "Branch creation request")
                start = field(payload, "startingPoint", str, "Branch creation request")
                await run_in_threadpool(store.create_branch, repo_type, repo_id, branch, start)
            return JSONResponse({})
        raise HubError(404, f"No route for {method} /api/{repo_type}s/{repo_id}/{'/'.join(rest)}")

    # -- handlers (the blocking ones run in the thread pool) ------------------------------------
    def _whoami(self, request: Request) -> Response:
        self._require_write(request)
        orgs = [{"name": org, "type": "org"} for org in sorted(self.trusted_orgs)]
        return JSONResponse({"type": "user", "name": self.user, "fullname": self.user, "orgs": orgs,
                             "auth": {"type": "access_token",
                                      "accessToken": {"displayName": "embedded-hub", "role": "write"}}})

    def _create_repo(self, request: Request, payload: dict) -> Response:
        what = "Repo creation request"
        name = field(payload, "name", str, what, required=True)
        org = field(payload, "organization", str, what) or self.user
        repo_type = field(payload, "type", str, what, default="model")
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"{what}: 'type' must be one of {', '.join(REPO_TYPES)}, got {repo_type!r}")
        visibility = field(payload, "visibility", str, what, default="public")
        if visibility not in ("public", "private", "protected"):
            raise HubError(400, f"{what}: 'visibility' must be public, private or protected, got {visibility!r}")
        if field(payload, "private", bool, what) or visibility != "public":
            raise HubError(400, PRIVATE_REFUSED)
        repo_id = f"{org}/{name}"
        url = f"{self._base_url(request)}/{_URL_PREFIX[repo_type]}{repo_id}"
        try:
            self.store.create_repo(repo_type, repo_id)
        except HubError as err:
            if err.status != 409:
                raise
            # The Hub answers a conflict with the existing repo's url (create_repo(exist_ok=True) reads it).
            return error_response(err, {"url": url})
        return JSONResponse({"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self, payload: dict) -> Response:
        import yaml

        content = field(payload, "content", str, "validate-yaml request", default="")
        if content.startswith("---"):
            end = content.find("\n---", 3)
            try:
                meta = yaml.safe_load(content[3:end if end >= 0 else len(content)]) or {}
                problem = None if isinstance(meta, dict) else f"got {type(meta).__name__}"
            except yaml.YAMLError as err:
                problem = str(err)[:500]
            if problem is not None:
                message = f"front matter must be a YAML mapping ({problem})"
                return JSONResponse({"error": message, "errors": [{"message": message}], "warnings": []}, 400,
                                    {"X-Error-Message": _ascii(message)})
        return JSONResponse({"errors": [], "warnings": []})

    def _info(self, repo_type: str, repo_id: str, revision: str) -> Response:
        store = self.store
        commit = store.resolve(repo_type, repo_id, revision)
        files = [e.path for e in store.tree(repo_type, repo_id, commit, "", recursive=True) if e.kind == "file"]
        date = store.commit_date(repo_type, repo_id, commit)
        return JSONResponse({"id": repo_id, "author": repo_id.split("/")[0], "sha": commit, "lastModified": date,
                             "createdAt": date, "private": False, "gated": False, "disabled": False,
                             "downloads": 0, "likes": 0, "tags": [], "siblings": [{"rfilename": p} for p in files]})

    def _refs(self, repo_type: str, repo_id: str) -> Response:
        refs = self.store.refs(repo_type, repo_id)
        return JSONResponse({
            "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in refs["branches"]],
            "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": c} for n, c in refs["tags"]],
            "converts": [], "pullRequests": [],
        })

    def _tree(self, repo_type: str, repo_id: str, revision: str, path: str, recursive: bool) -> Response:
        commit = self.store.resolve(repo_type, repo_id, revision)
        entries = self.store.tree(repo_type, repo_id, commit, path, recursive)
        return JSONResponse([e.to_json() for e in entries])

    def _paths_info(self, repo_type: str, repo_id: str, revision: str, raw: bytes) -> Response:
        commit = self.store.resolve(repo_type, repo_id, revision)
        try:
            form = parse_qs(raw.decode("utf-8"), max_num_fields=10_000)
        except (UnicodeDecodeError, ValueError) as err:
            raise HubError(400, f"paths-info form: {err}") from None
        found = [self.store.entry(repo_type, repo_id, commit, clean_path(p.strip("/")))
                 for p in form.get("paths", [])]
        return JSONResponse([e.to_json() for e in found if e is not None])

    def _preupload(self, repo_type: str, repo_id: str, revision: str, payload: dict) -> Response:
        store = self.store
        commit = store.resolve(repo_type, repo_id, revision)
        answers = []
        for i, item in enumerate(field(payload, "files", list, "Preupload request", default=[])):
            what = f"Preupload request: files[{i}]"
            if not isinstance(item, dict):
                raise HubError(400, f"{what} must be a JSON object")
            path = clean_path(field(item, "path", str, what, required=True))
            existing = store.entry(repo_type, repo_id, commit, path)
            answers.append({"path": path, "uploadMode": "regular", "shouldIgnore": False,
                            "oid": existing.oid if existing is not None and existing.kind == "file" else None})
        return JSONResponse({"files": answers, "commitOid": commit})

    async def _commit(self, request: Request, repo_type: str, repo_id: str, branch: str) -> Response:
        self._require_write(request)
        if request.query_params.get("create_pr", "0").lower() not in ("0", "false", ""):
            raise HubError(400, "Pull requests are not supported by this Hub: commit to a branch")
        store = self.store
        check_revision(branch, what="branch")
        path = await run_in_threadpool(store.repo, repo_type, repo_id)
        if await run_in_threadpool(store.branch_tip, path, branch) is None:
            raise HubError(404, f"Invalid rev id: {branch} (commits go to an existing branch)", "RevisionNotFound")
        # The body is spooled to the data directory and decoded one line (one file) at a time, and
        # nothing moves the branch until every line is valid and every blob written.
        with store.scratch() as tmp:
            with open(tmp / "body.ndjson", "wb") as handle:
                await inputs.spool_body(request, handle, limit=self.limits.max_upload_bytes,
                                        idle_timeout=self.limits.idle_timeout_s, what="Commit body")
            commit = await run_in_threadpool(self._apply_commit, repo_type, repo_id, branch, tmp)
        url = f"{self._base_url(request)}/{_URL_PREFIX[repo_type]}{repo_id}/commit/{commit}"
        return JSONResponse({"success": True, "commitOid": commit, "commitUrl": url, "hookOutput": "",
                             "pullRequestUrl": None})

    def _apply_commit(self, repo_type: str, repo_id: str, branch: str, tmp: Path) -> str:
        header, operations = {}, []
        with open(tmp / "body.ndjson", "rb") as handle:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    item = json_object(line, f"Commit line {number}", empty_ok=False)
                    operation = _commit_operation(item, number, tmp)
                    if operation is None:
                        header = field(item, "value", dict, f"Commit line {number} (header)", required=True)
                    else:
                        operations.append(operation)
        what = "Commit header"
        summary = field(header, "summary", str, what) or "Commit"
        description = field(header, "description", str, what, default="")
        parent = field(header, "parentCommit", str, what)
        if parent is not None and not COMMIT_RE.match(parent):
            raise HubError(400, f"{what}: 'parentCommit' must be a 40-digit commit sha, got {parent[:60]!r}")
        return self.store.commit(repo_type, repo_id, branch, operations, summary=summary, description=description,
                                 parent_commit=parent)

    async def _resolve(self, request: Request, repo_type: str, repo_id: str, revision: str,
                       path: str) -> Response:
        commit, entry, blob, stat = await run_in_threadpool(self._locate, repo_type, repo_id, revision, path)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{entry.oid}"',
                   "Cache-Control": "public, max-age=31536000, immutable" if revision == commit else "no-cache"}
        return FileResponse(blob, headers=headers, media_type="application/octet-stream", stat_result=stat)

    def _locate(self, repo_type: str, repo_id: str, revision: str, path: str):
        store = self.store
        commit = store.resolve(repo_type, repo_id, revision)
        entry = store.entry(repo_type, repo_id, commit, clean_path(path))
        if entry is None or entry.kind != "file":
            raise HubError(404, f"Entry not found: {path} at {commit}", "EntryNotFound", commit)
        blob = store.blob_file(repo_type, repo_id, entry.oid)
        return commit, entry, blob, os.stat(blob)


def _commit_operation(item: dict, number: int, tmp: Path) -> Operation | None:
    """One NDJSON commit line as an Operation (a file's content decoded into ``tmp``), or None
    for the header line."""
    key = field(item, "key", str, f"Commit line {number}", required=True)
    what = f"Commit line {number} ({key})"
    if key == "header":
        return None
    value = field(item, "value", dict, what, required=True)
    if key == "file":
        path = clean_path(field(value, "path", str, what, required=True))
        content = field(value, "content", str, what, required=True)
        encoding = field(value, "encoding", str, what, default="utf-8")
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError) as err:
                raise HubError(400, f"{what}: 'content' of {path!r} is not valid base64 ({err})") from None
        elif encoding == "utf-8":
            data = content.encode("utf-8")
        else:
            raise HubError(400, f"{what}: 'encoding' must be base64 or utf-8, got {encoding[:40]!r}")
        source = tmp / f"line-{number}"
        source.write_bytes(data)
        return Operation("file", path, source)
    if key in ("deletedFile", "deletedFolder"):
        return Operation(key, clean_path(field(value, "path", str, what, required=True).rstrip("/")))
    if key == "lfsFile":
        raise HubError(400, "LFS files are not supported by this Hub: preupload answers uploadMode 'regular', "
                            "so send the content inline")
    raise HubError(400, f"Commit line {number}: unsupported key {key[:40]!r} (expected header, file, "
                        f"deletedFile or deletedFolder)")


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol, with its keep-alive timer also covering a new connection and a
    request head still arriving. uvicorn arms the timer only after a response and disarms it on
    any byte, so a client that connects and sends nothing, or a header a byte at a time, would
    hold its connection (and a ``limit_concurrency`` slot) forever."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        # Not disarmed here: handle_events disarms it once a whole request head has arrived.
        self.conn.receive_data(data)
        self.handle_events()

    def send_400_response(self, msg: str) -> None:
        # Called from handle_events' ``except h11.RemoteProtocolError``: say what h11 refused
        # (a bad Content-Length or chunk size, a head too large), in the Hub's error format.
        err = sys.exc_info()[1]
        detail = f"{msg} {err}" if isinstance(err, h11.RemoteProtocolError) else msg
        status = getattr(err, "error_status_hint", 400)
        body = json.dumps({"error": detail}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-error-message", _ascii(detail).encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class HubServer:
    """The Hub over ``store`` on ``address`` (``port`` 0: an ephemeral one); ``endpoint`` is its
    URL once constructed. ``start()``/``stop()`` serve it in a background thread,
    ``serve_forever()`` in this one until SIGINT/SIGTERM."""

    def __init__(self, address: tuple[str, int], store: GitStore, *, token: str,
                 trusted_orgs: frozenset[str] = frozenset(), user: str = "hub-admin", limits: Limits = Limits()):
        self.app = HubApp(store, token=token, trusted_orgs=trusted_orgs, user=user, limits=limits)
        self.store, self.token, self.trusted_orgs, self.limits = store, token, self.app.trusted_orgs, limits
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on sockets that say they
        # are TCP, and without it a response's head and body wait on the client's delayed ACK (40 ms).
        self._socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind(address)
            # Listening now, not when uvicorn starts: a client told the endpoint (``hub serve``
            # prints it before serving) is queued, never refused.
            self._socket.listen(limits.backlog)
        except OSError:
            self._socket.close()
            raise
        host, port = self._socket.getsockname()[:2]
        self.endpoint = f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}"
        config = uvicorn.Config(
            self.app, http=_Protocol, loop="asyncio", lifespan="off", log_config=None, access_log=False,
            proxy_headers=False, server_header=False, timeout_keep_alive=limits.keep_alive_s,
            limit_concurrency=limits.max_connections, backlog=limits.backlog, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        """Serve in this thread until ``stop()`` or, in the main thread, SIGINT/SIGTERM."""
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self._socket.close()
            self.store.close()

    def start(self) -> "HubServer":
        """Serve in a daemon thread; returns self once it accepts connections."""
        self._thread = threading.Thread(target=self.serve_forever, name="embedded-hub", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the embedded Hub did not start on {self.endpoint}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop accepting, let running requests finish (5 s at most), and return when it is down."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
        else:
            self._socket.close()
            self.store.close()
