"""The heartbeat between hosts (docs/multi_host.md, "Heartbeat between hosts").

Three test hosts (hhb-h*) of 2 slots; a job of three data-parallel pipelines,
one per host, trains; at step 5 host 2's link goes down (`ip link set hnet0
down` inside its namespace). With the default HSPMD_HEARTBEAT_TIMEOUT (10 s)
the job ends within 30 s, exit 1, with one line that names host 2; the
ranks on host 2, which hear no other host, end too.

Exit 77 (skipped) where this machine cannot make network namespaces."""
import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns_test import Failed  # noqa: E402
from links_test import Cluster, run_on_cluster  # noqa: E402

PREFIX, SUBNET = "hhb", "10.213.10"
MODEL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64, "eos_token_id": 0}
PLAN = {"pipelines": [{"micro_batch_size": 2, "micro_batches": 2, "stages": [
    {"ranks": [2 * k, 2 * k + 1], "layers": [0, 1]}]} for k in range(3)]}
DOWN_AT_STEP, LIMIT_S = 5, 30


def check_link_down(c, hspmd, tmp):
    log = os.path.join(tmp, "log.jsonl")
    env = dict(c.env)
    env.pop("HSPMD_HEARTBEAT_TIMEOUT", None)  # the default
    proc = subprocess.Popen([hspmd, "train", "--model", os.path.join(tmp, "model.json"), "--data",
                             os.path.join(tmp, "data.bin"), "--seq-len", "64", "--global-batch", "12", "--steps",
                             "100000", "--strategy", os.path.join(tmp, "plan.json"), "--hostfile", c.hostfile,
                             "--nproc", "6", "--threads", "1", "--quiet", "--log", log],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while not (os.path.exists(log) and len(open(log).readlines()) >= DOWN_AT_STEP):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise Failed(f"the job did not reach step {DOWN_AT_STEP}: {proc.communicate()[1]}")
        time.sleep(0.1)
    t0 = time.time()
    subprocess.run(["ip", "netns", "exec", f"{PREFIX}-h2", "ip", "link", "set", "hnet0", "down"], check=True)
    try:
        _, err = proc.communicate(timeout=LIMIT_S + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise Failed(f"the job still ran {LIMIT_S + 30} s after host 2's link went down")
    took = time.time() - t0
    lines = [l for l in err.splitlines() if l.strip()]
    if proc.returncode != 1 or took > LIMIT_S or len(lines) != 1 or f"host {PREFIX}-h2 " not in lines[0]:
        raise Failed(f"link down: exit {proc.returncode} after {took:.1f} s, stderr: {err.strip()}")
    print(f"ok   {lines[0]} (exit 1, {took:.1f} s after the link went down)")


def write_inputs(tmp):
    json.dump(MODEL, open(os.path.join(tmp, "model.json"), "w"))
    json.dump(PLAN, open(os.path.join(tmp, "plan.json"), "w"))
    rng = random.Random(7)
    with open(os.path.join(tmp, "data.bin"), "wb") as f:
        f.write(b"".join(struct.pack("<I", rng.randrange(MODEL["vocab_size"])) for _ in range(16384)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    ap.add_argument("--script", required=True, help="scripts/netns_cluster.sh")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hspmd_heartbeat_")

    def checks(c):
        write_inputs(tmp)
        c.up()
        check_link_down(c, args.hspmd, tmp)

    return run_on_cluster("netns_heartbeat", PREFIX, tmp,
                          lambda: Cluster(args.script, tmp, PREFIX, SUBNET, shape="* 1gbit 0\n"), checks)


if __name__ == "__main__":
    sys.exit(main())
