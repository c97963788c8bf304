"""What a request becomes and what comes back (sdnet_trainer.serve.images / language / model),
without a server: generation against a step-by-step decode, static ONNX shapes, image and tensor
refusals, tokenizers, class names and an export folder's config read as data."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from sdnet_trainer.config import Config
from sdnet_trainer.config.schema import AugmentConfig, DataConfig
from sdnet_trainer.data.augment import CIFAR10_MEAN
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export import config_yaml
from sdnet_trainer.models.gpt import GPT
from sdnet_trainer.models.simple_cnn import SimpleCNN
from sdnet_trainer.serve.args import parse_args
from sdnet_trainer.serve.errors import InputError
from sdnet_trainer.serve.images import (
    CIFAR10_CLASSES,
    ImageModel,
    class_names,
    decode_image,
    eval_transform,
)
from sdnet_trainer.serve.language import (
    DEFAULT_NEW_TOKENS,
    MAX_CHARS_PER_TOKEN,
    Codec,
    LanguageModel,
    codec,
)
from sdnet_trainer.serve.model import (
    OnnxRunner,
    TorchRunner,
    _folder_config,
    is_export_folder,
    load,
    resolve,
)

CONTEXT, VOCAB = 8, 32


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, seq_len=CONTEXT, dim=16, n_layers=1, n_heads=2).eval()


def _language_model(runner, *, context: int = CONTEXT) -> LanguageModel:
    return LanguageModel(
        runner, context=context, vocab_size=VOCAB, codec=Codec("ids"), max_new_tokens=64
    )


def _greedy(model: nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            next_id = model(ids[:, -CONTEXT:])[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return ids[0, len(prompt) :].tolist()


def _job(lm: LanguageModel, prompt, steps: int = 12, temperature: float = 0.0, seed=None):
    return lm.job(prompt, max_new_tokens=steps, temperature=temperature, seed=seed)


PROMPTS = [[3], [1, 2, 3], [4, 5, 6], list(range(CONTEXT))]


def test_greedy_generation_equals_a_step_by_step_decode_alone_and_batched(gpt):
    lm = _language_model(TorchRunner(gpt, torch.device("cpu")))
    expected = [_greedy(gpt, prompt, 12) for prompt in PROMPTS]  # past the context: cropped
    assert [lm.run([_job(lm, p)])[0] for p in PROMPTS] == expected
    # One batch of mixed lengths (two of the same length generate together) and budgets.
    jobs = [_job(lm, p, steps=12 - i) for i, p in enumerate(PROMPTS)]
    assert lm.run(jobs) == [e[: 12 - i] for i, e in enumerate(expected)]


class FakeSession:
    """An onnxruntime session of ``model`` exported with static shapes: it refuses any other."""

    def __init__(self, model: nn.Module, shape: list, name: str = "x") -> None:
        self.model, self.shape, self.name = model, shape, name
        self.calls: list[tuple[int, ...]] = []

    def get_inputs(self):
        return [type("Arg", (), {"name": self.name, "shape": self.shape})()]

    def run(self, _, feeds):
        (array,) = feeds.values()
        self.calls.append(array.shape)
        for got, want in zip(array.shape, self.shape):
            assert not isinstance(want, int) or got == want, (array.shape, self.shape)
        with torch.no_grad():
            return [self.model(torch.from_numpy(array)).numpy()]


def test_onnx_runner_meets_static_batch_and_sequence_dimensions(gpt):
    session = FakeSession(gpt, [2, CONTEXT])
    runner = OnnxRunner(session)
    assert runner.context == CONTEXT
    lm = _language_model(runner, context=runner.context)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]  # one group of 3 rows: batches of 2, padded
    assert lm.run([_job(lm, p) for p in prompts]) == [_greedy(gpt, p, 12) for p in prompts]
    assert set(session.calls) == {(2, CONTEXT)}


def test_onnx_runner_with_a_dynamic_batch_runs_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(5)).eval()
    inputs = torch.randn(3, 3, 6, 6)
    with torch.no_grad():
        expected = model(inputs)
    session = FakeSession(model, ["batch", 3, 6, 6])
    torch.testing.assert_close(OnnxRunner(session)(inputs), expected)
    assert session.calls == [(3, 3, 6, 6)]


def test_sampling_follows_the_seed_and_a_vanishing_temperature_is_greedy(gpt):
    lm = _language_model(TorchRunner(gpt, torch.device("cpu")))
    one = lm.run([_job(lm, [1, 2], temperature=1.0, seed=5)])[0]
    assert one == lm.run([_job(lm, [1, 2], temperature=1.0, seed=5)])[0]
    assert len(one) == 12 and all(0 <= t < VOCAB for t in one)
    drawn = lm.run([_job(lm, [1, 2], temperature=1e-300, seed=1)])[0]  # overflows: greedy
    assert drawn == _greedy(gpt, [1, 2], 12)


@pytest.mark.parametrize(
    "prompt, steps, words",
    [
        (list(range(CONTEXT + 1)), 1, f"longer than the model's context of {CONTEXT}"),
        ([], 1, "empty"),
        ([1, VOCAB], 1, f"token id {VOCAB} is outside the vocabulary"),
        ([-1], 1, "token id -1"),
        ("text", 1, "send token ids"),
        ([1], 65, "max_new_tokens: 65"),
    ],
)
def test_prompts_that_do_not_fit_are_422(gpt, prompt, steps, words):
    lm = _language_model(TorchRunner(gpt, torch.device("cpu")))
    with pytest.raises(InputError) as err:
        _job(lm, prompt, steps=steps)
    assert err.value.status == 422 and words in err.value.reason


class RefusingTokenizer:
    """A tokenizer that must not be asked: the prompt is refused by its length first."""

    def encode(self, texts: list[str], *, add_special_tokens: bool = False):
        raise AssertionError("the whole prompt was tokenized")


def test_a_text_that_cannot_fit_is_refused_before_it_is_encoded(gpt):
    runner = TorchRunner(gpt, torch.device("cpu"))
    lm = LanguageModel(
        runner, context=CONTEXT, vocab_size=256, codec=Codec("bytes"), max_new_tokens=64
    )
    assert _job(lm, "é" * (CONTEXT // 2)).tokens == list(("é" * (CONTEXT // 2)).encode())
    for text in ("x" * (CONTEXT + 1), "é" * (CONTEXT // 2 + 1)):  # bytes: past the context
        with pytest.raises(InputError, match="longer than the model's context") as err:
            _job(lm, text)
        assert err.value.status == 422
    tokens = Codec("tokenizer", RefusingTokenizer())
    lm = LanguageModel(runner, context=CONTEXT, vocab_size=VOCAB, codec=tokens, max_new_tokens=64)
    with pytest.raises(InputError, match="characters is longer"):
        _job(lm, "a" * (CONTEXT * MAX_CHARS_PER_TOKEN + 1))


def test_max_new_tokens_defaults_to_32_or_the_servers_limit(gpt):
    runner = TorchRunner(gpt, torch.device("cpu"))
    for limit, expected in ((64, DEFAULT_NEW_TOKENS), (5, 5)):
        lm = LanguageModel(
            runner, context=CONTEXT, vocab_size=VOCAB, codec=Codec("ids"), max_new_tokens=limit
        )
        job = lm.job([1], max_new_tokens=None, temperature=0.0, seed=None)
        assert job.max_new_tokens == expected


def test_text_prompts_follow_the_datas_tokenizer(tmp_path):
    text = codec(DataConfig(name="text"))
    assert text.encode("héllo") == list("héllo".encode()) and text.decode([104, 105]) == "hi"
    assert codec(DataConfig(name="tokens")).decode([1, 2]) is None
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = codec(DataConfig(name="hf", text_column="text", tokenizer=str(tmp_path)))
    assert hf.encode("hello world hello") == [1, 2, 1] and hf.decode([2, 1]) == "world hello"
    # A model trained on a tiktoken BPE file serves text through the same file (data.tokenizer's
    # one loader); special tokens are left out of the text served.
    pytest.importorskip("tiktoken")
    pieces = [bytes([b]) for b in range(256)] + [b"he", b"hel", b"hell", b"hello"]
    bpe = tmp_path / "tokenizer.model"
    bpe.write_text("".join(f"{base64.b64encode(p).decode()} {r}\n" for r, p in enumerate(pieces)))
    tiktoken = codec(DataConfig(name="text", tokenizer=str(bpe)))
    assert tiktoken.encode("hello!") == [259, ord("!")]
    assert tiktoken.decode([259, ord("!"), 260]) == "hello!"  # 260: <|endoftext|>


# ---------------------------------------------------------------------- images


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def test_decode_image_refuses_with_the_status_that_fits():
    rgb = Image.fromarray(np.zeros((10, 10, 3), dtype=np.uint8))
    good = _png(rgb)
    cases = [
        (b"", 400, "empty"),
        (good[:40], 400, "cannot decode"),
        (b"GIF89a" + good, 415, "not a PNG or JPEG"),
        (_png(rgb, "GIF"), 415, "not a PNG or JPEG"),
        (_png(rgb, "BMP"), 415, "not a PNG or JPEG"),
    ]
    for data, status, words in cases:
        with pytest.raises(InputError) as err:
            decode_image(data, max_pixels=10_000)
        assert err.value.status == status and words in err.value.reason
    with pytest.raises(InputError) as err:
        decode_image(good, max_pixels=99)
    assert err.value.status == 413 and "10x10 pixels" in err.value.reason
    rgba = Image.fromarray(np.full((4, 5, 4), 200, dtype=np.uint8))
    assert decode_image(_png(rgba), max_pixels=100).mode == "RGB"
    assert decode_image(_png(rgb.convert("L"), "JPEG"), max_pixels=100).size == (10, 10)


def _image_model(transform=None) -> ImageModel:
    return ImageModel(
        lambda x: x.flatten(1)[:, :3],
        input_shape=(3, 4, 4),
        classes=["a", "b", "c"],
        transform=transform,
        max_pixels=10_000,
        top_k=2,
    )


def test_tensors_must_have_the_models_input_shape_and_finite_values():
    model = _image_model()
    assert model.from_tensor(np.zeros((3, 4, 4)).tolist()).shape == (3, 4, 4)
    cases = [
        (np.zeros((3, 4, 5)).tolist(), "shape [3, 4, 5], the model takes [3, 4, 4]"),
        ([[1.0, 2.0], [3.0]], "rectangular"),
        ([["a"]], "rectangular"),
        (np.full((3, 4, 4), np.nan).tolist(), "not finite"),
    ]
    for values, words in cases:
        with pytest.raises(InputError) as err:
            model.from_tensor(values)
        assert err.value.status == 422 and words in err.value.reason
    with pytest.raises(InputError) as err:
        model.from_image(b"\x89PNG")  # no transform: tensors only
    assert err.value.status == 415 and "send" in err.value.reason


def test_probabilities_and_the_top_classes():
    model = _image_model()
    inputs = torch.zeros(3, 4, 4)
    inputs[0, 0, 2] = 2.0  # the third logit
    (probs,) = model.run([inputs])
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([0.0, 0.0, 2.0]), 0))
    top = model.top(probs, None)
    assert [t["label"] for t in top] == ["c", "a"] and len(model.top(probs, 10)) == 3


def test_the_eval_transform_is_the_data_layers():
    cifar = eval_transform(DataConfig(name="cifar10", image_size=32))
    assert cifar is not None
    assert list(cifar.transforms[-1].mean) == list(CIFAR10_MEAN)
    image = Image.fromarray(np.zeros((50, 40, 3), dtype=np.uint8))
    assert cifar(image).shape == (3, 32, 32)
    crops = DataConfig(name="imagefolder", image_size=64, augment=AugmentConfig("imagenet"))
    val = eval_transform(crops)
    assert val is not None and val(image).shape == (3, 64, 64)
    assert eval_transform(DataConfig(name="synthetic", channels=1)) is None


def test_class_names_from_the_data(tmp_path):
    assert class_names(DataConfig(name="cifar10"), 10) == list(CIFAR10_CLASSES)
    for name in ("dog", "cat"):
        (tmp_path / "train" / name).mkdir(parents=True)
    folders = DataConfig(name="imagefolder", root=str(tmp_path))
    assert class_names(folders, 2) == ["cat", "dog"]
    assert class_names(folders, 3) == ["0", "1", "2"]  # does not fit the model: numbers
    (tmp_path / "classes.json").write_text(json.dumps({"classes": ["x", "y"]}))
    assert class_names(DataConfig(name="shards", root=str(tmp_path)), 2) == ["x", "y"]
    remote = DataConfig(name="shards", root="https://example.com/shards")
    assert class_names(remote, 2) == ["0", "1"]  # a URL is never fetched for names


def test_images_are_served_at_the_val_crop_size(tmp_path):
    """data.augment.val_crop_size unlike data.image_size: the served input shape is the crop the
    eval transform gives (the validation loop's input), not image_size."""
    cfg = Config()
    cfg.model.name, cfg.model.num_classes, cfg.data.image_size = "simple_cnn", 3, 16
    cfg.data.augment.val_crop_size = 12
    cfg.data.name = "imagefolder"  # image files (generated images have no eval transform)
    torch.manual_seed(0)
    model = SimpleCNN(num_classes=3).eval()
    (tmp_path / "config.yaml").write_text(config_yaml(cfg))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    args = parse_args([f"checkpoint={tmp_path}"])
    served = load(args, resolve(args))
    assert isinstance(served, ImageModel) and served.input_shape == (3, 12, 12)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 24, 3), np.uint8))
    val = eval_transform(cfg.data)
    assert val is not None
    with torch.no_grad():
        expected = torch.softmax(model(val(image)[None]), dim=-1)[0]
    (probs,) = served.run([served.from_image(_png(image))])
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- export folders


def test_an_export_folders_config_is_read_as_data(tmp_path):
    cfg = Config()
    cfg.run.name = "price_${oc.env:HOME}"  # literal text, escaped by export
    (tmp_path / "config.yaml").write_text(config_yaml(cfg))
    assert is_export_folder(tmp_path)
    assert _folder_config(tmp_path)["run"]["name"] == "price_${oc.env:HOME}"
    (tmp_path / "config.yaml").write_text("a: &x [1, 2]\nb: *x\n")
    with pytest.raises(ConfigError, match="aliases"):
        _folder_config(tmp_path)
    (tmp_path / "config.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="does not hold a config"):
        _folder_config(tmp_path)
    (tmp_path / "elsewhere.yaml").write_text("run: {}\n")
    os.remove(tmp_path / "config.yaml")
    os.symlink(tmp_path / "elsewhere.yaml", tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match="links are not followed"):
        _folder_config(tmp_path)
