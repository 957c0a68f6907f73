"""The HTTP side of the embedded Hub: the subset of the Hugging Face Hub API that
huggingface_hub 2.4, kernels 0.17 and transformers 5.22 call, over :class:`GitStore`.

Routes (``{t}`` is ``kernels`` or ``models``; revisions and paths arrive URL-quoted):

====================================================  ======================================
``GET  /api/whoami-v2``                               the token's user (401 without a valid one)
``POST /api/repos/create``                            create a repo (write)
``POST /api/validate-yaml``                           README front matter must be a mapping
``GET  /api/organizations/{org}/overview``            ``trustedKernelPublisher`` for trusted orgs
``GET  /api/{t}/{repo}[/revision/{rev}]``             repo info at a revision (``sha``)
``GET  /api/{t}/{repo}/refs``                         branches and tags
``GET  /api/{t}/{repo}/tree/{rev}[/{path}]``          listing (``recursive``), one page
``POST /api/{t}/{repo}/paths-info/{rev}``             entries for form field ``paths``
``POST /api/{t}/{repo}/preupload/{rev}``              always ``uploadMode: regular`` (no LFS/Xet)
``POST /api/{t}/{repo}/commit/{rev}``                 NDJSON commit, ``parentCommit`` checked (write)
``POST|DELETE /api/{t}/{repo}/branch/{branch}``       create (``startingPoint``) / delete (write)
``HEAD|GET /{kernels/}{repo}/resolve/{rev}/{path}``   file bytes, ``X-Repo-Commit``, ``ETag``
====================================================  ======================================

Errors carry the Hub's ``X-Error-Code`` / ``X-Error-Message`` headers and a JSON
``{"error": ...}`` body, which huggingface_hub turns into RepositoryNotFoundError,
RevisionNotFoundError, RemoteEntryNotFoundError or HfHubHTTPError (401 uses the
message the client reserves for bad credentials, so it is not mistaken for a missing repo).
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from .store import GitStore, HubError, Operation, clean_path

log = logging.getLogger("flash_attn_hub.hub")

_TYPE_BY_PLURAL = {"kernels": "kernel", "models": "model"}
_URL_PREFIX = {"kernel": "kernels/", "model": ""}
BAD_CREDENTIALS = "Invalid credentials in Authorization header"


class HubServer(ThreadingHTTPServer):
    """A Hub over ``store`` on ``address``; writes need ``Authorization: Bearer <token>``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], store: GitStore, *, token: str,
                 trusted_orgs: frozenset[str] = frozenset(), user: str = "hub-admin"):
        if not token:
            raise ValueError("token: the embedded Hub needs a write token (got an empty one)")
        super().__init__(address, _Handler)
        self.store = store
        self.token = token
        self.trusted_orgs = frozenset(trusted_orgs)
        self.user = user
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        """Serve in a daemon thread; returns self (``endpoint`` is the URL to use)."""
        self._thread = threading.Thread(target=self.serve_forever, name="embedded-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join()


def _ascii(text: str) -> str:
    return text.encode("ascii", "replace").decode().replace("\r", " ").replace("\n", " ")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HubServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (stdlib signature)
        log.debug("%s %s", self.address_string(), format % args)

    # -- plumbing ---------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        self._body_cache: bytes | None = None
        try:
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            self._query = parse_qs(url.query)
            self._route(method, parts)
        except HubError as err:
            self._error(err)
        except (ValueError, KeyError, TypeError) as err:
            self._error(HubError(400, f"Bad request: {err}"))
        except Exception as err:  # a server bug must still answer in the Hub's format
            log.exception("internal error on %s %s", method, self.path)
            self._error(HubError(500, f"Internal error: {type(err).__name__}: {err}"))

    def _body(self) -> bytes:
        if self._body_cache is None:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        break
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self._body_cache = b"".join(chunks)
            else:
                self._body_cache = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return self._body_cache

    def _json_body(self) -> dict:
        raw = self._body()
        return json.loads(raw) if raw else {}

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, err: HubError) -> None:
        if self.command == "POST" and self._body_cache is None:
            self._body()  # drain the request so the connection stays usable
        headers = {"X-Error-Message": _ascii(err.message)}
        if err.code:
            headers["X-Error-Code"] = err.code
        if err.commit:
            headers["X-Repo-Commit"] = err.commit
        self._json({"error": err.message}, err.status, headers)

    def _require_write(self) -> None:
        given = self.headers.get("Authorization", "")
        token = given[len("Bearer "):] if given.startswith("Bearer ") else ""
        if not token or not hmac.compare_digest(token.encode(), self.server.token.encode()):
            if self._body_cache is None:
                self._body()
            raise HubError(401, BAD_CREDENTIALS)

    def _base_url(self) -> str:
        return f"http://{self.headers.get('Host') or self.server.endpoint[len('http://'):]}"

    # -- routing ---------------------------------------------------------------------------
    def _route(self, method: str, parts: list[str]) -> None:
        if parts[:1] == ["api"]:
            head = parts[1:]
            if head == ["whoami-v2"] and method == "GET":
                return self._whoami()
            if head == ["repos", "create"] and method == "POST":
                return self._create_repo()
            if head == ["validate-yaml"] and method == "POST":
                return self._validate_yaml()
            if len(head) == 3 and head[0] == "organizations" and head[2] == "overview" and method == "GET":
                org = head[1]
                return self._json({"name": org, "fullname": org, "avatarUrl": "", "isVerified": False,
                                   "trustedKernelPublisher": org in self.server.trusted_orgs})
            if len(head) >= 3 and head[0] in _TYPE_BY_PLURAL:
                repo_type = _TYPE_BY_PLURAL[head[0]]
                repo_id = f"{head[1]}/{head[2]}"
                return self._repo_api(method, repo_type, repo_id, head[3:])
        else:
            repo_type = "kernel" if parts[:1] == ["kernels"] else "model"
            rest = parts[1:] if repo_type == "kernel" else parts
            if len(rest) >= 5 and rest[2] == "resolve" and method in ("GET", "HEAD"):
                return self._resolve(repo_type, f"{rest[0]}/{rest[1]}", rest[3], "/".join(rest[4:]))
        raise HubError(404, f"No route for {method} {'/'.join(parts)}")

    def _repo_api(self, method: str, repo_type: str, repo_id: str, rest: list[str]) -> None:
        store = self.server.store
        action = rest[0] if rest else ""
        if method == "GET" and action in ("", "revision"):
            revision = "/".join(rest[1:]) if action else "main"
            return self._info(repo_type, repo_id, revision)
        if method == "GET" and action == "refs" and len(rest) == 1:
            refs = store.refs(repo_type, repo_id)
            return self._json({
                "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in refs["branches"]],
                "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": c} for n, c in refs["tags"]],
                "converts": [], "pullRequests": [],
            })
        if method == "GET" and action == "tree" and len(rest) >= 2:
            commit = store.resolve(repo_type, repo_id, rest[1])
            recursive = self._query.get("recursive", ["false"])[0].lower() in ("1", "true")
            entries = store.tree(repo_type, repo_id, commit, "/".join(rest[2:]).strip("/"), recursive)
            return self._json([e.to_json() for e in entries])
        if method == "POST" and action == "paths-info" and len(rest) >= 2:
            commit = store.resolve(repo_type, repo_id, "/".join(rest[1:]))
            form = parse_qs(self._body().decode())
            found = [store.entry(repo_type, repo_id, commit, p.strip("/")) for p in form.get("paths", [])]
            return self._json([e.to_json() for e in found if e is not None])
        if method == "POST" and action == "preupload" and len(rest) >= 2:
            return self._preupload(repo_type, repo_id, "/".join(rest[1:]))
        if method == "POST" and action == "commit" and len(rest) >= 2:
            return self._commit(repo_type, repo_id, "/".join(rest[1:]))
        if action == "branch" and len(rest) >= 2 and method in ("POST", "DELETE"):
            self._require_write()
            branch = "/".join(rest[1:])
            if method == "DELETE":
                store.delete_branch(repo_type, repo_id, branch)
            else:
                store.create_branch(repo_type, repo_id, branch, self._json_body().get("startingPoint"))
            return self._json({})
        raise HubError(404, f"No route for {method} /api/{repo_type}s/{repo_id}/{'/'.join(rest)}")

    # -- handlers --------------------------------------------------------------------------
    def _whoami(self) -> None:
        self._require_write()
        orgs = [{"name": org, "type": "org"} for org in sorted(self.server.trusted_orgs)]
        self._json({"type": "user", "name": self.server.user, "fullname": self.server.user, "orgs": orgs,
                    "auth": {"type": "access_token", "accessToken": {"displayName": "embedded-hub", "role": "write"}}})

    def _create_repo(self) -> None:
        self._require_write()
        payload = self._json_body()
        name = payload.get("name")
        if not isinstance(name, str) or not name:
            raise HubError(400, "Invalid request: 'name' is required")
        repo_id = f"{payload.get('organization') or self.server.user}/{name}"
        repo_type = payload.get("type") or "model"
        url = f"{self._base_url()}/{_URL_PREFIX.get(repo_type, '')}{repo_id}"
        try:
            self.server.store.create_repo(repo_type, repo_id)
        except HubError as err:
            if err.status != 409:
                raise
            # The Hub answers a conflict with the existing repo's url (create_repo(exist_ok=True) reads it).
            return self._json({"error": err.message, "url": url}, 409, {"X-Error-Message": _ascii(err.message)})
        self._json({"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self) -> None:
        import yaml

        content = self._json_body().get("content", "")
        if content.startswith("---"):
            end = content.find("\n---", 3)
            try:
                meta = yaml.safe_load(content[3:end if end >= 0 else len(content)]) or {}
            except yaml.YAMLError as err:
                meta = err
            if not isinstance(meta, dict):
                message = f"front matter must be a YAML mapping ({meta})"
                return self._json({"errors": [{"message": message}], "warnings": []}, 400,
                                  {"X-Error-Message": _ascii(message)})
        self._json({"errors": [], "warnings": []})

    def _info(self, repo_type: str, repo_id: str, revision: str) -> None:
        store = self.server.store
        commit = store.resolve(repo_type, repo_id, revision)
        files = [e.path for e in store.tree(repo_type, repo_id, commit, "", recursive=True) if e.kind == "file"]
        date = store.commit_date(repo_type, repo_id, commit)
        self._json({"id": repo_id, "author": repo_id.split("/")[0], "sha": commit, "lastModified": date,
                    "createdAt": date, "private": False, "gated": False, "disabled": False, "downloads": 0,
                    "likes": 0, "tags": [], "siblings": [{"rfilename": p} for p in files]})

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        store = self.server.store
        commit = store.resolve(repo_type, repo_id, revision)
        answers = []
        for item in self._json_body().get("files", []):
            path = clean_path(item["path"])
            existing = store.entry(repo_type, repo_id, commit, path)
            answers.append({"path": path, "uploadMode": "regular", "shouldIgnore": False,
                            "oid": existing.oid if existing is not None and existing.kind == "file" else None})
        self._json({"files": answers, "commitOid": commit})

    def _commit(self, repo_type: str, repo_id: str, branch: str) -> None:
        self._require_write()
        store = self.server.store
        store.repo(repo_type, repo_id)
        if self._query.get("create_pr", ["0"])[0] not in ("0", "false", ""):
            raise HubError(400, "Pull requests are not supported by this Hub: commit to a branch")
        header, operations = {}, []
        for line in self._body().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item.get("key"), item.get("value") or {}
            if key == "header":
                header = value
            elif key == "file":
                raw = value.get("content", "")
                content = base64.b64decode(raw) if value.get("encoding") == "base64" else raw.encode()
                operations.append(Operation("file", clean_path(value["path"]), content))
            elif key in ("deletedFile", "deletedFolder"):
                operations.append(Operation(key, clean_path(value["path"].rstrip("/"))))
            elif key == "lfsFile":
                raise HubError(400, "LFS files are not supported by this Hub: preupload answers uploadMode "
                                    "'regular', so send the content inline")
            else:
                raise HubError(400, f"Unsupported commit line key {key!r}")
        summary = header.get("summary") or "Commit"
        commit = store.commit(repo_type, repo_id, branch, operations, summary=summary,
                              description=header.get("description") or "",
                              parent_commit=header.get("parentCommit"))
        url = f"{self._base_url()}/{_URL_PREFIX[repo_type]}{repo_id}/commit/{commit}"
        self._json({"success": True, "commitOid": commit, "commitUrl": url, "hookOutput": "",
                    "pullRequestUrl": None})

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        store = self.server.store
        commit = store.resolve(repo_type, repo_id, revision)
        entry = store.entry(repo_type, repo_id, commit, clean_path(path))
        if entry is None or entry.kind != "file":
            raise HubError(404, f"Entry not found: {path} at {commit}", "EntryNotFound", commit)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{entry.oid}"', "Accept-Ranges": "bytes",
                   "Cache-Control": "public, max-age=31536000, immutable" if revision == commit else "no-cache"}
        data = b"" if self.command == "HEAD" else store.read_blob(repo_type, repo_id, entry.oid)
        ranged = self.headers.get("Range", "")
        if ranged.startswith("bytes=") and self.command == "GET":
            start_s, _, end_s = ranged[len("bytes="):].partition("-")
            start = int(start_s or 0)
            end = min(int(end_s), entry.size - 1) if end_s else entry.size - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
            return self._send(206, data[start:end + 1], headers, "application/octet-stream")
        if self.command == "HEAD":
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(entry.size))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            return
        self._send(200, data, headers, "application/octet-stream")
