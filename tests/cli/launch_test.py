"""hspmd launch --nproc N script.py: the supervised launcher of `hspmd train
--nproc` running a Python script on N ranks.
 * examples/python/train_tiny.py on 2 ranks (a 2-stage pipeline) gives the
   step records of `mpirun -np 2 python3 train_tiny.py` and of `hspmd train
   --nproc 2` with the same flags, bit for bit (PYTHONPATH found by the
   launcher: none is set here);
 * a script whose rank 1 kills itself ends the job with exit code 1 and one
   line naming the rank and the signal;
 * with --timeout, a rank that stops (SIGSTOP) is named by the watchdog: the
   Python ranks tick the heartbeat (python/hspmd/_supervision.py);
 * a Trainer setup error on every rank is one line from one rank;
 * a rank that exits (sys.exit(3)) or raises before the first collective
   ends the job within seconds, named with its exit code (it used to sit in
   MPI_Finalize while the others waited for it: a hang);
 * SIGTERM to the launcher ends the ranks: exit code 143 and one line;
 * SIGKILL to the launcher takes mpirun and every rank with it, also ranks
   that never reached hspmd.world() (mpirun gets SIGTERM at the launcher's
   death: PR_SET_PDEATHSIG);
 * --nproc beyond 32 ranks per core (or not an integer: 1e3) is refused;
 * a missing script or --nproc is one [flags] line, exit code 1."""
import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "python", "train_tiny.py")
MODEL = os.path.join(ROOT, "examples", "tiny-llama", "config.json")
FLAGS = ["--seq-len", "64", "--steps", "6", "--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps", "2",
         "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "0", "--quiet"]
FIELDS = ("step", "loss", "grad_norm", "lr", "tokens")
PIPELINE_2 = {"description": "2 ranks: a pipeline of two stages", "schedule": "1f1b",
              "pipelines": [{"micro_batch_size": 2, "micro_batches": 2,
                             "stages": [{"ranks": [0], "layers": [0, 1]}, {"ranks": [1], "layers": [2, 3]}]}]}
KILLER = """import os, signal, sys, hspmd
w = hspmd.world()
w.barrier()
if w.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
w.barrier()  # never passes: rank 1 is gone
"""
STOPPER = """import os, signal, hspmd
w = hspmd.world()
w.barrier()
if w.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its heartbeat stops
w.barrier()
"""
BAD_SETUP = """import sys, hspmd
bad = {"pipelines": [{"micro_batch_size": 2, "micro_batches": 1,
                      "stages": [{"ranks": [0, 1, 2], "layers": [0, 3]}]}]}
hspmd.Trainer(sys.argv[1], bad, sys.argv[2], seq_len=64, steps=1)
"""
EARLY_EXIT = """import sys, hspmd
w = hspmd.world()
if w.rank == 1:
    sys.exit(3)  # before the first collective: rank 0 waits in the barrier
w.barrier()
"""
EARLY_RAISE = """import hspmd
w = hspmd.world()
if w.rank == 1:
    raise ValueError("rank 1 fails before the first collective")
w.barrier()
"""
# Never calls hspmd.world(): no watcher thread of its own (a rank still
# importing, or a script that does not use the module).
SLEEPER_NO_WORLD = """import os, sys, time
with open(sys.argv[1] + "." + os.environ["OMPI_COMM_WORLD_RANK"], "w") as f:
    f.write(f"{os.getpid()} {os.getppid()}\\n{os.environ['HSPMD_JOB_DIR']}")
time.sleep(120)
"""
SLEEPER = """import os, sys, time, hspmd
w = hspmd.world()
w.barrier()
open(sys.argv[1] + "." + str(w.rank), "w").close()
time.sleep(120)
"""


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def errors(stderr):
    return [line for line in stderr.splitlines() if line.startswith("hspmd: error")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--pythonpath", required=True, help="the module's directory, for the plain mpirun run only")
    a = ap.parse_args()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # the launcher finds the module itself
    launch = [a.hspmd, "launch", "--nproc", "2", "--python", a.python]
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "corpus.bin")
        corpus = sorted(glob.glob(os.path.join(ROOT, "data", "corpus", "*.txt")))
        subprocess.run([a.hspmd, "tokenize", "--model", MODEL, "--output", data, *corpus], check=True,
                       capture_output=True)
        strategy = os.path.join(d, "pipeline_2.json")
        with open(strategy, "w") as f:
            json.dump(PIPELINE_2, f)
        logs = {k: os.path.join(d, k + ".jsonl") for k in ("launch", "mpirun", "cli")}
        example = [EXAMPLE, "--data", data, "--strategy", strategy]
        subprocess.run(launch + ["--timeout", "60"] + example + ["--records", logs["launch"]], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        subprocess.run([a.mpirun, "--oversubscribe", "--allow-run-as-root", "-np", "2", "-x", "PYTHONPATH",
                        a.python, *example, "--records", logs["mpirun"]], check=True,
                       env=dict(env, PYTHONPATH=a.pythonpath), stdout=subprocess.DEVNULL)
        subprocess.run([a.hspmd, "train", "--nproc", "2", "--model", MODEL, "--data", data, *FLAGS, "--threads", "1",
                        "--strategy", strategy, "--log", logs["cli"]], check=True, env=env)
        got = records(logs["launch"])
        assert len(got) == 6, len(got)
        for other in ("mpirun", "cli"):
            want = records(logs[other])
            for w, g in zip(want, got):
                for k in FIELDS:
                    assert w[k] == g[k], f"step {w['step']}: {k} {g[k]!r} under launch, {w[k]!r} under {other}"

        # No --python, and PATH's first python3 is another interpreter (one
        # that cannot import the module): launch runs the interpreter the
        # module was built for.
        fake = os.path.join(d, "fakebin")
        os.makedirs(fake)
        with open(os.path.join(fake, "python3"), "w") as f:
            f.write("#!/bin/sh\necho 'the wrong python3' >&2\nexit 3\n")
        os.chmod(os.path.join(fake, "python3"), 0o755)
        hello = os.path.join(d, "hello.py")
        with open(hello, "w") as f:
            f.write("import sys, hspmd\nprint('imported by', sys.executable)\n")
        p = subprocess.run([a.hspmd, "launch", "--nproc", "2", hello], capture_output=True, text=True, timeout=120,
                           env=dict(env, PATH=fake + os.pathsep + env.get("PATH", "")))
        assert p.returncode == 0 and p.stdout.count("imported by") == 2, (p.returncode, p.stdout, p.stderr)
        assert "the wrong python3" not in p.stderr, p.stderr

        # A rank killed by a signal: exit 1, one line naming it.
        killer = os.path.join(d, "killer.py")
        with open(killer, "w") as f:
            f.write(KILLER)
        p = subprocess.run(launch + [killer], env=env, capture_output=True, text=True, timeout=120)
        lines = errors(p.stderr)
        assert p.returncode == 1, (p.returncode, p.stderr)
        assert lines == ["hspmd: error: [launch] rank 1 was killed by signal 9 (Killed); the job was ended"], p.stderr

        # --timeout: the Python ranks' heartbeats reach the watchdog.
        stopper = os.path.join(d, "stopper.py")
        with open(stopper, "w") as f:
            f.write(STOPPER)
        p = subprocess.run(launch[:2] + ["--nproc", "2", "--timeout", "2", "--python", a.python, stopper], env=env,
                           capture_output=True, text=True, timeout=120)
        lines = errors(p.stderr)
        assert p.returncode == 1 and len(lines) == 1, (p.returncode, p.stderr)
        assert lines[0].startswith("hspmd: error: [watchdog] rank 1 (pid ") and "stopped responding" in lines[0], \
            lines

        # A Trainer setup error, raised on both ranks: one line, from one rank.
        bad = os.path.join(d, "bad_setup.py")
        with open(bad, "w") as f:
            f.write(BAD_SETUP)
        p = subprocess.run(launch + [bad, MODEL, data], env=env, capture_output=True, text=True, timeout=120)
        lines = errors(p.stderr)
        assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
        assert lines[0].startswith("hspmd: error: rank "), lines

        # A rank that exits or raises before the first collective: the job
        # ends at once (not by the watchdog's --timeout), naming the rank and
        # its exit code (issue 39 item 4).
        for name, script, want in (("early_exit.py", EARLY_EXIT, "rank 1 exited with code 3"),
                                   ("early_raise.py", EARLY_RAISE, "ValueError: rank 1 fails")):
            path = os.path.join(d, name)
            with open(path, "w") as f:
                f.write(script)
            start = time.time()
            p = subprocess.run(launch[:2] + ["--nproc", "2", "--timeout", "30", "--python", a.python, path], env=env,
                               capture_output=True, text=True, timeout=180)
            took = time.time() - start
            assert p.returncode == 1 and want in p.stderr and "[watchdog]" not in p.stderr, (name, p.stderr)
            assert len(errors(p.stderr)) <= 1, (name, p.stderr)
            if name == "early_exit.py":
                assert errors(p.stderr) == ["hspmd: error: [launch] rank 1 exited with code 3 without a message; "
                                            "the job was ended"], p.stderr
            assert took < 10, f"{name}: the job took {took:.1f} s to end"

        # SIGTERM to the launcher: forwarded, the ranks end, 128 + 15.
        sleeper, marker = os.path.join(d, "sleeper.py"), os.path.join(d, "started")
        with open(sleeper, "w") as f:
            f.write(SLEEPER)
        p = subprocess.Popen(launch + [sleeper, marker], env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while not all(os.path.exists(f"{marker}.{r}") for r in (0, 1)):
            assert time.time() < deadline and p.poll() is None, "the sleeper's ranks did not start"
            time.sleep(0.1)
        start = time.time()
        p.send_signal(signal.SIGTERM)
        _, stderr = p.communicate(timeout=60)
        assert p.returncode == 128 + signal.SIGTERM, (p.returncode, stderr)
        assert errors(stderr) == ["hspmd: error: [launch] SIGTERM: ended the job's 2 ranks"], stderr
        assert time.time() - start < 15, "the ranks outlived the SIGTERM"

        # SIGKILL to the launcher: mpirun and the ranks follow it within
        # seconds, even ranks without a watcher thread (issue 39 item 10).
        lonely, marker = os.path.join(d, "lonely.py"), os.path.join(d, "lonely")
        with open(lonely, "w") as f:
            f.write(SLEEPER_NO_WORLD)
        p = subprocess.Popen(launch + [lonely, marker], env=env, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while not all(os.path.exists(f"{marker}.{r}") and os.path.getsize(f"{marker}.{r}") for r in (0, 1)):
            assert time.time() < deadline and p.poll() is None, "the lonely ranks did not start"
            time.sleep(0.1)
        pids, job_dir = set(), None
        for r in (0, 1):
            with open(f"{marker}.{r}") as f:
                ids, job_dir = f.read().split("\n")
                pids.update(int(x) for x in ids.split())  # the rank and its parent, mpirun
        pids.discard(p.pid)
        p.kill()
        p.wait()

        def alive(pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
            except OSError:
                return False
        deadline = time.time() + 10
        while any(alive(x) for x in pids) and time.time() < deadline:
            time.sleep(0.1)
        left = sorted(x for x in pids if alive(x))
        for x in left:  # leave nothing behind, even when failing
            try:
                os.kill(x, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(job_dir, ignore_errors=True)  # nobody left to remove it: these ranks have no watcher
        assert not left, f"SIGKILL to the launcher left mpirun and ranks running: pids {left}"

        # Bad invocations: one [flags] line.
        for args, want in (([a.hspmd, "launch", "--nproc", "2", os.path.join(d, "none.py")], "none.py"),
                           ([a.hspmd, "launch", killer], "--nproc N is required"),
                           ([a.hspmd, "launch", "--nproc", "2"], "no script given"),
                           # 32 ranks per core at most, as profile --emulated-ranks (issue 39 item 10).
                           ([a.hspmd, "launch", "--nproc", "100000", killer],
                            "--nproc 100000 must lie in [1, "),
                           ([a.hspmd, "launch", "--nproc", "1e3", killer], "--nproc: '1e3' is not an integer")):
            p = subprocess.run(args, env=env, capture_output=True, text=True)
            assert p.returncode == 1 and len(errors(p.stderr)) == 1 and want in p.stderr, (args, p.stderr)
    print("ok: hspmd launch == mpirun python3 == hspmd train --nproc 2; a killed rank, the watchdog, a setup "
          "error, SIGTERM, bad flags: one line each")


if __name__ == "__main__":
    main()
