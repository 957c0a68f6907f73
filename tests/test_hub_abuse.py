"""The embedded Hub under abuse: every malformed request gets a 4xx naming what is wrong (a
JSON ``{"error": ...}``) and the server keeps serving; writes are all-or-nothing; one client's
memory and time are bounded; ranges, concurrent downloads, disconnects, a kill mid-upload, and
a fuzz over request shapes. All traffic stays on 127.0.0.1. Not in the kernels_ci subset: they
test the maintainer's server, not the kernel, and wait on timeouts and a subprocess."""

from __future__ import annotations

import base64
import concurrent.futures
import http.client
import json
import logging
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from urllib.parse import quote

import pytest
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

from flash_attn_hub import REPO_ROOT
from flash_attn_hub.hub import GitStore, Limits, start_embedded_hub

TOKEN = "hf_test_abuse_token"
REPO = "flash-attn-hub/abuse"
SEVEN = b"0123456"
# Short limits, so that a test reaches the timeouts and size limits in its own time.
LIMITS = Limits(max_upload_bytes=1 << 20, max_json_bytes=64 << 10, idle_timeout_s=1.0, keep_alive_s=1.0,
                drain_bytes=64 << 10)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    server = start_embedded_hub(tmp_path_factory.mktemp("abuse-hub"), token=TOKEN, limits=LIMITS)
    api = HfApi(endpoint=server.endpoint, token=TOKEN)
    api.create_repo(REPO, repo_type="kernel")
    api.create_branch(REPO, branch="v1", repo_type="kernel")
    api.create_commit(REPO, [CommitOperationAdd("seven.txt", SEVEN)], repo_type="kernel", revision="v1",
                      commit_message="seven bytes")
    yield server
    server.stop()


def _address(hub) -> tuple[str, int]:
    host, port = hub.endpoint[len("http://"):].rsplit(":", 1)
    return host, int(port)


def request(hub, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            token: str | None = TOKEN) -> tuple[int, dict, bytes]:
    """(status, lower-cased headers, body) over a new connection."""
    conn = http.client.HTTPConnection(*_address(hub), timeout=30)
    try:
        sent = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request(method, path, body=body, headers={**sent, **(headers or {})})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def raw(hub, data: bytes, *, timeout: float = 10) -> bytes:
    """What the server sends back to ``data`` on a new socket, up to its close or ``timeout``."""
    with socket.create_connection(_address(hub), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]


def _tip(hub, branch: str = "v1", repo: str = REPO) -> str:
    refs = HfApi(endpoint=hub.endpoint).list_repo_refs(repo, repo_type="kernel")
    return {b.name: b.target_commit for b in refs.branches}[branch]


def _still_serving(hub) -> None:
    status, _, body = request(hub, "GET", f"/kernels/{REPO}/resolve/v1/seven.txt", token=None)
    assert (status, body) == (200, SEVEN)


def _ndjson(*lines) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


HEADER = {"key": "header", "value": {"summary": "abuse"}}
GOOD_FILE = {"key": "file", "value": {"path": "landed.txt", "content": base64.b64encode(b"x").decode(),
                                      "encoding": "base64"}}

WRONG_SHAPES = [  # (path, JSON body, authenticated): valid JSON, wrong shape
    ("/api/validate-yaml", {"content": 5}, False),
    ("/api/validate-yaml", ["---"], False),
    ("/api/repos/create", [], True),
    ("/api/repos/create", "name", True),
    ("/api/repos/create", {"name": 5, "type": "kernel"}, True),
    ("/api/repos/create", {"type": "kernel"}, True),
    ("/api/repos/create", {"name": "x", "organization": ["a"], "type": "kernel"}, True),
    ("/api/repos/create", {"name": "x", "type": 5}, True),
    ("/api/repos/create", {"name": "x", "type": "space"}, True),
    ("/api/repos/create", {"name": "x", "type": "kernel", "private": "yes"}, True),
    ("/api/repos/create", {"name": "x", "type": "kernel", "visibility": 1}, True),
    (f"/api/kernels/{REPO}/branch/b1", {"startingPoint": 5}, True),
    (f"/api/kernels/{REPO}/branch/b1", [1], True),
    (f"/api/kernels/{REPO}/preupload/v1", 7, False),
    (f"/api/kernels/{REPO}/preupload/v1", {"files": 5}, False),
    (f"/api/kernels/{REPO}/preupload/v1", {"files": [5]}, False),
    (f"/api/kernels/{REPO}/preupload/v1", {"files": [{"path": 5}]}, False),
    (f"/api/kernels/{REPO}/preupload/v1", {"files": [{}]}, False),
]


@pytest.mark.parametrize("path, payload, authenticated", WRONG_SHAPES)
def test_wrong_json_shapes_are_400(hub, path, payload, authenticated):
    status, headers, body = request(hub, "POST", path, json.dumps(payload).encode(),
                                    {"Content-Type": "application/json"}, token=TOKEN if authenticated else None)
    assert status == 400, body
    assert re.search(r"'\w+' (must be|is required)|must be a JSON object", error_of(body)), body
    assert headers["x-error-message"]
    assert "b1" not in {b.name for b in HfApi(endpoint=hub.endpoint).list_repo_refs(REPO, repo_type="kernel").branches}


@pytest.mark.parametrize("raw_body", [b"{", b"\xff\xfe{}", b"[" * 60_000, b"1" * 5000])
def test_bodies_that_are_not_json_are_400(hub, raw_body):
    status, _, body = request(hub, "POST", "/api/validate-yaml", raw_body, token=None)
    assert status == 400, body
    assert "validate-yaml request" in error_of(body)


BAD_COMMIT_LINES = [  # each after a valid file line, which must not land either
    [],  # a line that is a JSON array
    {"key": 5},
    {"value": {}},
    {"key": "file", "value": 5},
    {"key": "file", "value": {"path": 5, "content": ""}},
    {"key": "file", "value": {"path": "a.txt"}},
    {"key": "file", "value": {"path": "a.txt", "content": 5}},
    {"key": "file", "value": {"path": "a.txt", "content": "", "encoding": 5}},
    {"key": "file", "value": {"path": "a.txt", "content": "", "encoding": "rot13"}},
    {"key": "file", "value": {"path": "\ud800", "content": ""}},
    {"key": "header", "value": []},
    {"key": "header", "value": {"summary": 5}},
    {"key": "header", "value": {"parentCommit": 5}},
    {"key": "header", "value": {"parentCommit": "abc"}},
    {"key": "deletedFile", "value": {}},
    {"key": "deletedFolder", "value": {"path": ["a"]}},
    {"key": "nope", "value": {}},
]


@pytest.mark.parametrize("line", BAD_COMMIT_LINES, ids=lambda line: json.dumps(line)[:40])
def test_malformed_commit_lines_commit_nothing(hub, line):
    tip = _tip(hub)
    status, _, body = request(hub, "POST", f"/api/kernels/{REPO}/commit/v1", _ndjson(HEADER, GOOD_FILE, line))
    assert status == 400, body
    assert error_of(body).startswith(("Commit line 3", "Commit header")), body
    assert _tip(hub) == tip


def test_invalid_base64_commits_nothing(hub):
    tip = _tip(hub)
    for content in ("!!not base64!!", "QUJD\n", "QUJ", "é"):
        bad = {"key": "file", "value": {"path": "b64.txt", "content": content, "encoding": "base64"}}
        status, _, body = request(hub, "POST", f"/api/kernels/{REPO}/commit/v1", _ndjson(HEADER, GOOD_FILE, bad))
        assert status == 400, body
        assert "'content' of 'b64.txt' is not valid base64" in error_of(body)
    status, _, body = request(hub, "POST", f"/api/kernels/{REPO}/commit/v1", b"not json\n")
    assert status == 400 and "Commit line 1 is not valid JSON" in error_of(body)
    assert _tip(hub) == tip
    api = HfApi(endpoint=hub.endpoint)
    assert not api.file_exists(REPO, "b64.txt", repo_type="kernel", revision="v1")
    assert not api.file_exists(REPO, "landed.txt", repo_type="kernel", revision="v1")


BAD_REVISIONS = ["v1~1", "v1^", "v1^{tree}", "v1:seven.txt", "v1@{0}", "@", "v1..main", "-v1", ".v1", "v1.lock",
                 "a//b", "refs/heads/../v1", "v1 ", "b" * 300]


@pytest.mark.parametrize("revision", BAD_REVISIONS, ids=lambda r: r[:12])
def test_revision_expressions_and_long_names_are_400(hub, revision):
    quoted = quote(revision, safe="")
    branches = {b.name for b in HfApi(endpoint=hub.endpoint).list_repo_refs(REPO, repo_type="kernel").branches}
    for method, path in (("GET", f"/api/kernels/{REPO}/revision/{quoted}"),
                         ("GET", f"/api/kernels/{REPO}/tree/{quoted}"),
                         ("GET", f"/kernels/{REPO}/resolve/{quoted}/seven.txt"),
                         ("POST", f"/api/kernels/{REPO}/preupload/{quoted}"),
                         ("POST", f"/api/kernels/{REPO}/commit/{quoted}"),
                         ("POST", f"/api/kernels/{REPO}/branch/{quoted}"),
                         ("DELETE", f"/api/kernels/{REPO}/branch/{quoted}")):
        body = _ndjson(HEADER, GOOD_FILE) if "/commit/" in path else b"{}"
        status, _, answer = request(hub, method, path, body if method == "POST" else None)
        assert status == 400, (path, answer)
        assert re.match(r"Invalid (revision|branch|branch name) ", error_of(answer)), answer
    after = {b.name for b in HfApi(endpoint=hub.endpoint).list_repo_refs(REPO, repo_type="kernel").branches}
    assert after == branches


@pytest.mark.parametrize("framing", [b"Content-Length: abc\r\n\r\n",
                                     b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
                                     b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}"])
def test_bad_framing_gets_400(hub, framing):
    out = raw(hub, b"POST /api/validate-yaml HTTP/1.1\r\nHost: t\r\n" + framing)
    assert status_of(out) == 400, out
    assert b'"error": "Invalid HTTP request received.' in out
    _still_serving(hub)


def test_private_repos_are_refused(hub):
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    with pytest.raises(HfHubHTTPError) as info:
        api.create_repo("flash-attn-hub/secret", repo_type="kernel", private=True)
    assert info.value.response.status_code == 400
    assert "Private repositories are not supported" in str(info.value)
    for payload in ({"name": "secret", "type": "kernel", "private": True},
                    {"name": "secret", "type": "kernel", "visibility": "private"}):
        status, _, body = request(hub, "POST", "/api/repos/create", json.dumps(payload).encode())
        assert status == 400 and "Private repositories are not supported" in error_of(body)
    with pytest.raises(RepositoryNotFoundError):
        api.list_repo_refs("flash-attn-hub/secret", repo_type="kernel")
    api.create_repo("flash-attn-hub/open", repo_type="kernel", private=False)
    assert HfApi(endpoint=hub.endpoint).list_repo_refs("flash-attn-hub/open", repo_type="kernel").branches


def test_refused_requests_never_read_their_body(hub):
    # 300 MB declared, 1 KB sent: the refusal must come back without waiting for the rest, and
    # the connection must close (the rest of the body is never read).
    huge = b"Content-Length: 300000000\r\n\r\n" + b"x" * 1000
    for path, auth, status, message in (
            ("/api/repos/create", b"", 401, "Invalid credentials"),
            (f"/api/kernels/{REPO}/commit/v1", b"Authorization: Bearer wrong\r\n", 401, "Invalid credentials"),
            (f"/api/kernels/{REPO}/commit/v1", f"Authorization: Bearer {TOKEN}\r\n".encode(), 413,
             "Commit body of 300000000 bytes is over this Hub's limit of 1048576 bytes"),
            ("/api/validate-yaml", b"", 413, "validate-yaml request of 300000000 bytes is over")):
        out = raw(hub, f"POST {path} HTTP/1.1\r\nHost: t\r\n".encode() + auth + huge)
        assert status_of(out) == status, out
        assert message in out.decode(errors="replace")
        assert b"connection: close" in out.lower()
    # Chunked, so no size up front: refused once the bytes read pass the limit.
    chunk = b"%x\r\n%s\r\n" % (256 << 10, b"x" * (256 << 10))
    out = raw(hub, f"POST /api/kernels/{REPO}/commit/v1 HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n"
                   f"Transfer-Encoding: chunked\r\n\r\n".encode() + chunk * 5)
    assert status_of(out) == 413 and b"Commit body is over this Hub's limit" in out
    _still_serving(hub)


def test_idle_slow_and_stalled_connections_are_closed(hub):
    idle = [socket.create_connection(_address(hub), timeout=10) for _ in range(300)]
    stalled = socket.create_connection(_address(hub), timeout=10)
    stalled.sendall(b"POST /api/validate-yaml HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"con")
    slow = socket.create_connection(_address(hub), timeout=0.2)
    slow.sendall(b"GET /api/whoami-v2 HTTP/1.1\r\nHost: t\r\nX-Slow: ")
    deadline = time.monotonic() + 15  # keep_alive_s is 1 s: a head sent a byte at a time gains nothing
    slow_closed = False
    while not slow_closed and time.monotonic() < deadline:
        try:
            slow.sendall(b"x")
            slow_closed = slow.recv(1) == b""
        except TimeoutError:
            continue
        except OSError:
            slow_closed = True
    assert slow_closed
    for sock in idle:
        assert sock.recv(1) == b""  # closed by the server, not by this 10 s timeout
    answer = stalled.recv(65536)
    assert status_of(answer) == 408 and b"no data for 1 s" in answer
    for sock in (*idle, stalled, slow):
        sock.close()
    _still_serving(hub)


def test_byte_ranges(hub):
    path = f"/kernels/{REPO}/resolve/v1/seven.txt"
    for spec, status, body in (("bytes=-3", 206, b"456"), ("bytes=2-4", 206, b"234"), ("bytes=5-", 206, b"56"),
                               ("bytes=0-100", 206, SEVEN), ("bytes=-100", 206, SEVEN)):
        got = request(hub, "GET", path, headers={"Range": spec}, token=None)
        assert (got[0], got[2]) == (status, body), spec
    assert request(hub, "GET", path, headers={"Range": "bytes=-3"}, token=None)[1]["content-range"] == "bytes 4-6/7"
    for spec in ("bytes=7-", "bytes=100-200"):
        status, headers, _ = request(hub, "GET", path, headers={"Range": spec}, token=None)
        assert (status, headers["content-range"]) == (416, "bytes */7"), spec
    status, headers, body = request(hub, "HEAD", path, token=None)
    assert (status, headers["content-length"], body) == (200, "7", b"")
    info = HfApi(endpoint=hub.endpoint).get_paths_info(REPO, ["seven.txt"], repo_type="kernel", revision="v1")
    assert headers["etag"] == f'"{info[0].blob_id}"'  # the git blob id, which huggingface_hub caches by


def test_fifty_concurrent_downloads(hub):
    path = f"/kernels/{REPO}/resolve/v1/seven.txt"

    def download(_):
        started = time.perf_counter()
        status, _, body = request(hub, "GET", path, token=None)
        return status, body, time.perf_counter() - started

    sequential = [download(i) for i in range(20)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=50) as pool:
        together = list(pool.map(download, range(50)))
    assert all((status, body) == (200, SEVEN) for status, body, _ in sequential + together)
    print(f"download p50: sequential {statistics.median(t for *_, t in sequential) * 1e3:.1f} ms, "
          f"50 concurrent {statistics.median(t for *_, t in together) * 1e3:.1f} ms (same process as the server)")


def _scratch_empty(hub) -> bool:
    return not any(hub.store.scratch_dir.iterdir())


def test_client_leaving_mid_request_is_not_an_error(hub, caplog):
    caplog.set_level(logging.WARNING)
    for path in (f"/api/kernels/{REPO}/commit/v1", "/api/validate-yaml"):
        with socket.create_connection(_address(hub)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n"
                         f"Content-Length: 5000\r\n\r\n".encode() + _ndjson(HEADER)[:50])
            deadline = time.monotonic() + 10
            while "/commit/" in path and _scratch_empty(hub) and time.monotonic() < deadline:
                time.sleep(0.01)  # the commit is spooling its body
            assert "/commit/" not in path or not _scratch_empty(hub)
    deadline = time.monotonic() + 10
    while not _scratch_empty(hub) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _scratch_empty(hub)  # the commit's spool went with the client
    _still_serving(hub)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_kill_during_upload_leaves_no_temporary_files(tmp_path):
    data, system_tmp = tmp_path / "data", tmp_path / "system-tmp"
    system_tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "flash_attn_hub", "hub", "serve", "--data", str(data), "--port", "0",
                             "--token", TOKEN], cwd=REPO_ROOT, env={**os.environ, "TMPDIR": str(system_tmp)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        endpoint = None
        for line in proc.stdout:  # the first line names the endpoint (port 0: an ephemeral one)
            if match := re.search(r" at (http://\S+) ", line):
                endpoint = match.group(1)
                break
        assert endpoint, "hub serve did not report its endpoint"
        api = HfApi(endpoint=endpoint, token=TOKEN)
        api.create_repo(REPO, repo_type="kernel")
        api.create_branch(REPO, branch="v1", repo_type="kernel")
        tip = _tip(type("Hub", (), {"endpoint": endpoint}))
        content = base64.b64encode(os.urandom(300_000)).decode()
        body = _ndjson(HEADER, {"key": "file", "value": {"path": "big.bin", "content": content, "encoding": "base64"}})
        host, port = endpoint[len("http://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST /api/kernels/{REPO}/commit/v1 HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}"
                         f"\r\nContent-Length: {len(body) + 1000}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the whole upload but its last 1000 bytes is spooled
                spooled = list((data / "tmp").rglob("body.ndjson"))
                if spooled and spooled[0].stat().st_size == len(body):
                    break
                time.sleep(0.01)
            assert spooled and spooled[0].stat().st_size == len(body)
            proc.kill()
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
    assert list(system_tmp.rglob("*")) == []  # nothing ever went to the system's temp folder
    store = GitStore(data)  # the next server over the data directory sweeps the dead one's files
    try:
        assert list((data / "tmp").rglob("body.ndjson")) == []
        assert {p.name for p in (data / "tmp").iterdir()} == {".guard", store.scratch_dir.name,
                                                              f"{store.scratch_dir.name}.lock"}
        assert store.resolve("kernel", REPO, "v1") == tip  # and the branch never moved
    finally:
        store.close()


# -- fuzz: random shapes against every route -------------------------------------------------------
FUZZ_REPO = "flash-attn-hub/fuzz"
FIELDS = ["name", "organization", "type", "private", "visibility", "content", "startingPoint", "files", "path",
          "sample", "size", "key", "value", "summary", "description", "parentCommit", "encoding", "paths"]
STRINGS = ["", "v1", "main", "kernel", "model", "base64", "header", "file", "deletedFile", "deletedFolder",
           "lfsFile", "seven.txt", "build/torch-cpu/a.py", "../x", "/abs", "a//b", ".git/config", "a\\b",
           "\u00e9\u4e2d", "\ud800", "\x00\x01", "x" * 300, "0" * 40, "QUJD", "!!", "---\n- a\n---\n",
           "---\na: [\n---", "refs/heads/v1"]
REVISIONS = ["v1", "main", "refs/heads/v1", "0" * 40, "f" * 40, "v1~1", "v1^", "main:seven.txt", "v1@{0}", "a..b",
             "-x", ".x", "a.lock", "a/", "a//b", " ", "\u00e9", "\ud800", "%", "x" * 300, "nope", "new/branch"]
REPOS = [FUZZ_REPO, FUZZ_REPO, FUZZ_REPO, "flash-attn-hub/nope", "..", "a/b/c", "x" * 200 + "/y", "\u00e9/\u00e9", "-a/b"]
ROUTES = [("GET", "/api/{t}/{repo}"), ("GET", "/api/{t}/{repo}/revision/{rev}"), ("GET", "/api/{t}/{repo}/refs"),
          ("GET", "/api/{t}/{repo}/tree/{rev}"), ("GET", "/api/{t}/{repo}/tree/{rev}/{path}"),
          ("POST", "/api/{t}/{repo}/paths-info/{rev}"), ("POST", "/api/{t}/{repo}/preupload/{rev}"),
          ("POST", "/api/{t}/{repo}/commit/{rev}"), ("POST", "/api/{t}/{repo}/branch/{rev}"),
          ("DELETE", "/api/{t}/{repo}/branch/{rev}"), ("GET", "/kernels/{repo}/resolve/{rev}/{path}"),
          ("HEAD", "/kernels/{repo}/resolve/{rev}/{path}"), ("GET", "/{repo}/resolve/{rev}/{path}"),
          ("POST", "/api/repos/create"), ("POST", "/api/validate-yaml"), ("GET", "/api/whoami-v2"),
          ("GET", "/api/organizations/{org}/overview"), ("PUT", "/api/{t}/{repo}/settings"), ("PATCH", "/{path}")]


def _quote(text: str, safe: str = "") -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe=safe)


def _random_json(rng, depth: int = 0):
    kind = rng.choice(["null", "bool", "int", "float", "str", "str", "list", "dict", "dict"][:9 if depth < 3 else 6])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, -1, 7, 2**63, 10**30])
    if kind == "float":
        return rng.choice([0.5, -1e308, float("inf")])
    if kind == "str":
        return rng.choice(STRINGS)
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(FIELDS + ["zz"]): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _random_commit_line(rng):
    if rng.random() < 0.2:
        return _random_json(rng)
    value = {key: (rng.choice(STRINGS) if rng.random() < 0.7 else _random_json(rng))
             for key in rng.sample(["path", "content", "encoding", "summary", "description", "parentCommit"],
                                   rng.randint(0, 4))}
    return {"key": rng.choice(["header", "file", "deletedFile", "deletedFolder", "lfsFile", "x"]), "value": value}


def _random_request(rng) -> tuple[str, str, dict, bytes | None]:
    method, template = rng.choice(ROUTES)
    path = template.format(t=rng.choice(["kernels", "kernels", "models", "spaces"]),
                           repo="/".join(_quote(p) for p in rng.choice(REPOS).split("/", 1)),
                           rev=_quote(rng.choice(REVISIONS)), path=_quote(rng.choice(STRINGS), safe="/"),
                           org=_quote(rng.choice(STRINGS)))
    if rng.random() < 0.2:
        path += "?" + rng.choice(["recursive=true", "create_pr=1", "expand=true", "a=%ff", "recursive"])
    headers = {}
    if rng.random() < 0.7:
        headers["Authorization"] = rng.choice([f"Bearer {TOKEN}", f"Bearer {TOKEN}", "Bearer wrong", "Basic x",
                                               "Bearer", "\u00e9"])
    if rng.random() < 0.3:
        headers["Range"] = rng.choice(["bytes=0-", "bytes=-3", "bytes=5-2", "bytes=abc", "bytes=99-", "items=0-1",
                                       "bytes=0-1,2-3", "bytes=-0", "bytes="])
    if rng.random() < 0.3:
        headers["Content-Type"] = rng.choice(["application/json", "application/x-ndjson", "text/plain",
                                              "application/x-www-form-urlencoded", "multipart/form-data"])
    body = None
    if method in ("POST", "PUT", "PATCH", "DELETE") and rng.random() < 0.9:
        if "/commit/" in path:
            body = _ndjson(*(_random_commit_line(rng) for _ in range(rng.randint(0, 3))))
        elif "/paths-info/" in path:
            body = "&".join(f"paths={_quote(rng.choice(STRINGS))}" for _ in range(rng.randint(0, 3))).encode()
        else:
            body = rng.choice([json.dumps(_random_json(rng)).encode(), bytes(rng.randrange(256) for _ in range(8))])
    return method, path, headers, body


def test_fuzz_request_shapes(hub, caplog):
    import random

    caplog.set_level(logging.WARNING)
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo(FUZZ_REPO, repo_type="kernel")
    api.create_branch(FUZZ_REPO, branch="v1", repo_type="kernel")
    api.create_commit(FUZZ_REPO, [CommitOperationAdd("seven.txt", SEVEN)], repo_type="kernel", revision="v1",
                      commit_message="seven bytes")
    rng = random.Random(20240607)
    failures = []
    conn = None
    for _ in range(1500):
        method, path, headers, body = _random_request(rng)
        if conn is None:
            conn = http.client.HTTPConnection(*_address(hub), timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException) as err:
            failures.append((method, path, headers, body and body[:120], f"no answer: {err!r}"))
            conn.close()
            conn = None
            continue
        if status >= 500:
            failures.append((method, path, headers, body and body[:120], status))
        if response.getheader("connection", "").lower() == "close":
            conn.close()
            conn = None
    assert failures == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    _still_serving(hub)
