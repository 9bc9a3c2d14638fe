"""pip install . into a fresh virtual environment, then hspmd used from it
outside the source tree (docs/python.md, "Installing with pip"):
 * the venv (Debian's python3 with its system packages: numpy) is made anew
   every run; scikit-build-core comes from the wheels that
   scripts/install_deps.sh downloaded into .pip-wheels/, and pip runs with
   --no-index --no-build-isolation: no network (no wheels: SKIPPED, 77);
 * the build directory stays (--work DIR/build): a later run rebuilds only
   what changed, and the first one takes the suite's own objects from ccache
   (the suite's configuration is passed in with --define, so the compile
   commands are the suite's);
 * `import hspmd` from a directory outside the checkout, with no PYTHONPATH,
   imports the installed package, and a 3-step Trainer run trains there on a
   corpus that the installed `hspmd tokenize` wrote;
 * `hspmd launch --help` names the venv's interpreter as the default, and
   (--launch) `hspmd launch --nproc 2` with no --python, while the first
   python3 on PATH is another interpreter (one that fails), runs the ranks
   with the venv's interpreter, which imports the installed package."""
import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

TRAIN = """import json, sys
import hspmd
model = hspmd.models.from_hf(sys.argv[1])
trainer = hspmd.Trainer(model, None, sys.argv[2], optimizer="adamw", precision="fp32", device="cpu", seq_len=64,
                        steps=3, global_batch=4, micro_batches=2, lr=3e-3, seed=0, threads=1)
records = []
while not trainer.done:
    records.append(trainer.step())
trainer.finish()
weights = trainer.state_dict()  # numpy arrays through the installed extension, and back
again = hspmd.Trainer(model, None, sys.argv[2], seq_len=64, steps=1, global_batch=4, micro_batches=2, threads=1)
again.load_state_dict(weights)
assert all((again.state_dict()[k] == w).all() for k, w in weights.items())
print(json.dumps({"module": hspmd.__file__, "records": records}))
"""
HELLO = """import sys, hspmd
w = hspmd.world()
w.barrier()
with open(f"{sys.argv[1]}.{w.rank}", "w") as f:  # a file each: mpirun may interleave the ranks' stdout
    f.write(f"rank {w.rank} of {w.size} python {sys.executable} module {hspmd.__file__}")
"""


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"FAILED ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def make_venv(a, venv, env):
    """A fresh venv with scikit-build-core from the wheels; its interpreter."""
    shutil.rmtree(venv, ignore_errors=True)
    run([a.python, "-m", "venv", "--system-site-packages", venv], env=env)
    py = os.path.join(venv, "bin", "python")
    run([py, "-m", "pip", "install", "--no-index", "--find-links", a.wheels, "scikit-build-core"], env=env)
    return py


def pip_install(a, py, build, env):
    """pip install . offline into the venv, building in `build`; a line of
    what it took."""
    cold = not os.path.exists(os.path.join(build, "CMakeCache.txt"))
    log, stats = os.path.join(a.work, "pip-install.log"), os.path.join(a.work, "ccache-stats.log")
    if os.path.exists(stats):
        os.remove(stats)
    env = dict(env, CCACHE_STATSLOG=stats)  # this build's ccache hits and misses only
    cmd = [py, "-m", "pip", "install", "-v", "--no-index", "--no-build-isolation",
           "--config-settings", f"build-dir={build}"]  # (-C: pip 23.1 on; Debian 12 has 23.0)
    for d in a.define:
        cmd += ["--config-settings", f"cmake.define.{d}"]
    start = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd + [a.source], stdout=f, stderr=subprocess.STDOUT, env=env)
    if p.returncode != 0 and not cold:
        # A kept build directory that no longer configures (another CMake,
        # a moved checkout): once more from a new one.
        print(f"pip install failed in the kept build directory {build}: trying a new one")
        shutil.rmtree(build, ignore_errors=True)
        return pip_install(a, py, build, env)
    seconds = time.time() - start
    with open(log) as f:
        text = f.read()
    if p.returncode != 0:
        sys.exit(f"FAILED: pip install (exit {p.returncode}; log {log}):\n{text[-6000:]}")
    built = sum(1 for line in text.splitlines() if "Building CXX object" in line or "Building CUDA object" in line)
    counts = {}
    if os.path.exists(stats):
        with open(stats) as f:
            for line in f:
                counts[line.strip()] = counts.get(line.strip(), 0) + 1
    hits = counts.get("direct_cache_hit", 0) + counts.get("preprocessed_cache_hit", 0)
    return (f"pip install .: {seconds:.1f} s ({'a new' if cold else 'the kept'} build directory {build}: "
            f"{built} objects built, {hits} of them from ccache, {counts.get('cache_miss', 0)} compiled)")


def check_outside(a, py, site, d, env):
    """From d (outside the checkout): import, tokenize, 3 Trainer steps."""
    p = run([py, "-c", "import hspmd; print(hspmd.__file__)"], cwd=d, env=env)
    assert p.stdout.strip() == os.path.join(site, "hspmd", "__init__.py"), p.stdout
    model = os.path.join(d, "config.json")
    shutil.copy(os.path.join(a.source, "examples", "tiny-llama", "config.json"), model)
    data = os.path.join(d, "corpus.bin")
    exe = os.path.join(os.path.dirname(py), "hspmd")
    run([exe, "tokenize", "--model", model, "--output", data,
         *sorted(glob.glob(os.path.join(a.source, "data", "corpus", "*.txt")))], cwd=d, env=env)
    script = os.path.join(d, "train3.py")
    with open(script, "w") as f:
        f.write(TRAIN)
    p = run([py, script, model, data], cwd=d, env=env)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["module"].startswith(site), out["module"]
    losses = [r["loss"] for r in out["records"]]
    assert [r["step"] for r in out["records"]] == [0, 1, 2] and all(math.isfinite(x) for x in losses), out
    print(f"3 steps from {d}: losses {', '.join(f'{x:.4f}' for x in losses)}")


def check_launch(py, site, d, env):
    """hspmd launch --nproc 2, no --python, a failing python3 first on PATH."""
    exe, bindir = os.path.join(os.path.dirname(py), "hspmd"), os.path.dirname(py)
    fake = os.path.join(d, "fakebin")
    os.makedirs(fake)
    with open(os.path.join(fake, "python3"), "w") as f:
        f.write("#!/bin/sh\necho 'the wrong python3' >&2\nexit 3\n")
    os.chmod(os.path.join(fake, "python3"), 0o755)
    hello = os.path.join(d, "hello.py")
    with open(hello, "w") as f:
        f.write(HELLO)
    env = dict(env, PATH=fake + os.pathsep + env.get("PATH", ""), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    said = os.path.join(d, "said")
    p = subprocess.run([exe, "launch", "--nproc", "2", hello, said], cwd=d, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "the wrong python3" not in p.stderr, (p.returncode, p.stdout, p.stderr)
    for r in range(2):
        with open(f"{said}.{r}") as f:
            line = f.read()
        words = line.split()
        assert words[1] == str(r) and words[3] == "2", line
        assert os.path.dirname(words[5]) == bindir, line
        assert words[7].startswith(site), line
    print("hspmd launch --nproc 2 (PATH's python3 another interpreter): both ranks on", words[5])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True, help="the checkout (pyproject.toml)")
    ap.add_argument("--work", required=True, help="the venv and the build directory that stays, here")
    ap.add_argument("--wheels", required=True, help="scikit-build-core's wheels (scripts/install_deps.sh)")
    ap.add_argument("--python", default="/usr/bin/python3", help="the interpreter the venv is made from")
    ap.add_argument("--define", action="append", default=[], help="K=V: cmake.define for the build (the suite's)")
    ap.add_argument("--jobs", default="2")
    ap.add_argument("--launch", action="store_true", help="check hspmd launch (a build with MPI)")
    a = ap.parse_args()

    if not glob.glob(os.path.join(a.wheels, "scikit_build_core-*.whl")):
        print(f"SKIPPED: no scikit-build-core wheel in {a.wheels} (scripts/install_deps.sh downloads it from PyPI)")
        sys.exit(77)
    os.makedirs(a.work, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", CMAKE_BUILD_PARALLEL_LEVEL=a.jobs)
    start = time.time()
    py = make_venv(a, os.path.join(a.work, "venv"), env)
    venv_s = time.time() - start
    print(f"venv and scikit-build-core: {venv_s:.1f} s; " + pip_install(a, py, os.path.join(a.work, "build"), env))

    site = run([py, "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"], env=env).stdout.strip()
    assert os.path.isfile(os.path.join(site, "hspmd", "_bin", "hspmd")), os.listdir(os.path.join(site, "hspmd"))
    # The launcher's default interpreter: the venv's.
    p = run([os.path.join(os.path.dirname(py), "hspmd"), "launch", "--help"], env=env)
    assert f"built for, {os.path.dirname(py)}/python" in p.stdout, p.stdout
    with tempfile.TemporaryDirectory() as d:
        check_outside(a, py, site, d, env)
        if a.launch:
            check_launch(py, site, d, env)
    print("ok: pip install . into a fresh venv; import, hspmd tokenize, 3 Trainer steps outside the checkout, "
          "hspmd launch with the venv's interpreter")


if __name__ == "__main__":
    main()
