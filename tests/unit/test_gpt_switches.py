"""The GPT's switches: ``model.gpt.tie_embeddings`` (the output layer is the token embedding, as
GPT-2's) and ``model.gpt.bias=false`` (no bias anywhere, nanoGPT's ``bias=False``): the build and
its initialisation, the refusal under pipeline parallelism, the dry run's count, tensor parallel
on a fake process group, a few Trainer steps, and ``format=hf`` reloaded by transformers'
``GPT2LMHeadModel`` with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.distributed import DistEnv
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export import ExportArgs, export
from sdnet_trainer.export.hf import write_hf
from sdnet_trainer.models import GPT, build_model
from sdnet_trainer.models.init import Draw, init_steps
from sdnet_trainer.models.init_values import Constant
from sdnet_trainer.models.local_slices import local_runs
from sdnet_trainer.models.registry import model_family
from sdnet_trainer.plan.dry_run import fake_group
from sdnet_trainer.plan.model_stats import model_stats
from sdnet_trainer.preflight import validate

SIZES = dict(vocab_size=50, seq_len=16, dim=32, n_layers=2, n_heads=4)
TIED = ["model.gpt.tie_embeddings=true"]
NO_BIAS = ["model.gpt.bias=false"]
RUN = [
    "dist.device=cpu",
    "model=gpt_tiny",
    "data=tokens",
    "data.train_size=64",
    "optim=sgd",
    "optim.lr=0.5",
    "sched=constant",
    "loop.max_steps=2",
    "loop.global_batch_size=8",
    "loop.eval_at_end=false",
    "loop.eval_at_epoch_end=false",
    "logging.trackers=[]",
]


def _gpt(seed: int = 0, **switches) -> GPT:
    torch.manual_seed(seed)
    return GPT(**SIZES, **switches).eval()


def _tokens(vocab: int = SIZES["vocab_size"], length: int = 16) -> torch.Tensor:
    return torch.randint(vocab, (2, length), generator=torch.Generator().manual_seed(1))


def test_a_tied_gpt_has_one_weight_drawn_once_as_the_embedding():
    tied, untied = _gpt(tie_embeddings=True), _gpt()
    assert tied.head.weight is tied.embed.tok.weight
    vocab, dim = SIZES["vocab_size"], SIZES["dim"]
    count = sum(p.numel() for p in tied.parameters())
    assert count == sum(p.numel() for p in untied.parameters()) - vocab * dim
    # One Draw, under the embedding's name; the same values as the untied embedding's draw.
    draws = {s.fn.key for s in init_steps(tied) or [] if isinstance(s.fn, Draw)}
    assert "embed.tok.weight" in draws and "head.weight" not in draws
    assert torch.equal(tied.embed.tok.weight, untied.embed.tok.weight)
    # Built on the meta device, allocated and initialised (the Trainer's path): still one weight,
    # with the CPU build's values.
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = GPT(**SIZES, tie_embeddings=True)
    meta.to_empty(device="cpu")
    meta.init_weights()
    assert meta.head.weight is meta.embed.tok.weight
    assert all(torch.equal(a, b) for a, b in zip(meta.parameters(), tied.parameters()))


def test_a_bias_free_gpt_has_no_bias_anywhere_and_the_default_keeps_its_norms_biases():
    model = _gpt(bias=False)
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * SIZES["n_layers"] + 1 and all(m.bias is None for m in norms)
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    # The init (and a meta build's materialisation) declares exactly these parameters.
    draws = {s.fn.key: s.fn.dist for s in init_steps(model) or [] if isinstance(s.fn, Draw)}
    assert draws.keys() == dict(model.named_parameters()).keys()
    assert draws["norm.weight"] == draws["blocks.1.norm2.weight"] == Constant(1.0)
    assert model(_tokens()).shape == (2, 16, SIZES["vocab_size"])
    default = _gpt()
    biases = [n for n, _ in default.named_parameters() if n.endswith("bias")]
    assert biases and all("norm" in n for n in biases)  # as before: the LayerNorms' alone
    # Only the norms' biases differ: the same draws otherwise.
    kept = dict(model.named_parameters())
    assert all(torch.equal(p, kept[n]) for n, p in default.named_parameters() if n in kept)


def test_the_config_builds_both_switches_and_refuses_a_tied_pipeline():
    cfg = compose(["model=gpt_tiny", *TIED, *NO_BIAS])
    model = build_model(cfg.model)
    assert isinstance(model, GPT) and model.tie_embeddings and not model.norm_bias
    assert model.head.weight is model.embed.tok.weight
    with pytest.raises(ConfigError, match=r"model\.gpt\.tie_embeddings=true .*parallel\.pp=1"):
        model.pipeline_units()
    base = ["model=gpt_tiny", "data=tokens", *TIED]
    validate(compose(base), world_size=2)
    with pytest.raises(ConfigError, match=r"model\.gpt\.tie_embeddings=true with parallel\.pp=2"):
        validate(compose([*base, "parallel.pp=2"]), world_size=2)


def test_the_dry_run_counts_a_tied_weight_once():
    base = ["model=gpt_tiny", "data=tokens", *NO_BIAS]
    untied, tied = model_stats(compose(base)), model_stats(compose([*base, *TIED]))
    gpt = compose(base).model.gpt
    assert tied.params == untied.params - gpt.vocab_size * gpt.dim
    assert tied.head + tied.tail + sum(tied.blocks) == tied.params
    assert tied.tail == untied.tail - gpt.vocab_size * gpt.dim  # the head: counted at the embedding


TP = ["dist.device=cpu", "model=gpt_tiny", "data=tokens", "loop.global_batch_size=8"]


def test_tensor_parallel_splits_the_tied_weight_by_vocabulary_rows():
    """Each of 2 tensor-parallel ranks (x 2 FSDP) set up by the Trainer on a fake process group:
    the tied weight one DTensor split by vocabulary rows, no bias anywhere, and each rank's blocks
    the single process's weights."""
    overrides = [*TP, *TIED, *NO_BIAS]
    single = Trainer(compose(overrides), env=DistEnv())
    single._setup_model()
    reference = single.model.state_dict()
    for rank in range(4):
        with fake_group(rank, 4):
            env = DistEnv(rank=rank, world_size=4, backend="fake")
            trainer = Trainer(compose([*overrides, "parallel=fsdp", "parallel.tp=2"]), env=env)
            trainer._setup_model()
            model = trainer.model
            tok = model.embed.tok.weight
            assert model.head.weight is tok and isinstance(tok, DTensor)
            assert tok.placements[-1] == Shard(0)  # the tp dimension: vocabulary rows
            assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
            for name, p in model.named_parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                index = [
                    torch.tensor([i for b, e in d for i in range(b, e)]) for d in local_runs(p)
                ]
                expected = reference[name][torch.meshgrid(*index, indexing="ij")]
                assert torch.equal(local, expected), (rank, name)


class _Recorder(Trainer):
    """Keeps the tied weight as set-up leaves it, before the first step."""

    def setup(self) -> None:
        super().setup()
        self.initial = self.model.embed.tok.weight.detach().clone()


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    """gpt_tiny tied and bias-free, 2 SGD steps in this process, checkpointed."""
    run_dir = tmp_path_factory.mktemp("gpt_tied")
    trainer = _Recorder(compose([*RUN, *TIED, *NO_BIAS]), output_dir=run_dir)
    trainer.fit()
    model = trainer.model
    trainer.close()
    return run_dir, model, trainer.initial


def test_a_tied_bias_free_gpt_trains_with_one_weight(tied_run):
    _, model, initial = tied_run
    assert isinstance(model, GPT) and model.head.weight is model.embed.tok.weight
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert not torch.equal(model.embed.tok.weight, initial)  # the steps moved it


def test_format_hf_of_a_tied_bias_free_gpt_is_a_gpt2_with_the_same_logits(tied_run, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")
    run_dir, model, _ = tied_run
    out = tmp_path / "hf"
    export(ExportArgs(checkpoint=str(run_dir / "checkpoints"), format="hf", out=str(out)))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["tie_word_embeddings"] is True
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index and "transformer.wte.weight" in index
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert hf.lm_head.weight is hf.transformer.wte.weight
    # The biases the GPT has none of are zeros, and change nothing.
    assert (
        not hf.transformer.h[0].ln_1.bias.any() and not hf.transformer.h[1].attn.c_attn.bias.any()
    )
    tokens = _tokens(vocab=model.vocab_size, length=model.seq_len)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model.eval()(tokens), rtol=0, atol=1e-5)


def test_format_hf_of_an_untied_gpt_with_norm_biases_keeps_its_own_head(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")
    model = _gpt(seed=3)
    with torch.no_grad():  # norms away from their init, so a norm left at it shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    write_hf(model, tmp_path, family=model_family("gpt"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.tie_word_embeddings is False
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    with torch.no_grad():
        torch.testing.assert_close(hf(_tokens()).logits, model(_tokens()), rtol=0, atol=1e-5)
