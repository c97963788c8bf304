"""A model family registered from outside the package (models/family.py, models/registry.py):
a toy language model, added with one ``register_family`` call from this file, passes the preflight
checks through its own validator, trains, exports and is served over HTTP, and no module of the
package names it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdnet_trainer import Trainer, compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export import ExportArgs, export
from sdnet_trainer.models.family import ModelFamily
from sdnet_trainer.models.registry import FAMILIES, available_models, register_family
from sdnet_trainer.preflight import validate
from tests.support import CPU

pytest.importorskip("fastapi", reason="the serve extra is not installed")

VOCAB = 48


class ToyLM(nn.Module):
    """Token ids in, (batch, time, vocab) logits out: a bigram table."""

    def __init__(self, vocab_size: int, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def _validate(cfg, *, tp: int, pp: int) -> None:
    if tp > 1 or pp > 1:
        raise ConfigError("model.name=toy_lm runs on data-parallel layouts only")
    if cfg.data.vocab_size != cfg.model.kwargs["vocab_size"]:
        raise ConfigError("model.kwargs.vocab_size must equal data.vocab_size")


TOY = ModelFamily(
    name="toy_lm",
    build=lambda cfg: ToyLM(**cfg.kwargs),
    language=True,
    validate=_validate,
)
RUN = [
    *CPU,
    "model.name=toy_lm",
    f"+model.kwargs.vocab_size={VOCAB}",
    "data=tokens",
    f"data.vocab_size={VOCAB}",
    "data.seq_len=16",
    "data.train_size=64",
    "data.val_size=16",
    "optim=adamw",
    "optim.lr=0.05",
    "sched=constant",
    "loop.max_steps=8",
    "loop.global_batch_size=16",
    "loop.eval_at_epoch_end=false",
    "logging.trackers=[]",
]


@pytest.fixture
def toy_family():
    register_family(TOY)
    try:
        yield TOY
    finally:
        del FAMILIES[TOY.name]


@pytest.mark.full  # trains, exports and serves: a few seconds
def test_a_family_registered_from_a_test_file_trains_exports_and_serves(toy_family, tmp_path):
    from sdnet_trainer.serve.app import create_app
    from sdnet_trainer.serve.args import ServeArgs
    from sdnet_trainer.serve.client import Client
    from sdnet_trainer.serve.model import load_served
    from tests.unit.test_serve_app import running

    assert "toy_lm" in available_models()
    cfg = compose(RUN)
    validate(cfg, world_size=1)
    with pytest.raises(ConfigError, match="data-parallel layouts only"):  # its own validator
        validate(compose([*RUN, "parallel.tp=2"]), world_size=2)
    trainer = Trainer(cfg, output_dir=tmp_path / "run")
    try:
        metrics = trainer.fit()
        assert isinstance(unwrapped := trainer.model, ToyLM)
        trained = {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    finally:
        trainer.close()
    assert metrics["val/loss"] < torch.log(torch.tensor(float(VOCAB))).item()  # it learned

    out = tmp_path / "export"
    export(ExportArgs(checkpoint=str(tmp_path / "run" / "checkpoints"), format="pt", out=str(out)))
    exported = torch.load(out / "model.pt", weights_only=True)
    assert exported.keys() == trained.keys()
    for name, value in trained.items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)

    args = ServeArgs(checkpoint=str(out), device="cpu")
    served, source = load_served(args)
    model = ToyLM(VOCAB)
    model.load_state_dict(trained)
    prompt, steps = [3, 7, 11], 4
    ids = torch.tensor([prompt])
    with torch.no_grad():  # greedy decoding of the trained weights, by hand
        for _ in range(steps):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    with running(create_app(served, args, source=source)) as url:
        client = Client(url)
        try:
            reply = client.post_json("/v1/predict", {"prompt": prompt, "max_new_tokens": steps})
        finally:
            client.close()
    assert reply.status == 200, reply.detail
    assert reply.json()["tokens"] == ids[0, len(prompt) :].tolist()


def test_a_family_name_is_registered_once(toy_family):
    register_family(TOY)  # the same entry again: nothing changes
    with pytest.raises(ConfigError, match="registered already"):
        register_family(ModelFamily(name="toy_lm", build=lambda cfg: ToyLM(VOCAB)))
    with pytest.raises(ConfigError, match="one of the project's classifiers"):
        register_family(ModelFamily(name="simple_cnn", build=lambda cfg: ToyLM(VOCAB)))
