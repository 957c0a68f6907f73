"""The embedded Hub through huggingface_hub's own client: repos, branches, commits, downloads,
the error types the client maps, concurrency, path escapes and restarts."""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from flash_attn_hub.hub import start_embedded_hub
from flash_attn_hub.hub.testing import client_env, dummy_variant

TOKEN = "hf_test_write_token"
REPO = "flash-attn-hub/hub-test"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    server = start_embedded_hub(tmp_path_factory.mktemp("hub-data"), token=TOKEN)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api(hub):
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo(REPO, repo_type="kernel")
    api.create_branch(REPO, branch="v1", repo_type="kernel")
    return api


def _tip(api, branch, repo=REPO):
    return next(b.target_commit for b in api.list_repo_refs(repo, repo_type="kernel").branches if b.name == branch)


def _raw(hub, method, path, body=b"", token=TOKEN, content_type="application/x-ndjson"):
    request = urllib.request.Request(hub.endpoint + path, data=body if method != "GET" else None, method=method,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


@pytest.mark.kernels_ci
def test_commit_tree_download_roundtrip(api, tmp_path):
    info = api.create_commit(REPO, [CommitOperationAdd("build/torch-cpu/a.py", b"A = 1\n"),
                                    CommitOperationAdd("build/torch-cpu/sub/b.json", b"{}")],
                             repo_type="kernel", revision="v1", commit_message="add")
    assert _tip(api, "v1") == info.oid
    tree = {e.path: e for e in api.list_repo_tree(REPO, repo_type="kernel", revision="v1", recursive=True)}
    assert {"build", "build/torch-cpu", "build/torch-cpu/sub", "build/torch-cpu/a.py"} <= set(tree)
    assert tree["build/torch-cpu/a.py"].size == 6
    top = [e.path for e in api.list_repo_tree(REPO, path_in_repo="build", repo_type="kernel", revision=info.oid)]
    assert top == ["build/torch-cpu"]
    path = api.hf_hub_download(REPO, "build/torch-cpu/a.py", repo_type="kernel", revision=info.oid,
                               cache_dir=tmp_path)
    assert open(path, "rb").read() == b"A = 1\n"
    paths = api.get_paths_info(REPO, ["build/torch-cpu/a.py", "missing"], repo_type="kernel", revision="v1")
    assert [p.path for p in paths] == ["build/torch-cpu/a.py"]
    assert api.repo_info(REPO, repo_type="kernel", revision="v1").sha == info.oid
    assert api.file_exists(REPO, "build/torch-cpu/a.py", repo_type="kernel", revision="v1")
    assert not api.file_exists(REPO, "build/torch-cpu/nope.py", repo_type="kernel", revision="v1")


@pytest.mark.kernels_ci
def test_unchanged_files_are_skipped_and_stale_deleted(api):
    api.create_commit(REPO, [CommitOperationAdd("keep.txt", b"same"), CommitOperationAdd("stale.txt", b"x")],
                      repo_type="kernel", revision="v1", commit_message="two")
    before = _tip(api, "v1")
    same = api.create_commit(REPO, [CommitOperationAdd("keep.txt", b"same")], repo_type="kernel", revision="v1",
                             commit_message="no-op")
    assert same.oid == before  # preupload returned the oid, the client skipped the empty commit
    api.create_commit(REPO, [CommitOperationDelete("stale.txt")], repo_type="kernel", revision="v1",
                      commit_message="delete")
    assert not api.file_exists(REPO, "stale.txt", repo_type="kernel", revision="v1")
    assert api.file_exists(REPO, "keep.txt", repo_type="kernel", revision="v1")


@pytest.mark.kernels_ci
def test_client_error_types(hub, api, tmp_path):
    with pytest.raises(RepositoryNotFoundError):
        api.list_repo_refs("flash-attn-hub/does-not-exist", repo_type="kernel")
    with pytest.raises(RepositoryNotFoundError):
        api.hf_hub_download("flash-attn-hub/does-not-exist", "x", repo_type="kernel", cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        api.list_repo_tree(REPO, repo_type="kernel", revision="v404").__iter__().__next__()
    with pytest.raises(RevisionNotFoundError):
        api.hf_hub_download(REPO, ".gitattributes", repo_type="kernel", revision="v404", cache_dir=tmp_path)
    with pytest.raises(RemoteEntryNotFoundError):
        api.hf_hub_download(REPO, "no/such/file.py", repo_type="kernel", revision="v1", cache_dir=tmp_path)
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree(REPO, path_in_repo="no-such-dir", repo_type="kernel", revision="v1"))


@pytest.mark.kernels_ci
def test_writes_need_the_token(hub, api):
    wrong = HfApi(endpoint=hub.endpoint, token="hf_wrong")
    for call in (lambda: wrong.create_repo("flash-attn-hub/other", repo_type="kernel"),
                 lambda: wrong.create_branch(REPO, branch="v9", repo_type="kernel"),
                 lambda: wrong.create_commit(REPO, [CommitOperationAdd("x", b"x")], repo_type="kernel",
                                             revision="v1", commit_message="nope"),
                 lambda: wrong.whoami()):
        with pytest.raises(HfHubHTTPError) as info:
            call()
        assert info.value.response.status_code == 401
        assert not isinstance(info.value, RepositoryNotFoundError)
    status, _, _ = _raw(hub, "POST", f"/api/kernels/{REPO}/branch/v9", b"{}", token="",
                        content_type="application/json")
    assert status == 401
    assert "v9" not in {b.name for b in api.list_repo_refs(REPO, repo_type="kernel").branches}
    assert api.whoami()["name"]
    assert wrong.list_repo_refs(REPO, repo_type="kernel").branches  # reads are open


@pytest.mark.kernels_ci
def test_parent_commit_is_checked_and_commits_are_atomic(api):
    stale = _tip(api, "v1")
    api.create_commit(REPO, [CommitOperationAdd("p1.txt", b"1")], repo_type="kernel", revision="v1",
                      commit_message="moves the tip")
    with pytest.raises(HfHubHTTPError) as info:
        api.create_commit(REPO, [CommitOperationAdd("p2.txt", b"2")], repo_type="kernel", revision="v1",
                          commit_message="stale parent", parent_commit=stale)
    assert info.value.response.status_code == 412
    tip = _tip(api, "v1")
    with pytest.raises(RemoteEntryNotFoundError):  # second op fails: the first must not land either
        api.create_commit(REPO, [CommitOperationAdd("p3.txt", b"3"), CommitOperationDelete("absent.txt")],
                          repo_type="kernel", revision="v1", commit_message="half")
    assert _tip(api, "v1") == tip
    assert not api.file_exists(REPO, "p3.txt", repo_type="kernel", revision="v1")


@pytest.mark.kernels_ci
def test_concurrent_commits_to_one_branch_all_land(hub, api):
    api.create_branch(REPO, branch="race", repo_type="kernel")
    start = _tip(api, "race")
    errors = []

    def commit(i):
        try:
            HfApi(endpoint=hub.endpoint, token=TOKEN).create_commit(
                REPO, [CommitOperationAdd(f"race/{i}.txt", str(i).encode())], repo_type="kernel",
                revision="race", commit_message=f"racer {i}")
        except Exception as err:  # collected, asserted below
            errors.append(err)

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    files = {e.path for e in api.list_repo_tree(REPO, path_in_repo="race", repo_type="kernel", revision="race")}
    assert files == {f"race/{i}.txt" for i in range(8)}
    path = hub.store.repo("kernel", REPO)
    history = hub.store._git(path, "rev-list", f"{start}..refs/heads/race").split()
    assert len(history) == 8


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad", ["../escape.txt", "/etc/passwd", "a/../../b", ".git/config", "a//b", "a\\b"])
def test_path_escape_refused(hub, api, bad):
    tip = _tip(api, "v1")
    lines = [{"key": "header", "value": {"summary": "evil"}},
             {"key": "file", "value": {"path": bad, "content": base64.b64encode(b"x").decode(),
                                       "encoding": "base64"}}]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    status, headers, payload = _raw(hub, "POST", f"/api/kernels/{REPO}/commit/v1", body)
    assert status == 400, payload
    assert "Invalid path" in json.loads(payload)["error"]
    assert _tip(api, "v1") == tip
    status, _, _ = _raw(hub, "GET", f"/kernels/{REPO}/resolve/v1/..%2F..%2Fhub.lock")
    assert status in (400, 404)


@pytest.mark.kernels_ci
def test_restart_keeps_data_and_kernels_loads_from_it(tmp_path):
    data = tmp_path / "data"
    first = start_embedded_hub(data, token=TOKEN)
    api = HfApi(endpoint=first.endpoint, token=TOKEN)
    api.create_repo("flash-attn-hub/restart", repo_type="kernel")
    api.create_branch("flash-attn-hub/restart", branch="v1", repo_type="kernel")
    build = tmp_path / "build"
    dummy_variant(build, version=1, uid="restart1")
    info = api.upload_folder(repo_id="flash-attn-hub/restart", repo_type="kernel", folder_path=build,
                             path_in_repo="build", revision="v1")
    first.stop()
    second = start_embedded_hub(data)
    try:
        import kernels

        with client_env(second.endpoint, tmp_path / "hf-home"):
            module = kernels.get_kernel("flash-attn-hub/restart", version=1)
            assert module.version() == 1
            assert f"/snapshots/{info.oid}/" in module.__file__
    finally:
        second.stop()


@pytest.mark.kernels_ci
def test_org_overview_and_validate_yaml(hub, api):
    trusted = api.get_organization_overview("flash-attn-hub")
    assert getattr(trusted, "trustedKernelPublisher") is True
    assert getattr(api.get_organization_overview("someone-else"), "trustedKernelPublisher") is False
    api._validate_yaml("---\nlicense: bsd-3-clause\n---\n# card\n", repo_type="kernel")
    with pytest.raises(ValueError, match="Invalid metadata"):
        api._validate_yaml("---\n- a list\n---\n", repo_type="kernel")


@pytest.mark.kernels_ci
def test_model_repos_are_served_too(hub, tmp_path):
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo("flash-attn-hub/tiny-model")
    api.create_commit("flash-attn-hub/tiny-model", [CommitOperationAdd("config.json", b'{"a": 1}')],
                      commit_message="config")
    tip = next(b.target_commit for b in api.list_repo_refs("flash-attn-hub/tiny-model").branches)
    assert api.model_info("flash-attn-hub/tiny-model").sha == tip
    path = api.hf_hub_download("flash-attn-hub/tiny-model", "config.json", cache_dir=tmp_path)
    assert open(path).read() == '{"a": 1}'
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("flash-attn-hub/hub-test")  # a kernel repo is not a model repo
