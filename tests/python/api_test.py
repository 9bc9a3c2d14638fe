"""The Python module's values against the C++ core and the command line:
annotations print the paper's notation and are checked by the C++ rules;
models.from_hf reads every registered family; strategies round-trip;
compile_plan, Plan.explain, plan_cost and plan_search give what `hspmd plan
compile / explain / cost / search` give; every error is hspmd.Error with the
command line's one-line message."""
import argparse
import json
import os
import subprocess
import tempfile
import threading

import hspmd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "examples", "tiny-llama", "config.json")
STRATEGY = os.path.join(ROOT, "examples", "python", "tiny_hetero_4.json")


def raises(fn, prefix):
    try:
        fn()
    except hspmd.Error as e:
        assert str(e).startswith(prefix), f"message {str(e)!r} does not start with {prefix!r}"
        assert "\n" not in str(e), f"not one line: {str(e)!r}"
        return str(e)
    raise AssertionError(f"no hspmd.Error (expected {prefix!r})")


def check_annotations():
    ds = hspmd.DS({0: 2, hspmd.DUP: 2})
    assert repr(ds) == "DS{dup:2, split(0):2} order [split(0), dup]", repr(ds)
    assert ds.order == [0, hspmd.DUP] and ds.device_count == 4 and ds.degree(hspmd.PARTIAL) == 1
    assert hspmd.DS({0: 2, -1: 2}, order=[-1, 0]) != ds
    raises(lambda: hspmd.DS({0: 2}, order=[1]), "[annotation] DS: order lists split(1)")
    dsu = hspmd.DSUnion([hspmd.DS({1: 2}), hspmd.DS()], hetero_dim=0, part_weights=[3, 1])
    dgu = hspmd.DGUnion([[0, 1], [2]])
    assert dsu.hsize == dgu.hsize == 2
    a = hspmd.annotation(dgu, dsu)
    assert repr(a) == "hdim 0: [0,1] {split(1):2} order [split(1)]; [2] {} order []; weights [3, 1]", repr(a)
    assert a.hsize == 2 and a.ranks == [0, 1, 2] and a.groups[0] == hspmd.DeviceGroup([0, 1])
    a.validate(world_size=3, tensor_rank=2, name="w")
    assert a.local_box([8, 4], 1) == ([0, 2], [6, 4]) and a.local_box([8, 4], 2) == ([6, 0], [8, 4])
    assert a.local_box([8, 4], 5) is None
    assert hspmd.Annotation.from_json(a.to_json()) == a
    bad = hspmd.annotation(hspmd.DGUnion([[0, 1], [1]]), hspmd.DSUnion([hspmd.DS({0: 2}), hspmd.DS()]))
    raises(lambda: bad.validate(world_size=2, tensor_rank=2, name="w"), "[annotation] tensor 'w'")
    raises(lambda: hspmd.annotation(dgu, [hspmd.DS()]), "[annotation] DGUnion of 2 device groups")


def check_deduce():
    g = hspmd.DGUnion([[0, 1], [2]])
    rows = hspmd.DSUnion  # the batch cut 2:1 between the subgroups (hetero dim 0)

    def on(first, hetero_dim=hspmd.DUP, weights=()):
        return hspmd.annotation(g, rows([hspmd.DS(first), hspmd.DS()], hetero_dim=hetero_dim, part_weights=weights))

    want = "hdim 0: [0,1] {%s:2} order [%s]; [2] {} order []; weights [2, 1]"
    x = [6, 4]
    cases = [({0: 2}, {hspmd.DUP: 2}, "split(0)"),      # data parallel
             ({hspmd.DUP: 2}, {1: 2}, "split(1)"),      # column parallel
             ({1: 2}, {0: 2}, "partial")]               # row parallel: partial sums
    for xs, ws, key in cases:
        out = hspmd.deduce("matmul", [(x, on(xs, 0, [2, 1])), ([4, 8], on(ws))])
        assert repr(out) == want % (key, key), repr(out)
    lone = hspmd.annotation(hspmd.DGUnion([[0, 1]]), hspmd.DSUnion([hspmd.DS({0: 2})]))
    raises(lambda: hspmd.deduce("add", [(x, on({0: 2}, 0, [2, 1])), (x, lone)]),
           "[deduce] op 'add' (node 2): inputs 0 and 1 live on different subgroups")
    raises(lambda: hspmd.deduce("conv", []), "[deduce] op 'conv': not available from Python yet")
    raises(lambda: hspmd.deduce("add", [(x, lone)]), "[deduce] op 'add' takes 2 inputs, got 1")


def check_models():
    tiny = json.load(open(MODEL))
    assert hspmd.models.families() == ["hspmd_custom", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe"], hspmd.models.families()
    for family in hspmd.models.families():
        if family == "hspmd_custom":  # needs a program (tests/python/custom_model_test.py)
            raises(lambda: hspmd.models.from_hf(dict(tiny, model_type=family)),
                   "[config] config: model_type hspmd_custom needs a 'program'")
            continue
        m = hspmd.models.from_hf(dict(tiny, model_type=family))
        assert m.model_type == family and os.path.exists(m.path)
        assert m.config.num_hidden_layers == 4
        names = [p[0] for p in m.parameters()]
        assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" in names
        assert any(n.endswith("q_proj.bias") for n in names) == family.startswith("qwen2"), family
        # The mixture-of-experts families' defaults: 8 experts (Mixtral), 60 and a shared expert (Qwen2-MoE).
        experts = {n.split(".experts.")[1].split(".")[0] for n in names if ".experts." in n}
        assert len(experts) == {"mixtral": 8, "qwen2_moe": 60}.get(family, 0), (family, len(experts))
        assert any("shared_expert_gate" in n for n in names) == (family == "qwen2_moe"), family
    m = hspmd.models.from_hf(MODEL)
    assert m.path == MODEL and m.to_dict()["hidden_size"] == 128
    raises(lambda: hspmd.models.from_hf(dict(tiny, model_type="gpt2")), "[config] config: model_type 'gpt2'")
    raises(lambda: hspmd.models.from_hf("/nonexistent/config.json"), "[config]")


def check_strategies(hspmd_cli, d):
    s = hspmd.Strategy.from_json(STRATEGY)
    assert s.global_batch == 8 and s.world_size == 4 and s.ranks == [0, 1, 2, 3]
    assert hspmd.Strategy.from_json(s.to_json()) == s
    assert hspmd.Strategy.from_json(json.dumps(s.to_json())) == s
    raises(lambda: hspmd.Strategy.from_json({"pipelines": 3}), "[strategy]")
    raises(lambda: hspmd.compile_plan(MODEL, s, 3), "[strategy]")

    plan = hspmd.compile_plan(MODEL, s, 4, seq_len=64)
    out = os.path.join(d, "plan.json")
    subprocess.run([hspmd_cli, "plan", "compile", "--model", MODEL, "--strategy", STRATEGY, "--world", "4",
                    "--seq-len", "64", "-o", out], check=True, capture_output=True)
    assert plan.to_json() == json.load(open(out)), "compile_plan differs from hspmd plan compile"
    assert plan.strategy == s and plan.world_size == 4
    assert plan.tensors["model.norm.weight"].hsize == 2
    # Expert parallelism (docs/moe.md): 4 experts over groups of 2 of the 4
    # single-rank pipelines; expert 3 lives on the second member of each group.
    moe = hspmd.models.from_hf(dict(json.load(open(MODEL)), model_type="mixtral", num_local_experts=4))
    ep = hspmd.Strategy.from_json({"expert_parallel": 2, "pipelines": [
        {"micro_batch_size": 1, "micro_batches": 2, "stages": [{"ranks": [r], "layers": [0, 3]}]} for r in range(4)]})
    assert ep.expert_parallel == 2 and s.expert_parallel == 1 and hspmd.Strategy.from_json(ep.to_json()) == ep
    ep_plan = hspmd.compile_plan(moe, ep, 4, seq_len=64)
    owners = ep_plan.tensors["model.layers.2.block_sparse_moe.experts.3.w2.weight"]
    assert [g.ranks for g in owners.groups] == [[1], [3]], owners
    raises(lambda: hspmd.compile_plan(moe, hspmd.Strategy.from_json(dict(ep.to_json(), expert_parallel=3)), 4),
           "[strategy] expert_parallel=3 does not divide the 4 experts")
    for rank in (None, 3):
        flags = [] if rank is None else ["--rank", str(rank)]
        cli = subprocess.run([hspmd_cli, "plan", "explain", out, *flags], check=True, capture_output=True, text=True)
        assert plan.explain(rank=rank) == cli.stdout, f"explain(rank={rank}) differs from hspmd plan explain"
    assert plan.explain(rank=0, json_output=True)["rank"] == 0
    raises(lambda: plan.explain(rank=9), "[flags] --rank 9 is outside the plan's world of 4 ranks")
    assert hspmd.Plan.from_json(out).to_json() == plan.to_json()

    cluster = os.path.join(d, "cluster.json")
    json.dump({"catalog": {"gpu": {"tflops": 100, "memory_gib": 80, "intra_node_gbps": 100, "inter_node_gbps": 25}},
               "nodes": [{"type": "gpu", "ranks": [0, 3]}]}, open(cluster, "w"))
    cost = hspmd.plan_cost(MODEL, s, cluster, seq_len=64)
    cli = subprocess.run([hspmd_cli, "plan", "cost", "--model", MODEL, "--strategy", STRATEGY, "--cluster", cluster,
                          "--seq-len", "64", "--json"], check=True, capture_output=True, text=True)
    assert cost == json.loads(cli.stdout), "plan_cost differs from hspmd plan cost --json"
    found = hspmd.plan_search(MODEL, cluster, global_batch=8, seq_len=64, time_limit=20, tp=[1, 2])
    assert isinstance(found["strategy"], hspmd.Strategy) and found["strategy"].global_batch == 8
    # Expert parallelism through the planner: every strategy it reports runs it, priced by the cost model.
    found = hspmd.plan_search(moe, cluster, global_batch=8, seq_len=64, time_limit=20, expert_parallel=2)
    assert found["strategy"].expert_parallel == 2, found["strategy"]
    ep_cost = hspmd.plan_cost(moe, found["strategy"], cluster, seq_len=64)
    replicated = hspmd.plan_cost(moe, dict(found["strategy"].to_json(), expert_parallel=1), cluster, seq_len=64)
    assert ep_cost["ranks"][0]["memory_gib"] < replicated["ranks"][0]["memory_gib"], (ep_cost, replicated)
    raises(lambda: hspmd.plan_search(MODEL, cluster, global_batch=8, seq_len=64, schedule="zigzag"), "[")


def check_trainer_errors(d):
    data = os.path.join(d, "none.bin")
    raises(lambda: hspmd.Trainer(MODEL, None, data, seq_len=64, steps=1, global_batch=8, bogus=1),
           "[options] unknown training option 'bogus'")
    raises(lambda: hspmd.Trainer(MODEL, None, data, optimizer="sgd", seq_len=64, steps=1, global_batch=8),
           "[options] optimizer: unknown optimizer 'sgd'")
    raises(lambda: hspmd.Trainer(MODEL, None, data, seq_len=64, steps=1, global_batch=8, beta2=1.0),
           "[options] beta2 must lie in [0, 1), got 1")
    # A device that cannot be used, on any machine: one line naming it.
    raises(lambda: hspmd.Trainer(MODEL, None, data, device="cuda:99", seq_len=64, steps=1, global_batch=8),
           "[device] cuda:99: ")
    raises(lambda: hspmd.Trainer(MODEL, None, data, device="tpu", seq_len=64, steps=1, global_batch=8),
           "[options] device: 'tpu' (expected cpu, cuda or cuda:N)")
    raises(lambda: hspmd.Trainer(MODEL, STRATEGY, data, seq_len=64, steps=1), "[")  # 4 ranks on a world of 1
    # The emulated clock has no communication thread: overlap=True is refused.
    raises(lambda: hspmd.Trainer(MODEL, None, data, seq_len=64, steps=1, global_batch=8, overlap=True,
                                 cluster=os.path.join(d, "none.json")),
           "[options] overlap with cluster: the emulated clock")
    raises(lambda: hspmd.Trainer(MODEL, None, data, seq_len=64, steps=1, global_batch=8), "[data]")
    # Keywords the options schema gives Python beside the command line's flags, their rules from the
    # same validate(), named as keywords (no "--" anywhere in the message).
    for kwargs, want in (({"dispatch": "fastest"}, "[options] dispatch must be cost or symmetric, got 'fastest'"),
                         ({"batch_tokens": 0}, "[options] batch_tokens must be positive, got 0"),
                         ({"clock": "model"}, "[options] clock model needs cluster"),
                         ({"save_every": 2}, "[options] save_every needs checkpoint DIR"),
                         ({"warmup_steps": -1}, "[options] warmup_steps must be >= 0, got -1")):
        try:
            hspmd.Trainer(MODEL, None, data, seq_len=64, steps=1, global_batch=8, **kwargs)
        except hspmd.Error as e:
            assert str(e).startswith(want) and "--" not in str(e), f"{kwargs}: {e}"
        else:
            raise AssertionError(f"{kwargs}: accepted")


def check_unclear_inputs(d):
    """Bytes that are not UTF-8 in a JSON input, a cut JSON text and option
    values of the wrong type: each one hspmd.Error whose one-line message
    names the input (undecodable bytes as \\xNN), never an empty message, a
    bare JSON-library error or a pybind11 cast error naming no argument."""
    bad = os.path.join(d, "latin1.json")
    with open(bad, "wb") as f:
        f.write(b'{"description": "caf\xe9 \xff"}')
    for fn, prefix in ((lambda: hspmd.Strategy.from_json(bad), f"[strategy] {bad}: not valid JSON"),
                       (lambda: hspmd.models.from_hf(bad), f"[config] {bad}: not valid JSON"),
                       (lambda: hspmd.Plan.from_json(bad), f"[plan] {bad}: not valid JSON"),
                       (lambda: hspmd.Strategy.from_json(b'{"a": "\xff"}'), "[python] strategy: malformed JSON"),
                       (lambda: hspmd.Plan.from_json(b"\xff"), "[python] plan: malformed JSON")):
        assert "\\x" in raises(fn, prefix), prefix
    raises(lambda: hspmd.Annotation.from_json("{"), "[annotation] tensor 'tensor': not valid JSON")
    raises(lambda: hspmd.Annotation.from_json("[1", name="w"), "[annotation] tensor 'w': not valid JSON")
    data = os.path.join(d, "ids.bin")
    with open(data, "wb") as f:
        f.write(bytes(4 * 4096))
    run = dict(seq_len=32, steps=1, global_batch=4)
    for flag, value, want in (("seq_len", "abc", "[options] seq_len='abc': must be an integer in [-2^63, 2^63), got str"),
                              ("seq_len", 32.7, "[options] seq_len=32.7: must be an integer in [-2^63, 2^63), got float"),
                              ("seq_len", 2**64, "[options] seq_len=18446744073709551616: must be an integer"),
                              ("threads", 2**40, "[options] threads=1099511627776: must be an integer in [-2^31, 2^31)"),
                              ("device", 1, "[options] device=1: must be a string, got int"),
                              ("log", 1, "[options] log=1: must be a string, got int"),
                              ("lr", "x", "[options] lr='x': must be a number, got str"),
                              ("pack_documents", "yes", "[options] pack_documents='yes': must be True or False, got str")):
        raises(lambda: hspmd.Trainer(MODEL, None, data, **dict(run, **{flag: value})), want)
    import pathlib  # paths as os.PathLike, as the data argument always took them
    log = pathlib.Path(d) / "ids.jsonl"
    hspmd.Trainer(MODEL, None, pathlib.Path(data), log=log, threads=1, **run).train()
    assert len(log.read_text().splitlines()) == 1


def check_refused_arguments(d):
    """Issue 39 item 12, the rest: each bad argument is hspmd.Error whose one
    line names the argument and the rule, never a pybind11 cast error naming
    no argument, Python's own TypeError, an InternalError ("check failed")
    from user input, nor a value accepted that no rule allows."""
    ok = hspmd.annotation(hspmd.DGUnion([[0, 1]]), hspmd.DSUnion([hspmd.DS({0: 2})]))
    broken = hspmd.Annotation([hspmd.DeviceGroup([0, 1, 2, 3])], [hspmd.DS({0: 2})])  # 2 != 4 ranks
    for fn, prefix in (
            (lambda: hspmd.DS({0: 2**40}), "[annotation] DS: degree of split(0) 1099511627776 is outside [1, 1048576]"),
            (lambda: hspmd.DS({"a": 2}), "[annotation] DS: key must be an integer, got str 'a'"),
            (lambda: hspmd.DS({0: 2.5}), "[annotation] DS: degree of split(0) must be an integer, got float"),
            (lambda: hspmd.DS({-7: 2}), "[annotation] DS: key -7 is not a key (split dims are >= 0"),
            (lambda: hspmd.DS({0: 1024, 1: 2048}), "[annotation] DS: degrees multiply to more than the largest world"),
            (lambda: hspmd.DS([0, 2]), "[annotation] DS: degrees must be a dict {key: degree}"),
            (lambda: hspmd.DS({0: 2}, order=["x"]), "[annotation] DS: order[0] must be an integer, got str"),
            (lambda: hspmd.DS({0: 2}).degree("x"), "[annotation] DS.degree: key must be an integer"),
            (lambda: hspmd.DeviceGroup([0, 2**40]), "[annotation] DeviceGroup: ranks[1] 1099511627776 is outside"),
            (lambda: hspmd.DeviceGroup([-1]), "[annotation] DeviceGroup: ranks[0] -1 is outside [0, 1048575]"),
            (lambda: hspmd.DeviceGroup(3), "[annotation] DeviceGroup: ranks must be a list of integers, got int"),
            (lambda: hspmd.DGUnion([3]), "[annotation] DeviceGroup: ranks must be a list of integers, got int"),
            (lambda: hspmd.Annotation([[0, 1]], [hspmd.DS({0: 2})], hetero_dim=-7),
             "[annotation] Annotation: hetero_dim -7 is neither -2 (PARTIAL), -1 (DUP) nor a tensor dim"),
            (lambda: hspmd.annotation(hspmd.DGUnion([[0, 1]]), hspmd.DSUnion([hspmd.DS({0: 2})], hetero_dim=-7)),
             "[annotation] Annotation: hetero_dim -7"),
            (lambda: hspmd.Annotation([[0, 1]], [hspmd.DS()], hetero_dim="0"),
             "[annotation] Annotation: hetero_dim must be an integer, got str"),
            (lambda: hspmd.Annotation([[0], [1]], [hspmd.DS(), hspmd.DS()], 0, [3, 0]),
             "[annotation] Annotation: part_weights[1] 0 is outside [1, "),
            (lambda: hspmd.Annotation([[0, 1]], [1]), "[annotation] Annotation: states[0] must be a DS, got int"),
            (lambda: hspmd.Annotation(5, [hspmd.DS()]), "[annotation] Annotation: groups must be a list of"),
            (lambda: ok.local_box([-8, 4], 0), "[annotation] local_box: shape[0] -8 is outside [0, "),
            (lambda: ok.local_box([8, "4"], 0), "[annotation] local_box: shape[1] must be an integer, got str"),
            (lambda: ok.local_box([8, 4], 2**40), "[annotation] local_box: rank 1099511627776 is outside"),
            (lambda: broken.local_box([8, 4], 3),  # was InternalError "check failed: rest == 0"
             "[annotation] tensor 'tensor': subgroup 0: degrees multiply to 2 but the device group has 4 ranks"),
            (lambda: broken.local_box([8, 4], 0, name="w"), "[annotation] tensor 'w': subgroup 0: degrees multiply"),
            (lambda: ok.validate(world_size=2**40, tensor_rank=2), "[annotation] validate: world_size 1099511627776"),
            (lambda: hspmd.deduce("add", 5), "[deduce] inputs must be a list of (shape, Annotation) pairs, got int"),
            (lambda: hspmd.deduce("add", [([4, 4], ok), ([4, -4], ok)]), "[deduce] inputs[1] shape[1] -4 is outside"),
            (lambda: hspmd.deduce("transpose", [([4, 4], ok)], dim0="x"),
             "[deduce] attribute dim0 must be an integer, got str"),
            (lambda: hspmd.Strategy.from_json(1), "[python] Strategy.from_json(): value=1: must be a dict"),
            (lambda: hspmd.Plan.from_json(None), "[python] Plan.from_json(): value=None: must be a dict"),
            (lambda: hspmd.models.from_hf(1), "[python] models.from_hf(): config=1: must be a config.json path")):
        raises(fn, prefix)
    assert ok.local_box([8, 4], 1) == ([4, 0], [8, 4])  # the valid ones still work

    # The learning rates: the user's own argument named (lr=-1 blamed min_lr).
    data = os.path.join(d, "refused.bin")
    with open(data, "wb") as f:
        f.write(bytes(4 * 4096))
    run = dict(seq_len=32, steps=40, global_batch=8, threads=1)
    for flags, want in (({"lr": -1}, "[options] lr must be positive, got -1"),
                        ({"lr": 0}, "[options] lr must be positive, got 0"),
                        ({"lr": float("nan")}, "[options] lr must be a finite number, got nan"),
                        ({"lr": 0.1, "min_lr": 1}, "[options] min_lr 1 must lie in [0, lr 0.1]"),
                        ({"min_lr": -1}, "[options] min_lr -1 must lie in [0, lr ")):
        raises(lambda: hspmd.Trainer(MODEL, None, data, **dict(run, **flags)), want)

    # A token file whose size is not a multiple of 4 is refused wherever it
    # is read (its last bytes were said to be dropped without a word).
    odd = os.path.join(d, "odd.bin")
    with open(odd, "wb") as f:
        f.write(bytes(4 * 4096 + 2))
    rule = f"[data] {odd}: size 16386 bytes is not a multiple of 4 (uint32 token ids)"
    raises(lambda: hspmd.Trainer(MODEL, None, odd, **run), rule)
    cluster = os.path.join(d, "refused_cluster.json")
    json.dump({"catalog": {"cpu": {"tflops": 1, "memory_gib": 16}}, "nodes": [{"type": "cpu", "ranks": [0, 3]}]},
              open(cluster, "w"))
    raises(lambda: hspmd.plan_cost(MODEL, STRATEGY, cluster, lengths=odd, batch_tokens=64, max_seq_len=32), rule)

    # Paths of the wrong type: hspmd.Error naming the argument (was Python's
    # TypeError from os.fspath).
    t = hspmd.Trainer(MODEL, None, data, **run)
    raises(lambda: t.save_checkpoint(1), "[train] Trainer.save_checkpoint(): directory=1: must be a path")
    raises(lambda: t.load_checkpoint(1), "[train] Trainer.load_checkpoint(): directory=1: must be a path")
    raises(lambda: t.switch_to(1), "[train] Trainer.switch_to(): target=1: must be a Strategy, its dict, a Plan")
    raises(lambda: t.switch_to(None), "[train] Trainer.switch_to(): target=None: must be a Strategy")

    # Two threads in step() at once: the second is refused (was InternalError
    # from the run's own checks), the first goes on, no step is lost or run twice.
    def race(second):
        out, barrier = [], threading.Barrier(2)

        def call(fn):
            barrier.wait()
            try:
                out.append(("ok", fn()))
            except BaseException as e:  # noqa: BLE001 -- any other kind is a failure
                out.append((type(e).__name__, str(e)))
        threads = [threading.Thread(target=call, args=(fn,)) for fn in (t.step, second)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return out

    refused = {"step()": 0, "load_state_dict()": 0}
    weights = t.state_dict()
    for attempt in range(12):
        for name, second in (("step()", t.step), ("load_state_dict()", lambda: t.load_state_dict(weights))):
            for kind, value in race(second):
                if kind == "ok":
                    continue
                assert kind == "Error", f"{kind}: {value}"
                assert value.startswith((f"[train] Trainer.{name}: another thread is in step() of this Trainer",
                                         f"[train] Trainer.step(): another thread is in {name} of this Trainer")), value
                assert "\n" not in value, value
                refused[name] += 1
    assert refused["step()"] > 0, "two threads in step() were never refused"
    steps = [r["step"] for r in t.records]
    assert steps == list(range(len(steps))) and t.next_step == len(steps), steps
    t.step()  # the Trainer goes on
    t.finish()


def check_trainer_state(hspmd_cli, d):
    data = os.path.join(d, "corpus.bin")
    with open(os.path.join(d, "doc.txt"), "w") as f:
        f.write("the quick brown fox jumps over the lazy dog. " * 400)
    subprocess.run([hspmd_cli, "tokenize", "--model", MODEL, "--output", data, os.path.join(d, "doc.txt")],
                   check=True, capture_output=True)
    ops = os.path.join(d, "ops.json")
    t = hspmd.Trainer(MODEL, None, data, seq_len=32, steps=4, global_batch=4, micro_batches=2, threads=1, lr=1e-2,
                      op_times=ops)
    first = [t.step() for _ in range(2)]
    t.save_checkpoint(os.path.join(d, "ck"))
    before = t.state_dict()
    later = [t.step() for _ in range(2)]
    assert t.done and [r["step"] for r in first + later] == [0, 1, 2, 3]
    raises(t.step, "[train] step 4: the run has trained its 4 steps already")
    t.load_checkpoint(os.path.join(d, "ck"))
    assert t.next_step == 2 and not t.done
    restored = t.state_dict()
    assert sorted(restored) == sorted(before) and all((restored[k] == before[k]).all() for k in before)
    again = t.train()
    assert [(r["loss"], r["grad_norm"]) for r in again] == [(r["loss"], r["grad_norm"]) for r in later]
    assert restored["model.embed_tokens.weight"].shape == (320, 128)
    times = json.load(open(ops))  # op_times: the last step's ops by type
    assert times["step"] == 3 and "matmul" in [o["type"] for o in times["ops"]], times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hspmd", required=True)
    a = ap.parse_args()
    check_annotations()
    check_deduce()
    check_models()
    with tempfile.TemporaryDirectory() as d:
        check_strategies(a.hspmd, d)
        check_trainer_errors(d)
        check_unclear_inputs(d)
        check_refused_arguments(d)
        check_trainer_state(a.hspmd, d)
    print("ok")


if __name__ == "__main__":
    main()
