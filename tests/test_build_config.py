"""build.toml: our edition-5 validation accepts the real file and rejects what kernel-builder's
parser rejects; kernels' own parser (``kernels._rust.Build.open``) is the cross-check."""

from __future__ import annotations

import re

import pytest

from flash_attn_hub import REPO_ROOT, build_config

pytestmark = pytest.mark.kernels_ci

BUILD_TOML = (REPO_ROOT / "build.toml").read_text()


def _kernels_accepts(tmp_path, text: str) -> bool:
    from kernels._rust import Build

    (tmp_path / "build.toml").write_text(text)
    try:
        Build.open(tmp_path)
    except ValueError:
        return False
    return True


def test_real_build_toml_is_valid(tmp_path):
    config = build_config.load()
    assert config.name == "flash-attn" and config.python_name == "flash_attn"
    assert config.version == 3
    assert config.license == "BSD-3-Clause"
    assert config.backends == ("cpu", "cuda")
    assert config.repo_id == "flash-attn-hub/flash-attn"
    assert config.framework == "torch"
    assert config.pyext == ("py", "json")
    assert config.stable_abi == {"cuda": "2.11"}
    (cuda,) = config.kernels_for("cuda")
    assert cuda.name == "flash_attn_cuda"
    assert cuda.depends == ("torch", "cutlass_4_0")
    assert cuda.cuda_capabilities == ("8.0", "9.0a")
    assert _kernels_accepts(tmp_path, BUILD_TOML)


def test_every_src_file_exists():
    config = build_config.load()
    assert config.source_files(), "build.toml lists no sources"
    assert build_config.missing_sources(config) == []
    assert any(s.endswith(".cu") for s in config.source_files())


def _drop_src_of_kernel(text: str) -> str:
    head, tail = text.split("[kernel.flash_attn_cuda]")
    return head + "[kernel.flash_attn_cuda]" + re.sub(r"^src\s*=\s*\[.*?\]\n", "", tail,
                                                       count=1, flags=re.M | re.S)


MUTATIONS = {
    "unknown key in general": (
        lambda t: t.replace("edition = 5", "edition = 5\ncolor = 1"), "general.color"),
    "missing license": (
        lambda t: re.sub(r"^license = .*\n", "", t, flags=re.M), "general.license"),
    "unknown key in torch": (
        lambda t: t.replace('pyext = ["py", "json"]', 'pyext = ["py", "json"]\nsources = []'),
        "torch.sources"),
    "unknown key in kernel": (
        lambda t: t.replace('backend = "cuda"', 'backend = "cuda"\narchs = ["sm90"]'),
        "kernel.flash_attn_cuda.archs"),
    "unknown key in general.hub": (
        lambda t: t.replace("repo-id =", 'repo = "x"\nrepo-id ='), "general.hub.repo"),
    "unknown top-level section": (lambda t: t + "\n[extra]\nx = 1\n", "extra"),
    "two framework sections": (lambda t: t + '\n[torch-noarch]\npyext = ["py"]\n', "framework"),
    "no framework section": (
        lambda t: re.sub(r"^\[torch\].*?(?=^\[kernel)", "", t, flags=re.M | re.S), "framework"),
    "wrong edition": (lambda t: t.replace("edition = 5", "edition = 4"), "general.edition"),
    "unknown dependency": (lambda t: t.replace('"cutlass_4_0"', '"cutlass_4"'),
                           "kernel.flash_attn_cuda.depends"),
    "unknown backend": (lambda t: t.replace('backends = ["cpu", "cuda"]', 'backends = ["cpu", "gpu"]'),
                        "general.backends"),
    "kernel without src": (_drop_src_of_kernel, "kernel.flash_attn_cuda.src"),
    "version not an integer": (lambda t: t.replace("version = 3", 'version = "3"'), "general.version"),
    "bad kernel name": (lambda t: t.replace('name = "flash-attn"', 'name = "Flash_Attn"'), "general.name"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_mutated_build_toml_is_rejected(tmp_path, mutation):
    mutate, key = MUTATIONS[mutation]
    text = mutate(BUILD_TOML)
    assert text != BUILD_TOML, "the mutation did not apply: update the test to build.toml"
    with pytest.raises(build_config.BuildConfigError) as info:
        build_config.parse(text, tmp_path / "build.toml")
    assert any(p.startswith(key) for p in info.value.problems), info.value.problems
    assert key in str(info.value)
    assert not _kernels_accepts(tmp_path, text), f"kernels accepts the {mutation!r} mutation"


def test_all_problems_are_reported_at_once(tmp_path):
    text = re.sub(r"^license = .*\n", "", BUILD_TOML, flags=re.M) + "\n[extra]\nx = 1\n"
    with pytest.raises(build_config.BuildConfigError) as info:
        build_config.parse(text, tmp_path / "build.toml")
    assert {p.split(":")[0] for p in info.value.problems} >= {"general.license", "extra"}


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(build_config.BuildConfigError, match="file not found"):
        build_config.load(tmp_path / "build.toml")


def test_missing_sources_are_listed(tmp_path):
    config = build_config.parse(BUILD_TOML.replace("csrc/flash_params.h", "csrc/nope.h"),
                                tmp_path / "build.toml")
    assert "csrc/nope.h" in build_config.missing_sources(config)
