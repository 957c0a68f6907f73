"""End to end on CPU: the real build published as v1, v2, v3 to an embedded Hub on an
ephemeral port, then loaded the ways users load it (versions, branches, shas, lock
files, offline), plus the errors they should see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flash_attn_hub import REPO_ROOT
from flash_attn_hub.hub import start_embedded_hub
from flash_attn_hub.hub.testing import client_env, craft_variant, publish_versions
from flash_attn_hub.publish import PublishError, publish

TOKEN = "hf_test_e2e_token"
REPO = "flash-attn-hub/flash-attn"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """This machine's variant, built once for the module with the build tool."""
    build = pytest.importorskip("flash_attn_hub.build", reason="the build tool is not written yet")
    return Path(build.build_variant(tmp_path_factory.mktemp("e2e-build"), backend="cpu"))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    server = start_embedded_hub(tmp_path_factory.mktemp("e2e-hub"), token=TOKEN)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def published(built, hub, tmp_path_factory):
    """{version: PublishResult}, with huggingface_hub/kernels pointed at the Hub and a fresh HF_HOME."""
    hf_home = tmp_path_factory.mktemp("e2e-hf-home")
    with client_env(hub.endpoint, hf_home):
        yield publish_versions(built, tmp_path_factory.mktemp("e2e-versions"), endpoint=hub.endpoint,
                               token=TOKEN, repo_id=REPO, uid_prefix="e2e")


def _sha_of(module) -> str:
    parts = Path(module.__file__).parts
    return parts[parts.index("snapshots") + 1]


def test_version_rule_on_the_real_build(built, hub, published, tmp_path):
    no_function = tmp_path / "v2-without"
    craft_variant(built, no_function, version=2, uid="e2ev2without")
    with pytest.raises(PublishError, match=r"removes public name\(s\) published_version.*needs version 3"):
        publish(no_function, endpoint=hub.endpoint, token=TOKEN, repo_id=REPO, allow_dirty=True, card=None,
                benchmarks_dir=None, log=lambda _: None)


def test_republishing_the_same_build_is_a_no_op(hub, published, tmp_path):
    from huggingface_hub import HfApi

    again = publish(Path(published["dirs"][3]), endpoint=hub.endpoint, token=TOKEN, repo_id=REPO, allow_dirty=True,
                    card=None, benchmarks_dir=None, log=lambda _: None)
    assert again.commit == published[3].commit
    refs = HfApi(endpoint=hub.endpoint).list_repo_refs(REPO, repo_type="kernel")
    assert {b.name: b.target_commit for b in refs.branches}["v3"] == published[3].commit


def test_get_kernel_by_version_branch_and_sha(published):
    import kernels

    from flash_attn_hub.verify import check_attention

    v1 = kernels.get_kernel(REPO, version=1)
    v2 = kernels.get_kernel(REPO, version=2)
    v3 = kernels.get_kernel(REPO, version=3)
    assert not hasattr(v1, "published_version")
    assert (v2.published_version(), v3.published_version()) == (2, 3)
    assert [_sha_of(m) for m in (v1, v2, v3)] == [published[n].commit for n in (1, 2, 3)]
    assert _sha_of(kernels.get_kernel(REPO, revision="v3")) == published[3].commit
    pinned = kernels.get_kernel(REPO, revision=published[2].commit)
    assert pinned.published_version() == 2
    check_attention(v3)  # GQA forward + backward through the downloaded build


def test_has_kernel_and_variant_decisions(published):
    import kernels
    from kernels import VariantAccepted, VariantRejected

    assert kernels.has_kernel(REPO, version=3)
    decisions = {d.variant.variant_str: d for d in kernels.get_kernel_variants(REPO, version=3)}
    assert isinstance(decisions["torch-cuda"], VariantRejected)
    assert decisions["torch-cuda"].reason  # kernels says why (no CUDA in this torch)
    accepted = [name for name, d in decisions.items() if isinstance(d, VariantAccepted)]
    assert accepted and "torch-cuda" not in accepted


def test_kernels_versions_cli_lists_all_three(published, capsys, monkeypatch):
    from kernels.cli import main

    monkeypatch.setattr(sys, "argv", ["kernels", "versions", REPO])
    main()
    out = capsys.readouterr().out
    for version in (1, 2, 3):
        assert f"Version {version}:" in out
    assert "torch-cuda" in out


def test_bad_requests_raise_the_clients_errors(published):
    import kernels
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    with pytest.raises(ValueError, match="Version 9 not found, available versions: 1, 2, 3"):
        kernels.get_kernel(REPO, version=9)
    with pytest.raises(RepositoryNotFoundError):
        kernels.get_kernel("flash-attn-hub/no-such-kernel", version=1)
    with pytest.raises(RevisionNotFoundError):
        kernels.get_kernel(REPO, revision="no-such-branch")
    with pytest.raises(ValueError, match="not from a trusted publisher"):
        kernels.get_kernel("untrusted-org/flash-attn", version=1)


def test_untrusted_org_needs_trust_remote_code(built, hub, published, tmp_path):
    import kernels

    build = tmp_path / "other"
    craft_variant(built, build, version=1, uid="e2eother")
    publish(build, endpoint=hub.endpoint, token=TOKEN, repo_id="other-org/flash-attn", allow_dirty=True,
            card=None, benchmarks_dir=None, log=lambda _: None)
    with pytest.raises(ValueError, match="not from a trusted publisher"):
        kernels.get_kernel("other-org/flash-attn", version=1)
    assert kernels.get_kernel("other-org/flash-attn", version=1, trust_remote_code=True).flash_attn_func


def test_lock_file_and_offline_loads(published, tmp_path, monkeypatch):
    """``kernels lock`` pins v3's sha; after a full snapshot download a fresh process with
    HF_HUB_OFFLINE=1 and an unreachable endpoint loads it by lock file and by version."""
    from huggingface_hub import snapshot_download
    from kernels.cli import main

    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "user-project"\nversion = "0"\n\n[tool.kernels.dependencies]\n"{REPO}" = 3\n')
    monkeypatch.setattr(sys, "argv", ["kernels", "lock", str(project)])
    main()
    lock = json.loads((project / "kernels.lock").read_text())
    assert published[3].commit in json.dumps(lock)
    snapshot_download(REPO, repo_type="kernel", revision="v3")  # full: refs/v3, every file, tree listing

    script = textwrap.dedent(f"""
        from pathlib import Path
        import kernels
        locked = kernels.load_kernel("{REPO}", lockfile=Path("{project / 'kernels.lock'}"))
        by_version = kernels.get_kernel("{REPO}", version=3)
        print(locked.published_version(), by_version.published_version(), Path(locked.__file__).parts[-4])
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=str(REPO_ROOT))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "3", published[3].commit]


def test_verify_command_in_a_fresh_process(published, hub, capfd):
    from flash_attn_hub.verify import verify

    proc = verify(REPO, 3, hub.endpoint)
    out = capfd.readouterr().out
    assert proc.returncode == 0, out
    assert f"sha {published[3].commit}" in out and "digest ok" in out
