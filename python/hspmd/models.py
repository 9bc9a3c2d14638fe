"""hspmd.models: models built from Hugging Face configs (docs/models.md)."""
import json
import os
import tempfile

from . import _core
from .builder import Builder, Parameter, Tensor  # noqa: F401 (custom models)


class Model:
    """A model of a registered family (Llama, Qwen2, Mistral, ...), described
    by its Hugging Face config. `path` names a config.json holding it (the
    given file, or a private copy of a dict written when the model was made):
    the trainer and the plan commands read the model from there."""

    def __init__(self, config, path, owned_dir=None):
        self.config = config
        self.path = path
        self._owned_dir = owned_dir  # a TemporaryDirectory kept alive with the model

    @property
    def model_type(self):
        return self.config.model_type

    def parameters(self):
        """[(Hugging Face name, shape, tensor-parallel role)] in the model's order."""
        return self.config.parameters()

    def to_dict(self):
        return json.loads(self.config.to_json())

    def __repr__(self):
        c = self.config
        return (f"Model({c.model_type}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                f"{c.parameter_count / 1e6:.2f}M parameters, from {self.path})")


def from_hf(config):
    """A Model from a Hugging Face config.json path or its dict. Raises
    hspmd.Error (one line naming the field and the rule) for a config hspmd
    does not build."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        return Model(_core.ModelConfig.load(path), path)
    if isinstance(config, dict):
        text = json.dumps(config)
        parsed = _core.ModelConfig.from_json(text, "config")
        owned = tempfile.TemporaryDirectory(prefix="hspmd-model-")
        path = os.path.join(owned.name, "config.json")
        with open(path, "w") as f:
            f.write(text)
        return Model(parsed, path, owned)
    shown = repr(config)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise _core.Error(f"[python] models.from_hf(): config={shown}: must be a config.json path or a dict, got "
                      f"{type(config).__name__}")


def families():
    """The registered model families' model_type values."""
    return [t.strip() for t in _core.model_types().split(",") if t.strip()]
