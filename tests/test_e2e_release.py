"""``release`` on a machine with no GPU and no network: build -> check -> publish to the
embedded Hub it starts itself -> verify through kernels and transformers in a fresh process."""

from __future__ import annotations

import pytest

from flash_attn_hub import cli


def test_release_from_scratch(tmp_path, monkeypatch, capfd):
    pytest.importorskip("flash_attn_hub.build", reason="the build tool is not written yet")
    check = pytest.importorskip("flash_attn_hub.check", reason="the check tool is not written yet")
    if not hasattr(check, "check_variant"):
        pytest.skip("flash_attn_hub.check.check_variant is not written yet")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the default data dir, kept across runs
    code = cli.main(["release", "--build-dir", str(tmp_path / "build"), "--allow-dirty"])
    out = capfd.readouterr().out
    assert code == 0, out
    for stage in ("[1/4] build", "[2/4] check", "[3/4] publish", "[4/4] verify"):
        assert stage in out
    assert "kernels + transformers loaded v" in out
    data = tmp_path / "cache" / "flash-attn-hub" / "hub"
    assert (data / "repos" / "kernels" / "flash-attn-hub" / "flash-attn.git").is_dir()
    assert f"hub serve --data {data}" in out
    assert 'get_kernel("flash-attn-hub/flash-attn", version=' in out
    assert 'attn_implementation="flash-attn-hub/flash-attn@v' in out
