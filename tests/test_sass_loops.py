"""``tools/sass_loops.py`` on SASS text written here (no GPU, no cuobjdump): loops are found by
their conditional back edge, counted over their span, and the out-of-line returns are not loops."""

from __future__ import annotations

from tools import sass_loops


def _sass(functions: dict[str, list[str]]) -> str:
    """``cuobjdump -sass``-shaped text: a header per function, one instruction per 16 bytes."""
    out = ["\tcode for sm_90a"]
    for name, body in functions.items():
        out.append(f"\t\tFunction : {name}")
        out.append("\t.headerflags\t@\"EF_CUDA_SM90\"")
        for i, text in enumerate(body):
            out.append(f"        /*{16 * i:04x}*/                   {text} ;"
                       f"                   /* 0x000000000000000000 */")
    return "\n".join(out) + "\n"


LOOPED = [
    "MOV R1, c[0x0][0x28]",                   # 0x00
    "S2R R0, SR_TID.X",                       # 0x10
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2",  # 0x20: the loop starts here
    "@!P0 BRA 0xc0",                          # 0x30: to the out-of-line retry
    "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT",  # 0x40
    "BSSY B1, 0x70",                          # 0x50
    "@P1 BRA P2, 0x70",                       # 0x60
    "STL [R1], R3",                           # 0x70
    "MUFU.EX2 R4, R5",                        # 0x80
    "@P3 BRA 0x20",                           # 0x90: the back edge
    "EXIT",                                   # 0xa0
    "BRA 0xb0",                               # 0xb0: the trap loop after EXIT (unconditional)
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2",  # 0xc0: out of line
    "BRA 0x40",                               # 0xd0: back into the loop (unconditional)
]
STRAIGHT = ["MOV R1, c[0x0][0x28]", "EXIT", "BRA 0x20"]


def test_loops_by_their_conditional_back_edge():
    kernels = sass_loops.parse(_sass({"_Z6loopedv": LOOPED, "_Z8straightv": STRAIGHT}), min_loop=2)
    looped, straight = kernels
    assert looped.name == "_Z6loopedv" and len(looped.instructions) == len(LOOPED)
    (loop,) = looped.loops
    assert (loop.start, loop.end, loop.length) == (0x20, 0x90, 8)
    assert {op: loop.counts[op] for op in sass_loops.FLAGGED} == {
        "BSSY": 1, "BRA": 3, "STL": 1, "LDL": 0, "HGMMA": 1, "MUFU": 1, "BAR": 0}
    assert straight.loops == []
    # a loop shorter than min_loop is left out
    assert sass_loops.parse(_sass({"_Z6loopedv": LOOPED}), min_loop=9)[0].loops == []


def test_main_filters_kernels(tmp_path, capsys):
    path = tmp_path / "k.sass"
    path.write_text(_sass({"_Z6loopedv": LOOPED, "_Z8straightv": STRAIGHT}))
    assert sass_loops.main([str(path), "--kernel", "looped", "--min-loop", "2"]) == 0
    out = capsys.readouterr().out
    assert "looped" in out and "straight" not in out
    assert "loop 0x0020..0x0090:     8 instructions  BSSY 1  BRA 3  STL 1" in out
    assert sass_loops.main([str(path), "--kernel", "absent"]) == 1
    assert "no kernel" in capsys.readouterr().err
