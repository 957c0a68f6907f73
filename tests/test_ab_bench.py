"""``tools/ab_bench.py`` without a GPU: its variant syntax, and a whole A/B on bench's tiny CPU
grid (two variants, two rounds, each its own bench process with its own environment)."""

from __future__ import annotations

import argparse
import csv
import subprocess
from pathlib import Path

import pytest

from tools import ab_bench


def test_variant_syntax():
    assert ab_bench.parse_variant("new=") == ("new", {})
    assert ab_bench.parse_variant("old=A=-inf,B=1") == ("old", {"A": "-inf", "B": "1"})
    for bad in ("old", "=A=1", "old=A", "old=A=1,=2"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab_bench.parse_variant(bad)


def test_ab_on_the_cpu_grid(flash_attn, tmp_path, capsys, monkeypatch):
    """Each (round, variant) gets its own page, made in a process that saw the variant's
    environment; the summary's medians and rounds come from those pages."""
    monkeypatch.setenv("FLASH_ATTN_HUB_GIT_SHA", "0123456789ab")
    out = tmp_path / "ab"
    kernel_dir = str(Path(flash_attn.__file__).parent)
    # the variant's environment reaches bench: FLASH_ATTN_HUB_GIT_SHA is recorded on its page
    status = ab_bench.main(["--variant", "base=", "--variant", "tagged=FLASH_ATTN_HUB_GIT_SHA=feedface0000",
                            "--rounds", "2", "--out", str(out), "--",
                            "--kernel-dir", kernel_dir, "--modes", "fwd", "--match", "s128-causal",
                            "--warmup-ms", "1", "--rep-ms", "2"])
    assert status == 0
    for rnd in (1, 2):
        base, _ = ab_bench.report.load(out / f"{rnd}-base")
        tagged, _ = ab_bench.report.load(out / f"{rnd}-tagged")
        assert base and tagged
        assert {r["git_sha"] for r in base} == {"0123456789ab"}
        assert {r["git_sha"] for r in tagged} == {"feedface0000"}
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows and all(row["mode"] == "fwd" for row in rows)
    for row in rows:
        rounds = [float(x) for x in row["base rounds"].split()]
        assert len(rounds) == 2 and float(row["base"]) == pytest.approx(sum(rounds) / 2, rel=1e-3)
    text = capsys.readouterr().out
    assert "tagged/base" in text and "[ab] round 2 tagged" in text


def test_ab_refuses_bench_into(tmp_path):
    with pytest.raises(SystemExit):
        ab_bench.main(["--variant", "a=", "--out", str(tmp_path), "--", "--into", "x"])


def test_kernel_dir_of_gives_a_variant_its_build(tmp_path, monkeypatch):
    """``--kernel-dir-of lab=DIR``: lab's bench processes get ``--kernel-dir DIR`` after bench's
    own arguments (argparse keeps the last), the other variant keeps bench's; a name that is
    no variant, or one given twice, is refused before anything runs."""
    commands = []

    def fake_run(cmd, env):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)  # stops the A/B after the first process

    monkeypatch.setattr(ab_bench.subprocess, "run", fake_run)
    common = ["--variant", "main=", "--variant", "lab=", "--out", str(tmp_path), "--rounds", "1"]
    bench = ["--", "--kernel-dir", "build", "--modes", "bwd"]
    for bad in (["--kernel-dir-of", "other=/x"], ["--kernel-dir-of", "lab=/x", "--kernel-dir-of", "lab=/y"],
                ["--kernel-dir-of", "lab="]):
        with pytest.raises(SystemExit):
            ab_bench.main(common + bad + bench)
    assert commands == []
    assert ab_bench.main(common[:2] + common[4:] + ["--kernel-dir-of", "main=/lab"] + bench) == 1
    assert commands[-1][-4:] == ["--modes", "bwd", "--kernel-dir", "/lab"]
    assert ab_bench.main(common + ["--kernel-dir-of", "lab=/lab"] + bench) == 1
    assert commands[-1][-2:] == ["--modes", "bwd"]  # main, run first, keeps bench's build
