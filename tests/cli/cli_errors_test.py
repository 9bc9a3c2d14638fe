#!/usr/bin/env python3
"""Bad input to `hspmd train` / `hspmd tokenize`: each case must exit non-zero
with exactly one line on stderr that names the problem, and write nothing.

usage: cli_errors_test.py --hspmd PATH
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

CONFIG = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 64, "eos_token_id": 256}


def write_safetensors(path, tensors, truncate=0):
    """tensors: name -> (dtype, shape, bytes)."""
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    raw = struct.pack("<Q", len(h)) + h + b"".join(blobs)
    with open(path, "wb") as f:
        f.write(raw[:len(raw) - truncate] if truncate else raw)


def model_tensors(cfg, dtype="F32", skip=None, bad_shape=None):
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h),
              "model.layers.0.self_attn.q_proj.weight": (q, h),
              "model.layers.0.self_attn.k_proj.weight": (kv, h),
              "model.layers.0.self_attn.v_proj.weight": (kv, h),
              "model.layers.0.self_attn.o_proj.weight": (h, q),
              "model.layers.0.mlp.gate_proj.weight": (f, h), "model.layers.0.mlp.up_proj.weight": (f, h),
              "model.layers.0.mlp.down_proj.weight": (h, f),
              "model.layers.0.input_layernorm.weight": (h,),
              "model.layers.0.post_attention_layernorm.weight": (h,)}
    out = {}
    for name, shape in shapes.items():
        if name == skip:
            continue
        if name == bad_shape:
            shape = (shape[0] + 1,) + tuple(shape[1:])
        n = 1
        for s in shape:
            n *= s
        size = {"F32": 4, "BF16": 2, "I32": 4}[dtype]
        out[name] = (dtype, shape, bytes(n * size))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    exe = ap.parse_args().hspmd
    tmp = tempfile.mkdtemp()
    p = lambda n: os.path.join(tmp, n)  # noqa: E731

    with open(p("cfg.json"), "w") as f:
        json.dump(CONFIG, f)
    with open(p("bad_json.json"), "w") as f:
        f.write("{\"vocab_size\": 300,")
    with open(p("no_hidden.json"), "w") as f:
        json.dump({k: v for k, v in CONFIG.items() if k != "hidden_size"}, f)
    with open(p("bad_heads.json"), "w") as f:
        json.dump(dict(CONFIG, num_attention_heads=3), f)
    with open(p("data.bin"), "wb") as f:
        f.write(struct.pack("<200I", *([5] * 200)))
    moe = dict(CONFIG, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    with open(p("moe_aux.json"), "w") as f:
        json.dump(dict(moe, output_router_logits=True), f)
    with open(p("moe_topk.json"), "w") as f:
        json.dump(dict(moe, num_experts_per_tok=5), f)
    with open(p("moe_jitterless.json"), "w") as f:
        json.dump(moe, f)
    with open(p("moe_2layers.json"), "w") as f:
        json.dump(dict(moe, num_hidden_layers=2), f)
    with open(p("moe_jitter.json"), "w") as f:
        json.dump(dict(moe, router_jitter_noise=0.01), f)
    # Expert parallelism's rules (docs/moe.md): strategies `plan compile` refuses.
    def one_stage(r, micro=2, layers=None, **stage):
        return {"micro_batch_size": 1, "micro_batches": micro,
                "stages": [{"ranks": [r], "layers": layers or [0, CONFIG["num_hidden_layers"] - 1], **stage}]}
    ep_strategies = {
        "ep_dense": {"expert_parallel": 2, "pipelines": [one_stage(0), one_stage(1)]},
        "ep_experts": {"expert_parallel": 3, "pipelines": [one_stage(r) for r in range(3)]},
        "ep_slots": {"expert_parallel": 2, "pipelines": [one_stage(r) for r in range(3)]},
        "ep_recompute": {"expert_parallel": 2, "pipelines": [one_stage(0, recompute=True), one_stage(1)]},
        "ep_micro": {"expert_parallel": 2, "pipelines": [one_stage(0), one_stage(1, micro=3)]},
        "ep_orphan": {"expert_parallel": 2, "pipelines": [one_stage(0), one_stage(1)],
                      "expert_placement": [{"layers": [0, 0], "experts": [[0], [0], [0], [0]]}]},
        "ep_member": {"expert_parallel": 2, "pipelines": [one_stage(0), one_stage(1)],
                      "expert_placement": [{"layers": [0, 0], "experts": [[0], [2], [1], [1]]}]},
        "ep_1f1b": {"expert_parallel": 2, "pipelines": [
            {"micro_batch_size": 1, "micro_batches": 2,
             "stages": [{"ranks": [0], "layers": [0, 0]}, {"ranks": [1], "layers": [1, 1]}]},
            one_stage(2, layers=[0, 1])]},
    }
    for name, strategy in ep_strategies.items():
        with open(p(name + ".json"), "w") as f:
            json.dump(strategy, f)

    def compile_ep(name, model, world):
        return ["plan", "compile", "--model", p(model), "--strategy", p(name + ".json"), "--world", str(world),
                "-o", p("ep_plan.json")]
    # A hand-written expert-parallel plan whose expert 1 sits in one group
    # where expert 0 has two: the op's rule names the expert.
    ep_ok = {"expert_parallel": 2, "pipelines": [one_stage(r) for r in range(4)]}  # two groups
    with open(p("ep_ok.json"), "w") as f:
        json.dump(ep_ok, f)
    subprocess.run([exe] + compile_ep("ep_ok", "moe_jitterless.json", 4), check=True, capture_output=True)
    with open(p("ep_plan.json")) as f:
        plan = json.load(f)
    for w in ("w1", "w2", "w3"):
        name = "model.layers.0.block_sparse_moe.experts.1." + w + ".weight"
        plan["tensors"][name] = {"hdim": -1, "subgroups": [{"ranks": [0], "states": {}}]}
    with open(p("ep_bad_plan.json"), "w") as f:
        json.dump(plan, f)
    open(p("empty.bin"), "wb").close()
    with open(p("short.bin"), "wb") as f:
        f.write(struct.pack("<10I", *range(10)))
    with open(p("bad_id.bin"), "wb") as f:
        f.write(struct.pack("<200I", *([5] * 150 + [70000] + [5] * 49)))
    with open(p("odd.bin"), "wb") as f:
        f.write(b"\x01\x00\x00\x00\x02\x00")
    write_safetensors(p("ok.safetensors"), model_tensors(CONFIG))
    write_safetensors(p("truncated.safetensors"), model_tensors(CONFIG), truncate=100)
    write_safetensors(p("missing.safetensors"), model_tensors(CONFIG, skip="model.norm.weight"))
    write_safetensors(p("shape.safetensors"),
                      model_tensors(CONFIG, bad_shape="model.layers.0.mlp.up_proj.weight"))
    write_safetensors(p("dtype.safetensors"), model_tensors(CONFIG, dtype="I32"))
    with open(p("garbage.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 10 ** 9) + b"{}")

    base = ["train", "--model", p("cfg.json"), "--data", p("data.bin"), "--seq-len", "16",
            "--global-batch", "2", "--steps", "1", "--threads", "1", "--quiet"]

    def with_flag(flag, value):
        args = list(base)
        i = args.index(flag)
        args[i + 1] = value
        return args

    cases = [
        ("missing config", with_flag("--model", p("nope.json")), "nope.json"),
        ("malformed config", with_flag("--model", p("bad_json.json")), "bad_json.json"),
        ("config missing field", with_flag("--model", p("no_hidden.json")), "hidden_size"),
        ("config impossible heads", with_flag("--model", p("bad_heads.json")), "num_attention_heads"),
        ("missing data", with_flag("--data", p("nope.bin")), "nope.bin"),
        ("empty data", with_flag("--data", p("empty.bin")), "empty.bin"),
        ("data not uint32", with_flag("--data", p("odd.bin")),
         p("odd.bin") + ": size 6 bytes is not a multiple of 4 (uint32 token ids)"),
        ("data shorter than a sample", with_flag("--data", p("short.bin")), "short.bin"),
        ("token id >= vocab", with_flag("--data", p("bad_id.bin")), "70000"),
        ("truncated safetensors", base + ["--init", p("truncated.safetensors")], "truncated"),
        ("garbage safetensors", base + ["--init", p("garbage.safetensors")], "garbage"),
        ("missing tensor", base + ["--init", p("missing.safetensors")], "model.norm.weight"),
        ("wrong shape", base + ["--init", p("shape.safetensors")], "up_proj"),
        ("wrong dtype", base + ["--init", p("dtype.safetensors")], "dtype"),
        ("unknown flag", base + ["--frobnicate", "1"], "--frobnicate"),
        ("bad integer", with_flag("--steps", "ten"), "--steps"),
        ("missing required flag", [a for a in base if a not in ("--model", p("cfg.json"))], "--model"),
        ("flag without value", base + ["--lr"], "--lr"),
        ("no global batch without a strategy",
         [a for i, a in enumerate(base) if a != "--global-batch" and base[i - 1] != "--global-batch"],
         "--global-batch"),
        ("strategy file missing", base + ["--strategy", p("nope_strategy.json")], "nope_strategy.json"),
        ("nproc without strategy", base + ["--nproc", "2"], "--strategy"),
        ("negative steps", with_flag("--steps", "-3"), "--steps"),
        ("micro-batches not dividing", base + ["--micro-batches", "3"], "--micro-batches"),
        ("seq-len beyond max positions", with_flag("--seq-len", "65"), "max_position_embeddings"),
        ("unknown schedule", base + ["--lr-schedule", "zigzag"], "zigzag"),
        ("save into a missing directory", base + ["--save", p("no/such/dir/w.safetensors")], "--save"),
        ("moe top-k beyond the experts", with_flag("--model", p("moe_topk.json")),
         "num_experts_per_tok=5 must lie in [1, 4]"),
        ("moe router jitter", with_flag("--model", p("moe_jitter.json")), "router_jitter_noise=0.01"),
        ("cuda graphs on the cpu", base + ["--cuda-graphs"],
         "[flags] --cuda-graphs needs a CUDA device (a graph records a GPU stream's work); the run is on cpu"),
        ("moe auxiliary loss with packed documents", with_flag("--model", p("moe_aux.json")) + ["--pack-documents"],
         "--pack-documents: " + p("moe_aux.json") + " has the mixture-of-experts auxiliary loss"),
        ("expert parallel on a dense model", compile_ep("ep_dense", "cfg.json", 2),
         "[strategy] expert_parallel=2 needs a model with mixture-of-experts layers"),
        ("expert parallel not dividing the experts", compile_ep("ep_experts", "moe_jitterless.json", 3),
         "[strategy] expert_parallel=3 does not divide the 4 experts"),
        ("expert parallel not dividing the slots", compile_ep("ep_slots", "moe_jitterless.json", 3),
         "[strategy] expert_parallel=2 does not divide the 3 token slots of sparse layer 0"),
        ("expert parallel with recompute", compile_ep("ep_recompute", "moe_jitterless.json", 2),
         "[strategy] pipeline 0 stage 0: recompute is not supported with expert_parallel=2"),
        ("expert group across uneven micro-batch counts", compile_ep("ep_micro", "moe_jitterless.json", 2),
         "whose micro_batches differ (2 vs 3)"),
        ("expert group across different stages under 1f1b", compile_ep("ep_1f1b", "moe_2layers.json", 3),
         "whose stages hold different layers: use \"schedule\": \"gpipe\""),
        ("expert placement leaves a member without experts", compile_ep("ep_orphan", "moe_jitterless.json", 2),
         "[strategy] expert_placement 0: member 1 holds no expert"),
        ("expert placement names a member outside the group", compile_ep("ep_member", "moe_jitterless.json", 2),
         "[strategy] expert_placement 0: expert 1: member 2 is outside [0, 2)"),
        ("expert weights in fewer groups than expert 0's", ["plan", "explain", p("ep_bad_plan.json")],
         "expert 1's weights are held by 1 subgroups and expert 0's by 2"),
        ("unknown command", ["frobnicate"], "frobnicate"),
        ("tokenize without inputs", ["tokenize", "--output", p("o.bin"), "--eos", "256"], "no input"),
        ("tokenize eos is a byte", ["tokenize", "--output", p("o.bin"), "--eos", "10", p("cfg.json")], "eos"),
        ("tokenize missing input", ["tokenize", "--output", p("o.bin"), "--eos", "256", p("nope.txt")], "nope.txt"),
    ]
    # An output that resolves to an input (the same inode: the same name, a
    # symbolic or a hard link), or to another output, is refused before
    # anything is written; the inputs stay byte for byte.
    with open(p("g.txt"), "w") as f:
        f.write("some text\n")
    os.symlink(p("data.bin"), p("data_link.bin"))
    os.link(p("data.bin"), p("data_hard.bin"))
    with open(p("strategy.json"), "w") as f:
        json.dump({"pipelines": [{"micro_batch_size": 1, "micro_batches": 2,
                                  "stages": [{"ranks": [0], "layers": [0, 1]}]}]}, f)
    os.mkfifo(p("fifo.svg"))  # an output opened for writing would block on it forever
    os.symlink(p("fifo.svg"), p("fifo_link.json"))
    with open(p("cluster.json"), "w") as f:
        json.dump({"catalog": {"H800": {"tflops": 990, "memory_gib": 80}}, "nodes": [{"type": "H800", "ranks": [0, 1]}]}, f)
    guarded = ["cfg.json", "data.bin", "g.txt", "strategy.json"]
    before = {n: open(p(n), "rb").read() for n in guarded}
    cases += [
        ("data stats --svg is the data", ["data", "stats", "--eos", "5", p("data.bin"), "--svg", p("data.bin")],
         "destroy that input"),
        ("data stats --svg via a symlink", ["data", "stats", "--eos", "5", p("data.bin"), "--svg", p("data_link.bin")],
         "destroy that input"),
        ("data stats --svg is --model", ["data", "stats", "--model", p("cfg.json"), p("data.bin"), "--svg", p("cfg.json")],
         "--model"),
        ("train --log is --data", base + ["--log", p("data.bin")], "destroy that input"),
        ("train --log is a hard link of --data", base + ["--log", p("data_hard.bin")], "--data"),
        ("train --save is --model", base + ["--save", p("cfg.json")], "--model"),
        ("train --trace is --data", base + ["--trace", p("data_link.bin")], "--trace"),
        ("train --dump-grads is --data", base + ["--dump-grads", p("data.bin")], "--dump-grads"),
        ("train --save is --init", base + ["--init", p("ok.safetensors"), "--save", p("ok.safetensors")], "--init"),
        ("train two outputs, one file", base + ["--log", p("x.jsonl"), "--trace", p("x.jsonl")], "another output"),
        ("tokenize --output is an input", ["tokenize", "--eos", "256", "--output", p("g.txt"), p("g.txt")],
         "destroy that input"),
        ("plan compile -o is --strategy", ["plan", "compile", "--model", p("cfg.json"), "--strategy",
                                           p("strategy.json"), "--world", "1", "-o", p("strategy.json")], "--strategy"),
        ("profile -o is --model", ["profile", "--model", p("cfg.json"), "-o", p("cfg.json")], "--model"),
        ("data stats --svg is a FIFO", ["data", "stats", "--eos", "5", p("data.bin"), "--svg", p("fifo.svg")],
         "is a FIFO"),
        ("train --log is a FIFO", base + ["--log", p("fifo.svg")], "is a FIFO"),
        # Every writer goes through the same output check (a FIFO, also
        # through a symbolic link, is refused before the work, not blocked on).
        ("plan compile -o is a FIFO", ["plan", "compile", "--model", p("cfg.json"), "--strategy",
                                       p("strategy.json"), "--world", "1", "-o", p("fifo.svg")], "is a FIFO"),
        ("plan compile -o links to a FIFO", ["plan", "compile", "--model", p("cfg.json"), "--strategy",
                                             p("strategy.json"), "--world", "1", "-o", p("fifo_link.json")],
         "is a FIFO"),
        ("plan search -o is a FIFO", ["plan", "search", "--model", p("cfg.json"), "--cluster", p("cluster.json"),
                                      "--global-batch", "2", "--seq-len", "16", "-o", p("fifo.svg")], "is a FIFO"),
        ("profile -o is a FIFO", ["profile", "--model", p("cfg.json"), "--seq-lens", "16", "--micro-batch-sizes",
                                  "1", "--repetitions", "1", "-o", p("fifo_link.json")], "is a FIFO"),
        ("plan compile -o is a directory", ["plan", "compile", "--model", p("cfg.json"), "--strategy",
                                            p("strategy.json"), "--world", "1", "-o", tmp], "is a directory"),
    ]
    # Issue 39 item 12: the flag the user gave is the one named. --lr -1 was
    # blamed on --min-lr ("--min-lr 0 must lie in [0, --lr -1]"); a missing
    # or unusable launch --python gave "rank 0 exited with code ?" after the
    # job started. A token file that is not whole uint32 ids is refused by
    # every reader.
    with open(p("s.py"), "w") as f:
        f.write("print('never run')\n")
    os.mkdir(p("pydir"))
    with open(p("one_layer.json"), "w") as f:
        json.dump({"pipelines": [{"micro_batch_size": 1, "micro_batches": 2,
                                  "stages": [{"ranks": [0], "layers": [0, 0]}]}]}, f)
    launch = ["launch", "--nproc", "1", "--python"]
    cases += [
        ("train --lr -1 names --lr", base + ["--lr", "-1"], "[flags] --lr must be positive, got -1"),
        ("train --lr nan names --lr", base + ["--lr", "nan"], "[flags] --lr must be a finite number, got nan"),
        ("train --min-lr above --lr", base + ["--lr", "0.01", "--min-lr", "0.1"],
         "[flags] --min-lr 0.1 must lie in [0, --lr 0.01]"),
        ("launch --python missing", launch + [p("no_python"), p("s.py")],
         "[flags] launch --python " + p("no_python") + ": No such file or directory"),
        ("launch --python not executable", launch + [p("g.txt"), p("s.py")],
         "[flags] launch --python " + p("g.txt") + ": is not executable"),
        ("launch --python a directory", launch + [p("pydir"), p("s.py")],
         "[flags] launch --python " + p("pydir") + ": is a directory"),
        ("launch --python not on PATH", launch + ["no-such-python-hspmd", p("s.py")],
         "[flags] launch --python no-such-python-hspmd: no executable of that name on PATH"),
        ("data stats of an odd token file", ["data", "stats", "--eos", "5", p("odd.bin")],
         p("odd.bin") + ": size 6 bytes is not a multiple of 4"),
        ("plan cost --lengths odd token file", ["plan", "cost", "--model", p("cfg.json"), "--strategy",
                                                p("one_layer.json"), "--cluster", p("cluster.json"), "--lengths",
                                                p("odd.bin"), "--batch-tokens", "32", "--max-seq-len", "16"],
         p("odd.bin") + ": size 6 bytes is not a multiple of 4"),
    ]
    # The valid baseline must succeed, or the cases below prove nothing.
    ok = subprocess.run([exe] + base + ["--init", p("ok.safetensors")], capture_output=True, text=True)
    failures = []
    if ok.returncode != 0:
        failures.append(f"baseline run failed: {ok.stderr.strip()}")
    for name, args, needle in cases:
        try:
            r = subprocess.run([exe] + args, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            print(f"{name:34s} FAIL (hung for 60 s)")
            failures.append(name + " (hung)")
            continue
        lines = r.stderr.strip().splitlines()
        problems = []
        if r.returncode == 0:
            problems.append("exit code 0")
        if len(lines) != 1:
            problems.append(f"{len(lines)} stderr lines")
        elif needle not in lines[0] or not lines[0].startswith("hspmd: "):
            problems.append(f"message does not name '{needle}'")
        status = "ok" if not problems else "FAIL (" + ", ".join(problems) + ")"
        print(f"{name:34s} {status}: {r.stderr.strip()[:160]}")
        if problems:
            failures.append(name)
    if os.path.exists(p("o.bin")):
        failures.append("tokenize wrote output despite an error")
    for n in guarded:
        if open(p(n), "rb").read() != before[n]:
            failures.append(f"input {n} was changed by a refused command")
    if os.path.exists(p("x.jsonl")):
        failures.append("a refused run wrote its --log")
    if failures:
        sys.exit("FAILED: " + ", ".join(failures))
    print("PASS")


if __name__ == "__main__":
    main()
