"""The Python Trainer as safe as `hspmd train` (docs/reliability.md, "The
Python Trainer"), in one process on copies of the tiny Llama's config and a
token file of 20,000 random ids:

1. an output (log=, save=, trace=, op_times=, dump_grads=) that is an input
   (the data, the model's config; by name or through a symbolic link) or
   another output is one hspmd.Error naming both, before anything is written;
   the inputs stay byte for byte;
2. save_checkpoint(dir) into another run's committed checkpoint is refused
   (as checkpoint= is), and so is a periodic save_every= checkpoint into a
   directory another run committed to after this one started; the other
   run's checkpoint stays; the run's own checkpoints, the one it resumed and
   checkpoint= with overwrite_checkpoint=True are written;
3. a failed load_checkpoint() (a missing directory, a file, a corrupt shard)
   is one hspmd.Error and the Trainer goes on with its run as it was (its
   weights and next step; the next steps train as if the call had not been
   made);
4. after finish(), step(), train(), switch_to(), load_state_dict() and
   load_checkpoint() are one hspmd.Error each and save= keeps finish()'s
   weights; finish() again does nothing; state_dict() still reads the run.

Each error is one line."""
import glob
import json
import os
import shutil
import sys
import tempfile

import numpy

import hspmd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "examples", "tiny-llama", "config.json")
RUN = dict(seq_len=32, global_batch=4, micro_batches=1, threads=1, lr=1e-2)


def raises(fn, *parts):
    try:
        fn()
    except hspmd.Error as e:
        msg = str(e)
        assert "\n" not in msg, f"not one line: {msg!r}"
        for p in parts:
            assert p in msg, f"{p!r} not in {msg!r}"
        return msg
    raise AssertionError(f"no hspmd.Error (expected {parts!r})")


def trainer(m, d, steps=4, **kw):
    return hspmd.Trainer(m, None, d, steps=steps, **dict(RUN, **kw))


def snapshot(paths):
    out = {}
    for p in paths:
        with open(p, "rb") as f:
            out[p] = f.read()
    return out


def check_outputs_apart(m, d, tmp):
    """1. No output is an input or another output."""
    inputs = snapshot([m, d])
    link = os.path.join(tmp, "link-to-data.bin")
    os.symlink(d, link)
    cases = [(flag, target, what) for flag in ("log", "save", "trace", "op_times", "dump_grads")
             for target, what in ((d, "data"), (m, "model"))]
    cases.append(("log", link, "data"))
    for flag, target, what in cases:
        def run():
            t = trainer(m, d, steps=1, **{flag: target})
            t.train()  # before the fix: the input is written over here (or already at setup)
        raises(run, f"{flag} {target}: is the same file as {what} ",
               "writing it would destroy that input")
        assert snapshot([m, d]) == inputs, f"{flag}={target}: an input changed"
    out = os.path.join(tmp, "both.json")
    raises(lambda: trainer(m, d, steps=1, log=out, trace=out), f"trace {out}: is the same file as log {out}",
           "another output")
    assert not os.path.exists(out), "a refused run wrote an output"


def index_of(ck):
    with open(os.path.join(ck, "index.json")) as f:
        return json.load(f)


def files_of(ck):
    return {os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(os.path.join(ck, "*")))}


def check_checkpoint_owner(m, d, tmp):
    """2. A run writes over its own checkpoints and the one it resumed only."""
    ck_a = os.path.join(tmp, "ckA")
    a = trainer(m, d)
    a.step(), a.step()
    a.save_checkpoint(ck_a)
    kept = files_of(ck_a)
    assert index_of(ck_a)["step"] == 2
    b = trainer(m, d)
    b.step()
    raises(lambda: b.save_checkpoint(ck_a), f"[checkpoint] save_checkpoint {ck_a}: holds the committed checkpoint "
           "of step 2 of another run", "give another directory")
    assert files_of(ck_a) == kept, "another run's checkpoint changed"
    b.step()  # B goes on
    ck_b = os.path.join(tmp, "ckB")
    b.save_checkpoint(ck_b)
    b.step()
    b.save_checkpoint(ck_b)  # its own: replaced
    assert index_of(ck_b)["step"] == 3
    raises(lambda: trainer(m, d, checkpoint=ck_a), f"[options] checkpoint {ck_a}: holds the committed checkpoint "
           "of step 2 of another run; give resume")

    # The checkpoint a run resumed is its to continue, as --resume D --checkpoint D.
    ck_c = os.path.join(tmp, "ckC")
    shutil.copytree(ck_a, ck_c)
    c = trainer(m, d)
    c.load_checkpoint(ck_c)
    c.step()
    c.save_checkpoint(ck_c)
    assert index_of(ck_c)["step"] == 3
    # checkpoint= with overwrite_checkpoint=True replaces another run's there.
    ck_d = os.path.join(tmp, "ckD")
    shutil.copytree(ck_a, ck_d)
    o = trainer(m, d, checkpoint=ck_d, overwrite_checkpoint=True)
    o.step()
    o.save_checkpoint(ck_d)
    assert index_of(ck_d)["step"] == 1

    # The periodic writer: another run commits into checkpoint= after this
    # run started; this run's next save refuses to replace it.
    ck_e = os.path.join(tmp, "ckE")
    e = trainer(m, d, checkpoint=ck_e, save_every=1, checkpoint_sync=True)
    e.step()
    assert index_of(ck_e)["step"] == 1
    shutil.rmtree(ck_e)
    a.save_checkpoint(ck_e)  # run A's, at step 2
    kept = files_of(ck_e)
    raises(e.step, f"[checkpoint] checkpoint {ck_e}: holds the committed checkpoint of step 2 of another run")
    assert files_of(ck_e) == kept, "another run's checkpoint changed"


def same_weights(x, y):
    return sorted(x) == sorted(y) and all(numpy.array_equal(x[k], y[k]) for k in x)


def check_failed_load(m, d, tmp):
    """3. A failed load_checkpoint() leaves the Trainer as it was."""
    ref = trainer(m, d)
    want = [ref.step() for _ in range(4)]
    t = trainer(m, d)
    t.step(), t.step()
    good = os.path.join(tmp, "ck-good")
    t.save_checkpoint(good)
    bad = os.path.join(tmp, "ck-corrupt")
    shutil.copytree(good, bad)
    shard = sorted(glob.glob(os.path.join(bad, "*.safetensors")))[0]
    with open(shard, "r+b") as f:  # one byte of tensor data flipped
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    a_file = os.path.join(tmp, "not-a-dir")
    with open(a_file, "w") as f:
        f.write("x")
    before = t.state_dict()
    for target in (os.path.join(tmp, "missing"), a_file, bad):
        raises(lambda: t.load_checkpoint(target), "[")
        assert t.next_step == 2 and not t.done, (target, t.next_step)
        assert same_weights(t.state_dict(), before), f"load_checkpoint({target}) changed the weights"
    got = [t.step(), t.step()]
    for w, g in zip(want[2:], got):
        assert (w["step"], w["loss"], w["grad_norm"]) == (g["step"], g["loss"], g["grad_norm"]), (w, g)
    t.finish()


def check_after_finish(m, d, tmp):
    """4. Calls after finish() are refused; save= keeps finish()'s weights."""
    save = os.path.join(tmp, "final.safetensors")
    ck = os.path.join(tmp, "ck-fin")
    t = trainer(m, d, steps=3, save=save)
    t.step()
    t.save_checkpoint(ck)
    t.finish()
    saved = open(save, "rb").read()
    weights = t.state_dict()
    calls = [("step()", t.step), ("train()", t.train), ("switch_to()", lambda: t.switch_to({"pipelines": []})),
             ("load_state_dict()", lambda: t.load_state_dict(weights)),
             ("load_checkpoint()", lambda: t.load_checkpoint(ck))]
    for name, call in calls:
        raises(call, f"[train] Trainer.{name}: called after finish()")
    t.finish()  # once: nothing again
    assert open(save, "rb").read() == saved, "save= changed after finish()"
    assert same_weights(t.state_dict(), weights), "the weights changed after finish()"
    assert t.next_step == 1
    # The library's run refuses the same (every way in).
    raises(t._run.step, "[train] step: the run has finished")
    raises(t._run.finish, "[train] finish: the run has finished")
    with hspmd.Trainer(m, None, d, steps=2, **RUN) as w:
        w.train()  # train() finishes, and the with block's finish() does nothing


def main():
    parts = sys.argv[1:] or ["apart", "owner", "load", "finish"]  # a part alone: e.g. `... load`
    with tempfile.TemporaryDirectory() as tmp:
        m = os.path.join(tmp, "m.json")
        shutil.copy(MODEL, m)
        d = os.path.join(tmp, "d.bin")
        numpy.random.default_rng(0).integers(0, 256, 20000, dtype=numpy.uint32).astype("<u4").tofile(d)
        checks = {"apart": check_outputs_apart, "owner": check_checkpoint_owner, "load": check_failed_load,
                  "finish": check_after_finish}
        for part in parts:
            checks[part](m, d, tmp)
    print("ok")


if __name__ == "__main__":
    main()
