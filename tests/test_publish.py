"""``publish``: the kernel-builder upload layout on a Hub, and the refusals of the
version-bump rule, on minimal variants (the real kernel is published in test_e2e.py)."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
from huggingface_hub import CommitOperationAdd, HfApi

from flash_attn_hub import cli
from flash_attn_hub.hub import start_embedded_hub
from flash_attn_hub.hub.testing import craft_variant, dummy_variant
from flash_attn_hub.publish import PublishError, check_version_rule, public_names, publish, VariantState

TOKEN = "hf_test_publish_token"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    server = start_embedded_hub(tmp_path_factory.mktemp("publish-hub"), token=TOKEN)
    yield server
    server.stop()


def _publish(hub, build, repo, **kwargs):
    kwargs.setdefault("card", None)
    kwargs.setdefault("benchmarks_dir", None)
    return publish(build, endpoint=hub.endpoint, token=TOKEN, repo_id=repo, log=lambda _: None, **kwargs)


def _files(hub, repo, revision):
    api = HfApi(endpoint=hub.endpoint)
    return {e.path for e in api.list_repo_tree(repo, repo_type="kernel", revision=revision, recursive=True)
            if e.__class__.__name__ == "RepoFile"}


@pytest.mark.kernels_ci
def test_public_names_reads_literal_all():
    assert public_names("__all__ = ['a', 'b']\n__all__ += ['c']\n__all__.extend(('d',))\n") == {"a", "b", "c", "d"}
    assert public_names("x = 1\n") is None


@pytest.mark.kernels_ci
def test_version_rule_unit():
    served = {"torch-cpu": VariantState(3, frozenset({"f", "g"}), frozenset({"metadata.json", "__init__.py"}))}
    ok = {"torch-cpu": VariantState(3, frozenset({"f", "g", "h"}), frozenset({"metadata.json"}))}
    assert check_version_rule(3, served, ok) == []
    removed = {"torch-cpu": VariantState(3, frozenset({"f"}), frozenset({"metadata.json"}))}
    assert "removes public name(s) g" in check_version_rule(3, served, removed)[0]
    wrong = {"torch-cpu": VariantState(4, frozenset({"f", "g"}), frozenset({"metadata.json"}))}
    assert "version 4 != 3" in check_version_rule(3, served, wrong)[0]
    dropped = {"torch-cpu": VariantState(3, frozenset({"f", "g"}), frozenset({"__init__.py"}))}
    assert any("drop a variant" in p for p in check_version_rule(3, served, dropped))


@pytest.mark.kernels_ci
def test_publish_layout_stale_files_card_and_benchmarks(hub, tmp_path):
    repo = "flash-attn-hub/publish-layout"
    build = tmp_path / "build"
    cpu = dummy_variant(build, version=1, uid="lay1")
    (cpu / "old_helper.py").write_text("X = 1\n")
    from flash_attn_hub.hub.testing import write_digest

    write_digest(cpu)
    card = tmp_path / "CARD.md"
    card.write_text("---\nlicense: bsd-3-clause\n---\n# flash-attn\n")
    bench = tmp_path / "benchmarks"
    (bench / "results").mkdir(parents=True)
    (bench / "results" / "run.csv").write_text("provider,x\n")
    (bench / "benchmark.py").write_text("# timed by kernels benchmark\n")
    (bench / "train_trl.py").write_text("# a developer script\n")
    first = _publish(hub, build, repo, card=card, benchmarks_dir=bench)
    assert (first.branch, first.version, first.variants) == ("v1", 1, ("torch-cpu",))
    files = _files(hub, repo, "v1")
    assert {"build/torch-cpu/__init__.py", "build/torch-cpu/_ops.py", "build/torch-cpu/metadata.json",
            "build/torch-cpu/old_helper.py", "benchmarks/benchmark.py"} <= files
    assert not {"benchmarks/results/run.csv", "benchmarks/train_trl.py"} & files
    assert "README.md" in _files(hub, repo, "main")

    # Another variant on the branch (published from another machine) must survive a re-publish
    # of torch-cpu, while torch-cpu's stale file goes.
    other = tmp_path / "other"
    dummy_variant(other, version=1, uid="lay1cuda", variant="torch-cuda")
    _publish(hub, other, repo)
    (cpu / "old_helper.py").unlink()
    write_digest(cpu)
    again = _publish(hub, build, repo)
    files = _files(hub, repo, "v1")
    assert "build/torch-cpu/old_helper.py" not in files
    assert "build/torch-cuda/metadata.json" in files
    assert again.commit != first.commit


# What a published branch may hold (STYLE.md 14), written out here rather than taken from
# publish.py, so a rule that drifts there fails this test.
SERVED = re.compile(r"build/torch-cpu/[^/]+|benchmarks/benchmark[^/]*\.py|README\.md|\.gitattributes"
                    r"|build\.toml|flake\.nix|flake\.lock|LICENSE")


@pytest.mark.kernels_ci
def test_published_branch_holds_only_what_a_kernel_repository_serves(hub, tmp_path):
    """Publish with the defaults ``release`` uses (this repository's card, benchmarks/ and build
    files) onto a branch that an older upload littered with run logs, and list the branch."""
    repo = "flash-attn-hub/publish-served"
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo(repo, repo_type="kernel")
    api.create_branch(repo, branch="v1", repo_type="kernel")
    litter = ["benchmarks/NOTES.md", "benchmarks/results/run-1/RESULTS.md", "benchmarks/plots/a.png",
              "benchmarks/benchmark_retired.py", "benchmarks/old/benchmark.py"]
    api.create_commit(repo, [CommitOperationAdd(path, b"x\n") for path in litter], repo_type="kernel",
                      revision="v1", commit_message="an older upload")
    build = tmp_path / "build"
    variant = dummy_variant(build, version=1, uid="served1")
    (variant / "__pycache__").mkdir()
    (variant / "__pycache__" / "_ops.cpython-311.pyc").write_bytes(b"\0")
    publish(build, endpoint=hub.endpoint, token=TOKEN, repo_id=repo, log=lambda _: None)

    files = _files(hub, repo, "v1")
    assert sorted(f for f in files if not SERVED.fullmatch(f)) == []
    assert {"build/torch-cpu/metadata.json", "benchmarks/benchmark.py", "build.toml", "flake.nix"} <= files
    assert _files(hub, repo, "main") == {".gitattributes", "README.md"}


@pytest.mark.kernels_ci
def test_publish_refusals(hub, tmp_path):
    repo = "flash-attn-hub/publish-rules"
    base = tmp_path / "base"
    dummy_variant(base, version=2, uid="rule2")
    v2 = tmp_path / "v2"
    craft_variant(base / "torch-cpu", v2, version=2, uid="rule2b", add_public={"extra": "def extra():\n    return 2"})
    _publish(hub, v2, repo)

    # v2 serves `extra`: an upload without it needs v3.
    with pytest.raises(PublishError, match=r"removes public name\(s\) extra.*needs version 3"):
        _publish(hub, base, repo)

    dirty = tmp_path / "dirty"
    craft_variant(base / "torch-cpu", dirty, version=2, uid="rule2c", add_public={"extra": "extra = None"},
                  dirty=True)
    with pytest.raises(PublishError, match="dirty"):
        _publish(hub, dirty, repo)
    _publish(hub, dirty, repo, allow_dirty=True)

    broken = tmp_path / "broken"
    (broken / "torch-cpu").mkdir(parents=True)
    with pytest.raises(PublishError, match="no metadata.json"):
        _publish(hub, broken, repo)

    # The branch's metadata says another version (written by another tool): refused.
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    meta = json.loads((base / "torch-cpu" / "metadata.json").read_text())
    api.create_commit(repo, [CommitOperationAdd("build/torch-cuda/metadata.json",
                                                json.dumps({**meta, "version": 7}).encode())],
                      repo_type="kernel", revision="v2", commit_message="foreign upload")
    with pytest.raises(PublishError, match="metadata.json version 7"):
        _publish(hub, v2, repo)


@pytest.mark.kernels_ci
def test_publish_cli_with_wrong_token_fails(hub, tmp_path, capsys):
    build = tmp_path / "build"
    dummy_variant(build, version=1, uid="cli1")
    code = cli.main(["publish", "--build-dir", str(build), "--endpoint", hub.endpoint, "--repo-id",
                     "flash-attn-hub/publish-cli", "--token", "hf_wrong"])
    assert code == 1
    assert "401" in capsys.readouterr().err
    code = cli.main(["publish", "--build-dir", str(build), "--endpoint", hub.endpoint, "--repo-id",
                     "flash-attn-hub/publish-cli", "--token", TOKEN])
    assert code == 0
    assert "publish: flash-attn-hub/publish-cli@v1 = " in capsys.readouterr().out


def test_verify_checks_the_digest_before_running_downloaded_code(hub, tmp_path, capfd):
    from flash_attn_hub.verify import verify

    repo = "flash-attn-hub/publish-tampered"
    build = tmp_path / "build"
    init = dummy_variant(build, version=1, uid="tamper1") / "__init__.py"
    marker = tmp_path / "tampered-code-ran"
    # Changed after its digest was written. Were it imported before the check, it would leave the
    # marker and replace the checks that should refuse it.
    init.write_text(init.read_text() + textwrap.dedent(f"""
        import pathlib
        import flash_attn_hub.verify as _verify
        pathlib.Path({str(marker)!r}).write_text("ran")
        _verify.check_digest = lambda folder: 0
        _verify.check_attention = lambda module, *args, **kwargs: None
    """))
    _publish(hub, build, repo)
    proc = verify(repo, 1, hub.endpoint, timeout=300)
    err = capfd.readouterr().err
    assert proc.returncode == 1, err
    assert "digest mismatch" in err and "__init__.py" in err, err
    assert not marker.exists()
