"""The tile tables of the Triton kernels (`_triton/tuning.py`): buckets, lookup order, the shipped JSON
files, and the search of `python -m flash_attn_hub tune` (`flash_attn_hub/tune/common.py`).
No kernel runs."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from helpers import SOURCE_PACKAGE, source_package, submodule

from flash_attn_hub.tune import common as tc



@pytest.fixture(scope="module")
def tuning():
    return submodule(source_package(), "_triton.tuning")


@pytest.fixture(scope="module", params=["_triton.fwd", "_triton.bwd"])
def kernel_module(request):
    return submodule(source_package(), request.param)


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    tma: bool = False
    reason: str = ""


def test_buckets(tuning):
    assert [tuning.block_d_for(d) for d in (1, 8, 16, 17, 40, 64, 96, 128, 200, 256)] == \
        [16, 16, 16, 32, 64, 64, 128, 128, 256, 256]
    assert [tuning.seqlen_bucket(s) for s in (0, 1, 1024, 1025, 4096, 8192, 16384, 10 ** 6)] == \
        [1024, 1024, 1024, 4096, 4096, 16384, 16384, 16384]


def test_lookup_order(tuning, tmp_path):
    """Exact (gpu, block_d, bucket), then the nearest bucket of that GPU and block_d, then the
    in-code default of the arch; other GPUs' entries are never used (but a table's reference
    GPU's: test_lookup_falls_back_to_the_reference_gpu)."""
    path = tmp_path / "t.json"
    entries = [tuning.entry_of(Tiles(64, 32, True, "m1"), gpu="G", block_d=128, bucket=1024),
               tuning.entry_of(Tiles(128, 64, False, "m16"), gpu="G", block_d=128, bucket=16384)]
    tuning.write_entries(path, "forward", entries)
    defaults = {("sm90", 128): Tiles(16, 16, False, "default"),
                ("sm90", 64): Tiles(32, 32, False, "default64")}
    table = tuning.TileTable("forward", path, defaults, Tiles)
    assert table.lookup("sm90", "G", 128, 1024).reason == "m1"
    assert table.lookup("sm90", "G", 128, 16384).reason == "m16"
    assert table.lookup("sm90", "G", 128, 4096).reason == "m16"  # log-distance tie: longer
    assert table.lookup("sm90", "G", 64, 4096).reason == "default64"
    assert table.lookup("sm90", "other GPU", 128, 1024).reason == "default"
    assert table.lookup("sm90", "", 128, 1024).reason == "default"


def test_lookup_falls_back_to_the_reference_gpu(tuning, tmp_path):
    """In a table with a reference GPU for the arch, a GPU without entries of its own for a
    width takes the reference's, bucket by bucket (so a short sequence gets the reference's
    short-sequence row, not the one in-code row); its own entries, at any bucket, come first;
    other archs, and tables without a reference, keep their defaults."""
    path = tmp_path / "t.json"
    entries = [tuning.entry_of(Tiles(64, 32, True, "r1"), gpu="R", block_d=128, bucket=1024),
               tuning.entry_of(Tiles(128, 64, False, "r4"), gpu="R", block_d=128, bucket=4096),
               tuning.entry_of(Tiles(32, 32, False, "r64"), gpu="R", block_d=64, bucket=4096),
               tuning.entry_of(Tiles(128, 32, True, "own"), gpu="G", block_d=64, bucket=16384)]
    tuning.write_entries(path, "forward", entries)
    defaults = {(arch, d): Tiles(16, 16, False, f"default-{arch}")
                for arch in ("sm90", "sm80") for d in (64, 128, 256)}
    without = tuning.TileTable("forward", path, defaults, Tiles)
    assert without.lookup("sm90", "G", 128, 1024).reason == "default-sm90"
    table = tuning.TileTable("forward", path, defaults, Tiles, reference_gpus={"sm90": "R"})
    assert table.lookup("sm90", "G", 128, 1024).reason == "r1"
    assert table.lookup("sm90", "G", 128, 4096).reason == "r4"
    assert table.lookup("sm90", "G", 128, 16384).reason == "r4"  # the reference's nearest
    assert table.lookup("sm90", "G", 64, 1024).reason == "own"  # its own nearest first
    assert table.lookup("sm90", "other", 64, 1024).reason == "r64"
    assert table.lookup("sm90", "G", 256, 4096).reason == "default-sm90"
    assert table.lookup("sm80", "G", 128, 1024).reason == "default-sm80"
    assert table.lookup("sm80", "A100", 128, 1024).reason == "default-sm80"


def test_lookup_of_a_narrower_width(tuning, tmp_path):
    """A kernel running a head dim narrower than its padded bucket (the forward's split: D=192
    runs 192 columns) takes its width's entries first, then the padded bucket's, then the
    padded default."""
    path = tmp_path / "t.json"
    entries = [tuning.entry_of(Tiles(64, 32, True, "w192"), gpu="G", block_d=192, bucket=16384),
               tuning.entry_of(Tiles(128, 64, True, "p256"), gpu="G", block_d=256, bucket=4096)]
    tuning.write_entries(path, "forward", entries)
    defaults = {("sm90", 256): Tiles(16, 16, False, "default256")}
    table = tuning.TileTable("forward", path, defaults, Tiles)
    assert table.lookup("sm90", "G", 256, 16384, 192).reason == "w192"
    assert table.lookup("sm90", "G", 256, 4096, 192).reason == "w192"  # its nearest bucket
    assert table.lookup("sm90", "G", 256, 4096, 160).reason == "p256"  # 160: none of its own
    assert table.lookup("sm90", "G", 256, 4096).reason == "p256"
    assert table.lookup("sm90", "other GPU", 256, 4096, 192).reason == "default256"


def test_forward_tile_width(monkeypatch):
    """The forward keys its tiles by the width it runs: split (sm90+, the interpreter) or
    padded (``SPLIT_HEAD_DIM`` off, as on sm80)."""
    fwd = submodule(source_package(), "_triton.fwd")
    cpu = torch.device("cpu")
    assert [fwd.tile_width(d, cpu) for d in (192, 160, 136, 96, 128, 256)] == \
        [192, 160, 144, 128, 128, 256]
    assert fwd.split_tiles(192, cpu) == (128, 64, 64)
    monkeypatch.setattr(fwd, "SPLIT_HEAD_DIM", False)
    assert fwd.tile_width(192, cpu) == 256 and fwd.split_tiles(192, cpu) == (256, 0, 0)


def test_write_merges_and_parse_skips_unknown_fields(tuning, tmp_path):
    path = tmp_path / "t.json"
    tuning.write_entries(path, "backward", [
        tuning.entry_of(Tiles(64, 32), gpu="A", block_d=64, bucket=4096),
        tuning.entry_of(Tiles(64, 64), gpu="B", block_d=64, bucket=4096)])
    tuning.write_entries(path, "backward", [
        tuning.entry_of(Tiles(16, 16), gpu="A", block_d=64, bucket=4096)])
    raw = json.loads(path.read_text())
    assert raw["kernel"] == "backward" and len(raw["entries"]) == 2
    raw["entries"].append(dict(gpu="C", block_d=64, seqlen_bucket=4096, block_m=1, block_n=1,
                               future_field=3))
    raw["entries"].append(dict(gpu="D", block_d=64, block_m=1, block_n=1))  # no bucket
    del raw["entries"][0]["tma"]  # written before the field existed: its default
    parsed = tuning.parse_entries(raw, Tiles)
    assert set(parsed) == {("A", 64, 4096), ("B", 64, 4096)}
    assert parsed[("A", 64, 4096)] == Tiles(16, 16)


def test_shipped_tables_and_files(tuning, kernel_module):
    """Every (arch, BLOCK_D) the launcher can ask for has a default; the JSON beside the module
    parses, names this module's kernel and has only valid entries."""
    table = kernel_module.TABLE
    for arch in ("sm90", "sm80", "generic", "interpreter"):
        for block_d in tuning.HEAD_DIM_BUCKETS:
            config = table.defaults[(arch, block_d)]
            assert isinstance(config, table.config_type) and config.reason, (arch, block_d)
    assert table.path.parent == SOURCE_PACKAGE / "_triton" and table.path.suffix == ".json"
    if table.path.exists():
        raw = json.loads(table.path.read_text())
        assert raw["kernel"] == table.kernel
        assert len(tuning.parse_entries(raw, table.config_type)) == len(raw["entries"])
        # a padded bucket, or the width of a split head dim (the forward's 192)
        widths = {*tuning.HEAD_DIM_BUCKETS,
                  *(sum(tuning.head_dim_split(d)[::2]) for d in range(8, 257, 8))}
        for entry in raw["entries"]:
            assert entry["block_d"] in widths, entry
            assert entry["seqlen_bucket"] in tuning.SEQLEN_BUCKETS
            assert entry["reason"].startswith("measured"), entry


def test_cpu_call_uses_interpreter_tiles(kernel_module):
    table = kernel_module.TABLE
    assert kernel_module.tile_config(128, torch.device("cpu"), 4096) is \
        table.defaults[("interpreter", 128)]


def test_search_quick_and_exhaustive():
    space = dict(block_m=(16, 32, 64), block_n=(16, 32), tma=(False, True))
    best_at = Tiles(32, 32, True)
    calls = []

    def score(config):
        calls.append(config)
        if config.block_m == 64:
            return None  # does not compile
        return 10 - abs(config.block_m - 32) / 16 - abs(config.block_n - 32) / 16 \
            + config.tma

    base = Tiles(16, 16, False, "table")
    quick = tc.search(base, space, score, quick=True)
    assert dataclasses.replace(quick, reason="") == best_at and quick.reason == "table"
    # base, each field's other values (cached), then the second round's new neighbours of
    # (32, 32, True): block_m 16 and 64, block_n 16; it changes nothing, so the search stops
    assert len(calls) == 1 + 2 + 1 + 1 + 3
    calls.clear()
    full = tc.search(base, space, score, quick=False)
    assert dataclasses.replace(full, reason="") == best_at
    assert len(calls) == 3 * 2 * 2  # base is one of the combinations
    assert tc.search(base, dict(block_m=(64,)), lambda c: None, quick=False) is base


def test_search_quick_tries_coupled_pairs():
    """A joint optimum that no single-field move reaches from the base (each field alone loses)
    is found by the coupled-pair pass, and only named pairs of fields in the space are tried."""
    space = dict(block_m=(16, 32), block_n=(16, 32), tma=(False, True))

    def score(config):  # (32, 32) best; (32, 16) and (16, 32) worse than the base (16, 16)
        table = {(16, 16): 5, (32, 16): 4, (16, 32): 4, (32, 32): 9}
        return table[(config.block_m, config.block_n)] + 0.5 * config.tma

    base = Tiles(16, 16, False, "table")
    plain = tc.search(base, space, score, quick=True)
    assert (plain.block_m, plain.block_n, plain.tma) == (16, 16, True)
    paired = tc.search(base, space, score, quick=True, pairs=(("block_m", "block_n"),))
    assert (paired.block_m, paired.block_n, paired.tma) == (32, 32, True)
    narrowed = tc.search(base, dict(block_m=(16, 32)), score, quick=True,
                         pairs=(("block_m", "block_n"),))
    assert (narrowed.block_m, narrowed.block_n) == (16, 16)  # block_n is not in the space


def test_search_quick_revisits_a_field_settled_early():
    """A field that lost at the base's other values wins once a later field has moved: the
    quick search's next round tries it again (the D=192 forward's descriptors, settled at 2
    stages and never timed at 3)."""
    space = dict(tma=(False, True), block_n=(16, 32))

    def score(config):  # tma helps only with 32-key tiles
        return {(False, 16): 5, (True, 16): 4, (False, 32): 6, (True, 32): 8}[
            (config.tma, config.block_n)]

    best = tc.search(Tiles(16, 16, False, "table"), space, score, quick=True)
    assert (best.tma, best.block_n) == (True, 32)
    rounds = []
    one = tc.search(Tiles(16, 16, False), space, lambda c: rounds.append(c) or 1.0, quick=True)
    assert one.block_n == 16 and len(rounds) == 3  # nothing moved: one round only


def test_head_shape_problems_label_and_count_each_shape():
    """Both kernels score a config over every head shape: full and causal of each, 16k tokens
    per batch, FLOPs by the benchmark's rule (causal halved, backward 2.5x), labels naming the
    heads only when there are several shapes."""
    built = []

    def problem(heads, causal):
        built.append((heads, causal))
        return type("P", (), {"run": lambda self, config: None})()

    both = tc.head_shape_problems([(16, 16), (32, 8)], problem, seqlen=4096, head_dim=128, mode="bwd")
    assert [p.label for p in both] == ["16/16 full", "16/16 causal", "32/8 full", "32/8 causal"]
    full = 4 * 4 * 4096 * 4096 * 128  # B=4 at S=4096
    assert [p.flops for p in both] == [2.5 * 16 * full, 2.5 * 8 * full, 2.5 * 32 * full, 2.5 * 16 * full]
    assert [p.workload for p in both] == [tc.tuning_workload(4, 4096, h, 128, c) for h, c in built]
    assert both[2].shape == dict(head_dim=128, heads=[32, 8], batch=4, seqlen=4096)
    one = tc.head_shape_problems([(8, 8)], problem, seqlen=16384, head_dim=64, mode="fwd")
    assert [p.label for p in one] == ["full", "causal"] and one[0].workload.batch == 1


def test_command_line_and_where_tuned_tables_go(tmp_path):
    import argparse
    from flash_attn_hub.tune import bwd

    parser = argparse.ArgumentParser()
    tc.add_arguments(parser, sorted(bwd.HEADS))
    args = tc.finish_arguments(parser.parse_args(["--quick", "--space", "atomic_dq=0,1", "--heads", "32/8"]),
                               sorted(bwd.HEADS))
    assert (args.head_dims, args.seqlens, args.space, args.heads) == ([128], [4096], {"atomic_dq": (0, 1)}, [(32, 8)])
    assert tc.finish_arguments(parser.parse_args([]), [64, 128]).seqlens == [1024, 4096, 16384]
    for bad in (["--space", "atomic_dq"], ["--space", "atomic_dq=yes"], ["--heads", "32/5"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    # a table of a loaded build is written back to the source tree, which the next build ships
    package = type(sys)("built")
    package.__file__ = str(tmp_path / "torch-cuda" / "__init__.py")
    assert tc.source_path(package, tmp_path / "torch-cuda" / "triton_bwd_configs.json") == \
        SOURCE_PACKAGE / "triton_bwd_configs.json"
