"""``tools/gpu_run.sh`` without a GPU: the bench phase with a stand-in for ``python3`` (so the
shell logic is what is tested): the command it runs, the page it archives for the trip back,
the logs archived, and an unknown phase failing the call; the setup phase taking FlashInfer's
two carried halves over two calls."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile

import pytest

from flash_attn_hub import REPO_ROOT

# Stands in for python3: records its arguments; `-m flash_attn_hub bench --into DIR` writes a page.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >>"$CALLS"
if [[ $1 == -m && $2 == flash_attn_hub && $3 == bench && $4 == --into ]]; then
  mkdir -p "$5/plots" && echo provider >"$5/results.csv" && echo "# page" >"$5/RESULTS.md"
  : >"$5/plots/main-d256.png"
elif [[ $1 == -m && $2 == tools.ab_bench && $3 == --out ]]; then
  mkdir -p "$4/1-old" && echo workload >"$4/summary.csv"
fi
"""


def _fake_python(tmp_path, script: str):
    """A folder holding ``script`` as ``python3``, to put first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(script)
    (bin_dir / "python3").chmod(0o755)
    return bin_dir


def test_bench_phase_archives_the_page_and_the_logs(tmp_path):
    bin_dir = _fake_python(tmp_path, FAKE_PYTHON)
    out, page, calls = tmp_path / "out", tmp_path / "page", tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "BENCH_PAGE": str(page),
           "CALLS": str(calls), "BENCH_ARGS": "--head-dims 256 --append"}
    done = subprocess.run(["bash", str(REPO_ROOT / "tools" / "gpu_run.sh"), "bench", "nope"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "unknown phase nope" in done.stdout  # the call fails, the bench stays
    assert calls.read_text().splitlines() == [
        f"-m flash_attn_hub bench --into {page} --kernel-dir build --no-progress --head-dims 256 --append"]
    with tarfile.open(out / "bench.tgz") as tar:
        assert {name.removeprefix("./") for name in tar.getnames()} >= {"RESULTS.md", "results.csv",
                                                                       "plots/main-d256.png"}
    with tarfile.open(out / "logs.tgz") as tar:
        assert tar.getnames() == ["bench.log"]
    assert sorted(p.name for p in out.iterdir()) == ["bench.tgz", "logs.tgz"]


def test_ab_phase_passes_its_arguments_and_archives_the_pages(tmp_path):
    bin_dir = _fake_python(tmp_path, FAKE_PYTHON)
    out, calls = tmp_path / "out", tmp_path / "calls"
    args = "--variant old=FAH_X=0 --variant new= -- --grid main --modes bwd"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
           "CALLS": str(calls), "AB_ARGS": args}
    done = subprocess.run(["bash", str(REPO_ROOT / "tools" / "gpu_run.sh"), "ab"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls.read_text().splitlines() == [f"-m tools.ab_bench --out /tmp/ab {args}"]
    with tarfile.open(out / "ab.tgz") as tar:
        assert {"ab/summary.csv", "ab/1-old"} <= set(tar.getnames())
    assert sorted(p.name for p in out.iterdir()) == ["ab.tgz", "logs.tgz"]


def test_page_phase_runs_the_release_commands_with_resume_and_stops_out_of_time(tmp_path):
    bin_dir = _fake_python(tmp_path, FAKE_PYTHON)
    out, page, calls = tmp_path / "out", tmp_path / "page", tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "BENCH_PAGE": str(page),
           "CALLS": str(calls)}
    script = str(REPO_ROOT / "tools" / "gpu_run.sh")
    done = subprocess.run(["bash", script, "page"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = calls.read_text().splitlines()
    prefix = f"-m flash_attn_hub bench --into {page} --kernel-dir build --no-progress --resume "
    assert [line.removeprefix(prefix).split(" --providers")[0] for line in lines] == [
        "--head-dims 128", "--head-dims 64", "--head-dims 256", "--grid softcap"]
    assert all(line.startswith(prefix) and "fa4" in line for line in lines)
    assert "page: complete, all 4 steps" in done.stdout
    with tarfile.open(out / "bench.tgz") as tar:
        assert "./results.csv" in tar.getnames()
    calls.unlink()
    # no time left (PAGE_UNTIL already passed): nothing runs and the call says so
    done = subprocess.run(["bash", script, "page"], env={**env, "PAGE_UNTIL": "10"}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and "page: no time left for step 0" in done.stdout
    assert "page: 0 of 4 steps done; the page phase again goes on from there" in done.stdout
    assert not calls.exists()


# Stands in for python3 in the build phase: the build reports whether the carried object is in
# the cache, adds one of its own and prints the variant path last; check passes.
FAKE_BUILD_PYTHON = """#!/usr/bin/env bash
if [[ $1 == -m && $2 == flash_attn_hub && $3 == build ]]; then
  [[ -f $FLASH_ATTN_HUB_CACHE/obj/carried/obj.o ]] && echo "carried object found" >>"$CALLS"
  mkdir -p "$FLASH_ATTN_HUB_CACHE/obj/built" && : >"$FLASH_ATTN_HUB_CACHE/obj/built/obj.o"
  echo "$VARIANT"
elif [[ $1 == -m && $2 == flash_attn_hub && $3 == check ]]; then
  echo "check $4" >>"$CALLS"
fi
"""


def test_build_phase_reuses_carried_objects_and_sends_them_back(tmp_path):
    bin_dir = _fake_python(tmp_path, FAKE_BUILD_PYTHON)
    carried = tmp_path / "carried" / "obj" / "carried"
    carried.mkdir(parents=True)
    (carried / "obj.o").write_text("")
    archive = tmp_path / "cuda-objects-in.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "carried" / "obj", arcname="obj")
    out, cache, calls = tmp_path / "out", tmp_path / "cache", tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
           "CALLS": str(calls), "FLASH_ATTN_HUB_CACHE": str(cache), "CUDA_OBJECTS": str(archive),
           "VARIANT": str(tmp_path / "variant")}
    done = subprocess.run(["bash", str(REPO_ROOT / "tools" / "gpu_run.sh"), "build"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls.read_text().splitlines() == ["carried object found", f"check {tmp_path / 'variant'}"]
    with tarfile.open(out / "cuda-objects.tgz") as tar:
        assert {"obj/carried/obj.o", "obj/built/obj.o"} <= set(tar.getnames())


# Stands in for python3 and nvidia-smi in the setup phase: records the PYTHONPATH that the
# version line of FlashInfer sees. The stand-in install.sh records its arguments and installs.
FAKE_SETUP_PYTHON = """#!/usr/bin/env bash
[[ $* == *flashinfer* ]] && echo "flashinfer PYTHONPATH=$PYTHONPATH PATH=${PATH%%:*}" >>"$CALLS"
exit 0
"""
FAKE_INSTALL = """#!/usr/bin/env bash
echo "install $*" >>"$CALLS"
mkdir -p "$1/flashinfer"
"""


def test_setup_takes_flashinfer_in_two_calls(tmp_path):
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "tools" / "gpu_run.sh", repo / "tools" / "gpu_run.sh")
    bin_dir.mkdir()
    for name, text in (("python3", FAKE_SETUP_PYTHON), ("nvidia-smi", "#!/usr/bin/env bash\necho gpu\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    half, site, calls = tmp_path / "half", tmp_path / "fisite", tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "CALLS": str(calls), "FLASHINFER_HALF_DIR": str(half), "FLASHINFER_SITE": str(site)}
    env.pop("PYTHONPATH", None)

    def setup():
        done = subprocess.run(["bash", str(repo / "tools" / "gpu_run.sh"), "setup"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return calls.read_text().splitlines() if calls.exists() else []

    (repo / ".flashinfer" / "a").mkdir(parents=True)
    (repo / ".flashinfer" / "a" / "part.00").write_text("first half")
    assert [line for line in setup() if line.startswith("install")] == []  # call 1: the half stays behind
    assert (half / "part.00").read_text() == "first half"
    shutil.rmtree(repo / ".flashinfer" / "a")
    (repo / ".flashinfer" / "b").mkdir()
    (repo / ".flashinfer" / "b" / "install.sh").write_text(FAKE_INSTALL)
    lines = setup()  # call 2: both halves, installed once and put on the paths
    assert f"install {site} {half}" in lines
    assert lines[-1] == f"flashinfer PYTHONPATH={site} PATH={site}/bin"
    setup()  # a third call on the same machine does not install again
    assert sum(line.startswith("install") for line in calls.read_text().splitlines()) == 1


@pytest.mark.skipif(shutil.which("xz") is None, reason="tar -J needs xz")
def test_setup_unpacks_carried_cutlass_headers_once(tmp_path):
    repo, inc = tmp_path / "repo", tmp_path / "site" / "include"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "tools" / "gpu_run.sh", repo / "tools" / "gpu_run.sh")
    headers = tmp_path / "headers"
    (headers / "cute").mkdir(parents=True)
    (headers / "cute" / "tensor.hpp").write_text("// cute\n")
    (repo / ".whl").mkdir()
    with tarfile.open(repo / ".whl" / "cutlass-include.tar.xz", "w:xz") as tar:
        tar.add(headers, arcname=".")
    bin_dir = _fake_python(tmp_path, FAKE_SETUP_PYTHON)
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho gpu\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "CALLS": str(tmp_path / "calls"), "CUTLASS_INCLUDE": str(inc)}
    script = str(repo / "tools" / "gpu_run.sh")
    done = subprocess.run(["bash", script, "setup"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (inc / "cute" / "tensor.hpp").read_text() == "// cute\n"
    (inc / "cute" / "tensor.hpp").write_text("kept")  # a warm machine's headers are not unpacked again
    done = subprocess.run(["bash", script, "setup"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and (inc / "cute" / "tensor.hpp").read_text() == "kept"


# Stands in for python3 in the lab phase: the build records what the overlaid source held and
# writes a variant holding it, printing the variant's path last.
FAKE_LAB_PYTHON = """#!/usr/bin/env bash
if [[ $1 == -m && $2 == flash_attn_hub && $3 == build ]]; then
  mkdir -p build/variant && cat csrc/kernel.h >build/variant/built-from
  [[ -f csrc/added.h ]] && echo added >>build/variant/built-from
  echo "$PWD/build/variant"
fi
"""


def test_lab_phase_builds_the_overlay_and_puts_the_tree_back(tmp_path):
    """The lab build sees .lab/'s files laid over the tree (a changed one and an added one);
    afterwards its variant is in LAB_DIR, build/ holds the main build again (its cache untouched)
    and the tree is as it was, the added file gone."""
    repo, lab = tmp_path / "repo", tmp_path / "lab"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "tools" / "gpu_run.sh", repo / "tools" / "gpu_run.sh")
    (repo / "csrc").mkdir()
    (repo / "csrc" / "kernel.h").write_text("main\n")
    (repo / "build" / "variant").mkdir(parents=True)
    (repo / "build" / "variant" / "built-from").write_text("main\n")
    (repo / "build" / ".cache").mkdir()
    (repo / "build" / ".cache" / "object").write_text("cached")
    (repo / ".lab" / "csrc").mkdir(parents=True)
    (repo / ".lab" / "csrc" / "kernel.h").write_text("lab\n")
    (repo / ".lab" / "csrc" / "added.h").write_text("")
    bin_dir = _fake_python(tmp_path, FAKE_LAB_PYTHON)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "LAB_DIR": str(lab)}
    done = subprocess.run(["bash", str(repo / "tools" / "gpu_run.sh"), "lab"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (lab / "variant" / "built-from").read_text() == "lab\nadded\n"
    assert (repo / "build" / "variant" / "built-from").read_text() == "main\n"
    assert (repo / "build" / ".cache" / "object").read_text() == "cached"
    assert (repo / "csrc" / "kernel.h").read_text() == "main\n"
    assert not (repo / "csrc" / "added.h").exists()
    shutil.rmtree(repo / ".lab")  # without an overlay the phase fails and changes nothing
    done = subprocess.run(["bash", str(repo / "tools" / "gpu_run.sh"), "lab"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "needs a carried .lab/" in done.stdout
    assert (repo / "build" / "variant" / "built-from").read_text() == "main\n"
