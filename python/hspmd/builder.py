"""hspmd.models.Builder: a model of one's own, written from one device's point
of view (docs/python.md, "Custom models").

The builder records parameters (with their tensor-parallel role) and ops into
the program of model_type "hspmd_custom" (docs/models.md): the C++ family
builds the graph from it with the engine's own ops, so the plan compiler,
deduction, the resolver and every executor take it like a built-in family.
Layouts are given only at the Reshard points (`mark`, with a kind the plan
compiler knows); deduction derives every other tensor's.

    b = Builder(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4)
    wte = b.parameter("wte.weight", ["vocab", 64], role="vocabulary", part="embedding")
    with b.embedding() as e:
        e.output(e.mark(e.embedding(wte, e.input_ids), "embedding_output", "wte.out"))
    with b.block() as blk:                       # one block; {i} is the layer
        ...
        blk.output(h)
    with b.head() as hd:
        ...
        hd.output(hd.cross_entropy(logits, hd.targets, hd.normalizer))
    model = b.build()                            # an hspmd.models.Model
"""
import copy

LAYER = "{i}"
ROLES = ("column", "row", "vocabulary", "replicated")
KINDS = ("embedding_output", "block_input", "positions", "sublayer_input", "sublayer_output", "head_input",
         "tied_head")


class Tensor:
    """A tensor of the program: a name in its part (or a graph input or a
    parameter). Arithmetic records ops in the part that is open."""

    def __init__(self, builder, name):
        self._builder = builder
        self.name = name

    def _part(self):
        return self._builder._open_part()

    def __add__(self, other):
        return self._part().add(self, other)

    def __mul__(self, other):
        return self._part().mul(self, other)

    def reshape(self, *shape):
        return self._part().reshape(self, list(shape[0]) if len(shape) == 1 and isinstance(shape[0], (list, tuple))
                                    else list(shape))

    def transpose(self, dim0, dim1):
        return self._part().transpose(self, dim0, dim1)

    def cast(self, dtype):
        return self._part().cast(self, dtype)

    def __repr__(self):
        return f"Tensor({self.name})"


class Parameter(Tensor):
    """A parameter: its name (with {i} in a block), shape ("vocab" for the
    vocabulary dim), role, init and part."""

    def __init__(self, builder, name, shape, role, init, part):
        super().__init__(builder, name)
        self.shape, self.role, self.init, self.part = list(shape), role, init, part

    def to_dict(self):
        return {"name": self.name, "shape": self.shape, "role": self.role, "init": self.init, "part": self.part}

    def __repr__(self):
        return f"Parameter({self.name}, {self.shape}, {self.role}, {self.part})"


class Part:
    """The ops of the embedding, of one block or of the head, while it is
    open (`with builder.block() as blk:`). Every op returns a Tensor; `name=`
    names its output (else t0, t1, ...)."""

    def __init__(self, builder, kind):
        self._builder, self.kind = builder, kind
        self._ops, self._output, self._count = [], None, 0
        self.input_ids, self.targets, self.positions, self.normalizer = (
            Tensor(builder, n) for n in ("input_ids", "targets", "positions", "normalizer"))
        self.input = Tensor(builder, "input") if kind != "embedding" else None

    def __enter__(self):
        self._builder._enter(self)
        return self

    def __exit__(self, kind, value, traceback):
        self._builder._exit(self, kind is None)
        return False

    def parameter(self, name, shape, role="replicated", init=None):
        """A parameter of this part (a block's name must hold {i})."""
        return self._builder.parameter(name, shape, role=role, init=init, part=self.kind)

    def output(self, tensor):
        """The part's result: the residual stream (embedding, block) or the loss (head)."""
        self._output = self._name(tensor)

    def _name(self, t):
        if not isinstance(t, Tensor):
            raise TypeError(f"hspmd.models.Builder: expected a Tensor, got {type(t).__name__}")
        return t.name

    def op(self, op, inputs, output=None, **attrs):
        """Records `op` on `inputs` with `attrs` (the program's JSON fields)."""
        if output is None:
            output = f"t{self._count}"
            self._count += 1
        self._ops.append(dict({"op": op, "inputs": [self._name(t) for t in inputs], "output": output},
                              **{k: v for k, v in attrs.items() if v is not None}))
        return Tensor(self._builder, output)

    # ---- the engine's ops (docs/models.md, "Custom models") ----
    def embedding(self, table, ids, name=None):
        return self.op("embedding", [table, ids], name)

    def linear(self, x, weight, name=None):
        """x [..., in] . weight[out, in]^T (operands in the compute dtype)."""
        return self.op("linear", [x, weight], name)

    def matmul(self, a, b, trans_a=False, trans_b=False, name=None):
        return self.op("matmul", [a, b], name, trans_a=trans_a, trans_b=trans_b)

    def add(self, a, b, name=None):
        return self.op("add", [a, b], name)

    def add_bias(self, x, bias, name=None):
        """x [..., N] + bias [N], broadcast over the leading dims."""
        return self.op("add_bias", [x, bias], name)

    def mul(self, a, b, name=None):
        return self.op("mul", [a, b], name)

    def scale(self, a, factor, name=None):
        return self.op("scale", [a], name, factor=factor)

    def rms_norm(self, x, weight, eps=None, name=None):
        return self.op("rms_norm", [x, weight], name, eps=eps)

    def rope(self, x, positions, theta=None, name=None):
        return self.op("rope", [x, positions], name, theta=theta)

    def swiglu(self, gate, up, name=None):
        return self.op("swiglu", [gate, up], name)

    def attention(self, q, k, v, documents=None, scale=None, window=None, name=None):
        """Causal attention, q [B, S, Hq, D], k, v [B, S, Hkv, D]; `documents`:
        the (marked) positions, the document mask of packed documents."""
        inputs = [q, k, v] + ([documents] if documents is not None else [])
        return self.op("attention", inputs, name, scale=scale, window=window)

    def cross_entropy(self, logits, targets, normalizer, ignore_index=None, name=None):
        return self.op("cross_entropy", [logits, targets, normalizer], name, ignore_index=ignore_index)

    def reshape(self, x, shape, name=None):
        """shape: sizes, "B" and "S" for the batch and sequence dims."""
        return self.op("reshape", [x], name, shape=list(shape))

    def transpose(self, x, dim0, dim1, name=None):
        return self.op("transpose", [x], name, dim0=dim0, dim1=dim1)

    def slice(self, x, axis, begin, end, name=None):
        return self.op("slice", [x], name, axis=axis, begin=begin, end=end)

    def concat(self, parts, axis, name=None):
        return self.op("concat", list(parts), name, axis=axis)

    def reduce_sum(self, x, axes=(), name=None):
        return self.op("reduce_sum", [x], name, axes=list(axes))

    def cast(self, x, dtype, name=None):
        """dtype: "f32", "bf16" or "compute" (the run's precision)."""
        return self.op("cast", [x], name, dtype=dtype)

    def mark(self, x, kind, point, name=None):
        """A Reshard point named `point` (with {i} in a block): the plan lays
        it out by its `kind` (one of KINDS, docs/plan.md); identity on one device."""
        if kind not in KINDS:
            raise ValueError(f"hspmd.models.Builder: mark kind {kind!r} (expected one of {', '.join(KINDS)})")
        return self.op("mark", [x], name, kind=kind, name=point)

    def to_dict(self):
        d = {"ops": copy.deepcopy(self._ops), "output": self._output}
        if self.kind != "embedding":
            d["input"] = "input"
        return d


class Builder:
    """Records a model of one's own (model_type "hspmd_custom").

    The sizes are the config fields the plan and cost model read: the
    residual width (hidden_size), the MLP width (intermediate_size), the
    attention heads (num_attention_heads, num_key_value_heads) that tensor
    parallelism must divide, the vocabulary and the layer count. `config`:
    other Hugging Face fields (eos_token_id, max_position_embeddings,
    initializer_range, rms_norm_eps, rope_theta, ...)."""

    def __init__(self, vocab_size, hidden_size, intermediate_size, num_layers, num_attention_heads,
                 num_key_value_heads=None, **config):
        self.config = dict(config, model_type="hspmd_custom", vocab_size=vocab_size, hidden_size=hidden_size,
                           intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                           num_attention_heads=num_attention_heads)
        if num_key_value_heads is not None:
            self.config["num_key_value_heads"] = num_key_value_heads
        self.config.setdefault("eos_token_id", 0)
        self._params, self._parts, self._open = [], {}, None

    def parameter(self, name, shape, role="replicated", init=None, part=None):
        """Declares a parameter. role: column (a linear weight [out, in] whose
        output rows tensor parallelism splits), row ([out, in], input columns
        split, output partial), vocabulary (["vocab", n]: rows split) or
        replicated; init: normal (the default), ones or zeros; part:
        embedding, block (the name holds {i}) or head (default: the open part)."""
        if part is None:
            if self._open is None:
                raise ValueError(f"hspmd.models.Builder: parameter {name!r} needs part= outside a part")
            part = self._open.kind
        if role not in ROLES:
            raise ValueError(f"hspmd.models.Builder: parameter {name!r}: role {role!r} (expected {', '.join(ROLES)})")
        p = Parameter(self, name, shape, role, init or "normal", part)
        self._params.append(p)
        return p

    def embedding(self):
        return Part(self, "embedding")

    def block(self):
        """The block every layer runs; `{i}` in names is the layer index."""
        return Part(self, "block")

    def head(self):
        return Part(self, "head")

    def _enter(self, part):
        if self._open is not None:
            raise ValueError(f"hspmd.models.Builder: the {part.kind} opens inside the {self._open.kind}")
        if part.kind in self._parts:
            raise ValueError(f"hspmd.models.Builder: the {part.kind} is defined twice")
        self._open = part

    def _exit(self, part, ok):
        self._open = None
        if ok:
            if part._output is None:
                raise ValueError(f"hspmd.models.Builder: the {part.kind} sets no output (part.output(tensor))")
            self._parts[part.kind] = part

    def _open_part(self):
        if self._open is None:
            raise ValueError("hspmd.models.Builder: tensor arithmetic outside a part")
        return self._open

    def to_config(self):
        """The config.json of the model (a dict), its program included."""
        missing = [k for k in ("embedding", "block", "head") if k not in self._parts]
        if missing:
            raise ValueError(f"hspmd.models.Builder: no {', '.join(missing)} defined")
        program = {"parameters": [p.to_dict() for p in self._params]}
        program.update({k: part.to_dict() for k, part in self._parts.items()})
        return dict(copy.deepcopy(self.config), program=program)

    def build(self):
        """The hspmd.models.Model (hspmd.Error naming the op and the rule for a bad program)."""
        from .models import from_hf
        return from_hf(self.to_config())
