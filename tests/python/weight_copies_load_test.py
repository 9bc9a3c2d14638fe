"""Trainer.load_state_dict between two bf16 steps, with the weights' bf16
copies written by AdamW (docs/precision.md, "The weights' bf16 copies"):
the step after the load must cast the new weights, not take the copies the
last update wrote of the old ones. Each mode runs in a child process
(HSPMD_WEIGHT_COPIES is read once a process): two steps, the weights
halved through load_state_dict, two more steps; the default mode's losses
and gradient norms must equal those of HSPMD_WEIGHT_COPIES=graph (every
step casts) bit for bit, and differ from a run without the load (so the
load took effect)."""
import json
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "examples", "tiny-llama", "config.json")

CHILD = r"""
import json, sys
import hspmd
data, load = sys.argv[1], sys.argv[2] == "load"
t = hspmd.Trainer(sys.argv[3], None, data, seq_len=32, steps=4, global_batch=4, threads=1, lr=1e-2,
                  precision="bf16", progress=False)
records = [t.step() for _ in range(2)]
if load:
    t.load_state_dict({k: v * 0.5 for k, v in t.state_dict().items()})
records += [t.step() for _ in range(2)]
print(json.dumps([[r["loss"], r["grad_norm"]] for r in records]))
"""


def child(data, mode, load):
    env = dict(os.environ, HSPMD_WEIGHT_COPIES=mode)
    p = subprocess.run([sys.executable, "-c", CHILD, data, "load" if load else "no", MODEL],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, f"{mode}: {p.stderr[-600:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    with tempfile.TemporaryDirectory(prefix="weight_copies_load-") as d:
        data = os.path.join(d, "tokens.bin")
        with open(data, "wb") as f:  # 4096 u32 tokens below the vocabulary (320)
            f.write(b"".join(struct.pack("<I", (i * 37) % 300) for i in range(4096)))
        optimizer = child(data, "optimizer", True)
        graph = child(data, "graph", True)
        unloaded = child(data, "optimizer", False)
    print("optimizer's copies:", optimizer)
    print("graph's casts:     ", graph)
    assert optimizer == graph, "the step after load_state_dict trained other weights than the graph's casts"
    assert optimizer[:2] == unloaded[:2] and optimizer[2] != unloaded[2], "the load did not change step 2"
    print("ok")


if __name__ == "__main__":
    main()
