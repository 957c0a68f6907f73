"""Generates the sm90 forward's per-instantiation sources from ONE table.

The TILES and BWD_TILES tables below are the single source of truth for the compiled head dims
and their tiles.
From it this script writes:

* ``csrc/hopper/tile_sizes.h``          the C++ tile table (with the reasons as comments);
* ``csrc/hopper/head_dims.h``           the head-dim list the dispatcher walks;
* ``csrc/hopper/bwd_tile_sizes.h`` and ``bwd_head_dims.h``: the same for the backward (BWD_TILES);
* ``csrc/hopper/instantiations/*.cu``   one file per (direction, dtype, head dim), so builds
  parallelise;
* the generated block of ``torch-ext/flash_attn/_heuristics.py`` (the Python capability tables);
* the ``src`` list of ``[kernel.flash_attn_cuda]`` in ``build.toml`` (when that section exists).

Run ``python csrc/hopper/generate.py`` after editing TILES; ``--check`` exits 1 when any
generated file is stale (for CI); ``--print-src`` prints the build.toml src list.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# head dim: (kBlockM, kBlockM under a band, kBlockM under a long causal band, kBlockN, kBlockN
# under a band, kStages, reason).
# The band columns serve causal and sliding windows (kWindow): a smaller tile there wastes less
# on the masked diagonal. The long-band column serves bands without a left bound over at least
# kLongBandMinRows queries ([Note] Long bands in fwd_launch.h); where it equals the band column
# nothing more is compiled. kBlockM is 64 rows per consumer warpgroup ([Note] Consumer warpgroups
# in kernel_traits.h). Where no measurement of our own exists yet the choice follows FlashAttention-3's
# published sm90 tile table (H100, same SM as the H200) and says so.
TILES = {
    64: (192, 128, 192, 128, 128, 2, "full: M=192, three consumer warpgroups, so a step's softmax hides "
                                "under two consumers' GEMMs (at M=128 the tensor pipe and the "
                                "exp2 unit each ran 43% busy, ncu, 4k; M=192: 414 -> 470 "
                                "TFLOP/s at 4k, 366 -> 393 at 1k); 2 stages x (K+V) 16 KB + "
                                "Q 24 KB = 88 KB. band: M=128 (M=192 lost 13% at 1k causal, "
                                "283 -> 245, to the wider masked diagonal and the 1k/192 "
                                "remainder tile); long band (no left bound, >= 4096 queries): "
                                "M=192, causal +4/+8/+13% at 4k/8k/16k, -5% at 2k."),
    96: (128, 128, 128, 128, 128, 2, "2 stages x (K+V) 24 KB + Q 24 KB = 120 KB; 64-byte swizzle (96 "
                                "columns = 3 x 32)."),
    128: (128, 128, 128, 176, 128, 2, "full: N=176, 2 stages x (K+V) 44 KB + Q 32 KB = 208 KB, S/P/O "
                                 "88 + 44 + 64 registers, fewer softmax rounds per key (FA3's "
                                 "choice); band: N=128, 160 KB."),
    192: (128, 128, 128, 112, 112, 2, "N=112: 2 stages x (K+V) 42 KB + Q 48 KB = 216 KB (FA3's choice; "
                                 "was 96)."),
    256: (128, 128, 128, 80, 80, 2, "N=80: 2 stages x (K+V) 40 KB + Q 64 KB = 224 KB, the most that fits; "
                               "O accumulator alone is 128 registers (FA3's choice; was 64)."),
}
# backward head dim: (kBlockM query rows per step, kBlockM with softcap, kBlockN keys per CTA,
# kStages, reason)
BWD_TILES = {
    64: (128, 64, 128, 2, "M=128 ([Note] dQ by query rows in bwd_traits.h): K+V 32 KB + 2 stages "
                          "x (Q+dO) 32 KB + dS 32 KB + dQ 32 KB = 160 KB; registers S^T + dP^T + "
                          "dK + dV = 64 + 64 + 32 + 32 per thread, K and V read from shared memory. "
                          "Softcap keeps M=64 (96 KB, K and V in registers): its factor 1 - t^2 "
                          "is another 32 registers (fp16 pairs), and at M=128 ptxas spilled "
                          "64-112 bytes, 12-20 stores of them inside the step loop."),
    96: (64, 64, 128, 2, "K+V 48 KB + 2 stages x (Q+dO) 24 KB + dS 16 KB + dQ 24 KB = 136 KB; 32-byte "
                     "swizzle (48 dQ columns per consumer = 3 chunks)."),
    128: (64, 64, 128, 2, "K+V 64 KB + 2 stages x (Q+dO) 32 KB + dS 16 KB + dQ 32 KB = 176 KB; "
                      "registers dK + dV + dQ half = 64 + 64 + 32 per thread."),
    # [Note] Backward head-dim split (bwd_traits.h): above D=128 both consumers share 64 keys
    192: (64, 64, 64, 2, "head-dim split: K+V 48 KB + 2 stages x (Q+dO) 48 KB + dS 8 KB = 152 KB, no "
                     "dQ tile; registers dK + dV + dQ halves = 48 + 48 + 48 per thread."),
    256: (64, 64, 64, 2, "head-dim split: K+V 64 KB + 2 stages x (Q+dO) 64 KB + dS 8 KB = 200 KB (a "
                     "64 KB dQ tile would not fit); registers dK + dV + dQ halves = 64 + 64 + 64."),
}
DTYPES = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t"}
FEATURES = [(False, False), (False, True), (True, False), (True, True)]  # (window, softcap)

BANNER = ("// GENERATED by csrc/hopper/generate.py from its TILES table; edit the table there, then run\n"
          "// `python csrc/hopper/generate.py`.\n")


def _tile_table_h(struct: str, doc: str, rows: list[tuple[int, dict[str, int], str]]) -> str:
    """A generated C++ tile table: one ``struct<head dim>`` of constants per row, its reason as
    the comment above it."""
    entries = []
    for d, fields, why in rows:
        comment = "\n".join(textwrap.wrap(why, 97, initial_indent="// ", subsequent_indent="// "))
        values = ", ".join(f"{name} = {value}" for name, value in fields.items())
        decl = "\n".join(textwrap.wrap(f"static constexpr int {values};", 97, initial_indent="  ",
                                       subsequent_indent=" " * 23))
        entries.append(f"{comment}\ntemplate <> struct {struct}<{d}> {{\n{decl}\n}};")
    doc = "\n".join(textwrap.wrap(doc, 97, initial_indent="// ", subsequent_indent="// "))
    return (BANNER + f"//\n{doc}\n#pragma once\n\nnamespace flash::hopper {{\n\n"
            f"template <int kHeadDim>\nstruct {struct};\n\n" + "\n".join(entries)
            + "\n\n}  // namespace flash::hopper\n")


def tile_sizes_h() -> str:
    rows = [(d, dict(kBlockM=m, kBlockMBand=m_band, kBlockMLongBand=m_long, kBlockN=n,
                     kBlockNBand=n_band, kStages=stages), why)
            for d, (m, m_band, m_long, n, n_band, stages, why) in TILES.items()]
    return _tile_table_h("TileSize", "One row per compiled head dim: kBlockM query rows per CTA, "
                         "kBlockN keys per pipeline stage (kBlockMBand, kBlockNBand under a causal "
                         "or sliding-window band; kBlockMLongBand under a long band without a left "
                         "bound), kStages pipeline depth, and why.", rows)


def head_dims_h() -> str:
    items = " ".join(f"X({d})" for d in TILES)
    return (BANNER + "// Compiled head dims in increasing order; an input of head dim d runs on the "
            "first entry >= d.\n#pragma once\n\n#define FLASH_HOPPER_FOR_EACH_HEAD_DIM(X) " + items + "\n")


def bwd_tile_sizes_h() -> str:
    rows = [(d, dict(kBlockM=m, kBlockMSoftcap=m_softcap, kBlockN=n, kStages=stages), why)
            for d, (m, m_softcap, n, stages, why) in BWD_TILES.items()]
    return _tile_table_h("BwdTileSize", "One row per compiled backward head dim: kBlockM query rows "
                         "per step (kBlockMSoftcap with softcap), kBlockN keys per CTA, kStages "
                         "pipeline depth, and why.", rows)


def bwd_head_dims_h() -> str:
    items = " ".join(f"X({d})" for d in BWD_TILES)
    return (BANNER + "// Compiled backward head dims in increasing order; an input of head dim d runs "
            "on the first entry >= d.\n#pragma once\n\n#define FLASH_HOPPER_FOR_EACH_BWD_HEAD_DIM(X) "
            + items + "\n")


def bwd_instantiation_cu(dtype: str, d: int) -> str:
    element = DTYPES[dtype]
    lines = [f"template FwdStatus run_bwd<{element}, {d}, {str(w).lower()}, {str(c).lower()}>(\n"
             f"    const FlashBwdParams&, cudaStream_t, char*, int);" for w, c in FEATURES]
    return (BANNER + f"// sm90 backward, {dtype}, head dim {d}: every (window, softcap) variant.\n"
            '#include "../bwd_launch.h"\n\nnamespace flash::hopper {\n\n' + "\n".join(lines)
            + "\n\n}  // namespace flash::hopper\n")


def instantiation_cu(dtype: str, d: int) -> str:
    element = DTYPES[dtype]
    lines = [f"template FwdStatus run_fwd<{element}, {d}, {str(w).lower()}, {str(c).lower()}>(\n"
             f"    const FlashParams&, cudaStream_t, char*, int);" for w, c in FEATURES]
    return (BANNER + f"// sm90 forward, {dtype}, head dim {d}: every (window, softcap) variant.\n"
            '#include "../fwd_launch.h"\n\nnamespace flash::hopper {\n\n' + "\n".join(lines)
            + "\n\n}  // namespace flash::hopper\n")


def instantiation_name(dtype: str, d: int, direction: str = "fwd") -> str:
    return f"{direction}_{dtype}_d{d}.cu"


def src_list() -> list[str]:
    headers = ["csrc/flash_params.h"] + sorted(
        f"csrc/hopper/{p.name}" for p in HERE.glob("*.h"))
    sources = ["csrc/hopper/fwd_dispatch.cu", "csrc/hopper/bwd_dispatch.cu"] + [
        f"csrc/hopper/instantiations/{instantiation_name(t, d)}" for t in DTYPES for d in TILES] + [
        f"csrc/hopper/instantiations/{instantiation_name(t, d, 'bwd')}" for t in DTYPES
        for d in BWD_TILES]
    return headers + sources


PY_BEGIN = "# BEGIN GENERATED by csrc/hopper/generate.py (TILES)"
PY_END = "# END GENERATED"


def heuristics_py_block() -> str:
    dims = ", ".join(str(d) for d in TILES)
    bwd_dims = ", ".join(str(d) for d in BWD_TILES)
    keys = ", ".join(f"{d}: {n}" for d, (_, _, n, _, _) in BWD_TILES.items())
    return (f"{PY_BEGIN}\n_COMPILED_HEAD_DIMS = ({dims})\n_COMPILED_BWD_HEAD_DIMS = ({bwd_dims})\n"
            f"_BWD_KEYS_PER_CTA = {{{keys}}}\n{PY_END}")


def updated_heuristics_py(text: str) -> str:
    pattern = re.compile(re.escape(PY_BEGIN) + r".*?" + re.escape(PY_END), re.S)
    if not pattern.search(text):
        raise SystemExit("_heuristics.py lacks the generated block markers")
    return pattern.sub(heuristics_py_block(), text)


def updated_build_toml(text: str) -> str | None:
    """Replaces the src list of [kernel.flash_attn_cuda]; None when the section is absent."""
    section = re.search(r"^\[kernel\.flash_attn_cuda\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if section is None:
        return None
    body = section.group(1)
    listing = "src = [\n" + "".join(f'  "{s}",\n' for s in src_list()) + "]"
    new_body, count = re.subn(r"^src\s*=\s*\[.*?\]", listing, body, count=1, flags=re.M | re.S)
    if count == 0:
        new_body = body.rstrip("\n") + "\n" + listing + "\n\n"
    return text[:section.start(1)] + new_body + text[section.end(1):]


def outputs() -> dict[Path, str]:
    files = {HERE / "tile_sizes.h": tile_sizes_h(), HERE / "head_dims.h": head_dims_h(),
             HERE / "bwd_tile_sizes.h": bwd_tile_sizes_h(), HERE / "bwd_head_dims.h": bwd_head_dims_h()}
    for t in DTYPES:
        for d in TILES:
            files[HERE / "instantiations" / instantiation_name(t, d)] = instantiation_cu(t, d)
        for d in BWD_TILES:
            files[HERE / "instantiations" / instantiation_name(t, d, "bwd")] = bwd_instantiation_cu(t, d)
    heuristics_py = ROOT / "torch-ext" / "flash_attn" / "_heuristics.py"
    if heuristics_py.exists():
        files[heuristics_py] = updated_heuristics_py(heuristics_py.read_text())
    toml = ROOT / "build.toml"
    if toml.exists():
        new = updated_build_toml(toml.read_text())
        if new is not None:
            files[toml] = new
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale")
    parser.add_argument("--print-src", action="store_true", help="print the build.toml src list")
    args = parser.parse_args(argv)
    if args.print_src:
        print("\n".join(src_list()))
        return 0
    stale = []
    for path, text in outputs().items():
        if not path.exists() or path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    for path in stale:
        print(("stale: " if args.check else "wrote: ") + str(path.relative_to(ROOT)))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
