"""Serving a transformers causal LM with a KV cache (sdnet_trainer.serve.decoding / hf_folder),
on a tiny Llama that transformers builds from a config and saves to a temporary folder (no
download): prompts of different lengths left-padded in one batch continue as transformers'
generate continues each alone; the cache changes no token; stop ids, top_p and seeds; and the
application refuses what does not fit with a 4xx naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402

from sdnet_trainer.config import Config  # noqa: E402
from sdnet_trainer.errors import ConfigError  # noqa: E402
from sdnet_trainer.export import config_yaml  # noqa: E402
from sdnet_trainer.models.hf_causal_lm import HFCausalLM  # noqa: E402
from sdnet_trainer.serve.app import create_app  # noqa: E402
from sdnet_trainer.serve.args import ServeArgs  # noqa: E402
from sdnet_trainer.serve.decoding import CausalLMDecoder  # noqa: E402
from sdnet_trainer.serve.errors import InputError  # noqa: E402
from sdnet_trainer.serve.hf_folder import is_hf_folder  # noqa: E402
from sdnet_trainer.serve.model import load_served  # noqa: E402
from tests.support import tiny_llama_config  # noqa: E402

VOCAB, CONTEXT, EOS = 96, 48, 7
PROMPTS = [[5, 17, 3], [9, 1, 44, 2, 60, 8, 11], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = tiny_llama_config(
        vocab_size=VOCAB,
        intermediate_size=64,
        max_position_embeddings=CONTEXT,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config)
    # Larger weights than the init's: a random model with peaked logits has no near-ties that
    # float rounding could flip between the padded batch and a prompt alone.
    with torch.no_grad():
        lm.lm_head.weight.mul_(20)
    out = tmp_path_factory.mktemp("tiny_llama")
    lm.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def served(folder):
    model, _ = load_served(ServeArgs(checkpoint=str(folder), device="cpu", max_new_tokens=40))
    return model


def _reference(folder, prompt: list[int], steps: int) -> list[int]:
    """transformers' own greedy generate on the prompt alone, stopping at nothing."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    ids = torch.tensor([prompt])
    out = lm.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        min_new_tokens=steps,  # the eos token is suppressed until the last
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _job(model, prompt, steps=10, **options):
    options = {"temperature": 0.0, "seed": None, **options}
    return model.job(prompt, max_new_tokens=steps, **options)


def test_a_left_padded_batch_continues_as_transformers_generate_does_each_prompt(folder, served):
    assert is_hf_folder(folder) and served.decoder is not None
    assert served.context == CONTEXT and served.vocab_size == VOCAB
    assert served.stop_ids == (EOS,)
    expected = [_reference(folder, prompt, 10) for prompt in PROMPTS]
    served.stop_ids = ()  # generate above was told not to stop either
    try:
        got = served.run([_job(served, prompt) for prompt in PROMPTS])
    finally:
        served.stop_ids = (EOS,)
    assert got == expected
    assert len({tuple(e) for e in expected}) == 3  # three different continuations


def test_the_kv_cache_changes_no_token(served):
    cached = served.decoder
    uncached = CausalLMDecoder(cached.lm, torch.device("cpu"), use_cache=False)
    jobs = [_job(served, p, steps=12) for p in PROMPTS]
    jobs += [
        _job(served, p, steps=12, temperature=1.5, top_p=0.9, seed=i) for i, p in enumerate(PROMPTS)
    ]
    with_cache = served.run(jobs)
    served.decoder = uncached
    try:
        without = served.run(jobs)
    finally:
        served.decoder = cached
    assert with_cache == without
    assert all(0 < len(tokens) <= 12 for tokens in with_cache)


def test_stop_ids_end_a_row_and_seeded_sampling_repeats(served):
    greedy = served.run([_job(served, PROMPTS[1], steps=12)])[0]
    stop = greedy[4]
    first = greedy.index(stop)
    stopped, other = served.run(
        [_job(served, PROMPTS[1], steps=12, stop=[stop]), _job(served, PROMPTS[0], steps=12)]
    )
    assert stopped == greedy[: first + 1]  # the stop token is returned last
    assert other == served.run([_job(served, PROMPTS[0], steps=12)])[0]
    sampled = _job(served, PROMPTS[0], steps=12, temperature=2.0, seed=3)
    again = served.run([sampled])[0]
    assert again == served.run([sampled, _job(served, PROMPTS[2], steps=3)])[0]
    assert again != served.run([_job(served, PROMPTS[0], steps=12, temperature=2.0, seed=4)])[0]
    # A nucleus this small holds only the most likely token: greedy.
    tight = _job(served, PROMPTS[0], steps=12, temperature=1.0, top_p=1e-9, seed=5)
    assert served.run([tight])[0] == served.run([_job(served, PROMPTS[0], steps=12)])[0]


def test_the_prompt_and_its_new_tokens_must_fit_in_the_context(served):
    assert _job(served, [1] * (CONTEXT - 4), steps=None).max_new_tokens == 4
    with pytest.raises(InputError, match="max_new_tokens: 5 new tokens after a prompt of 44"):
        _job(served, [1] * (CONTEXT - 4), steps=5)
    with pytest.raises(InputError, match=f"stop: token id {VOCAB} is outside"):
        _job(served, [1], stop=[VOCAB])


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"prompt": [1] * (CONTEXT + 1)}, 422, "prompt: 49 tokens is longer than the model's"),
        ({"prompt": []}, 422, "prompt: empty"),
        ({"prompt": 12}, 422, "prompt"),
        ({"prompt": [1, "a"]}, 422, "prompt"),
        ({"prompt": [1], "temperature": "hot"}, 422, "temperature"),
        ({"prompt": [1], "top_p": 0}, 422, "top_p"),
        ({"prompt": [1], "stop": ["x"]}, 422, "stop"),
        ({"prompt": [1], "max_new_tokens": 41}, 422, "max_new_tokens: 41"),
        ({"prompt": "text"}, 422, "send token ids"),  # the folder has no tokenizer.json
        ({"prompt": [1], "extra": 1}, 422, "extra"),
    ],
)
def test_bad_requests_are_4xx_naming_the_field(app_client, body, status, words):
    reply = app_client.post("/v1/predict", json=body)
    assert reply.status_code == status, reply.text
    assert words in reply.json()["detail"]


@pytest.fixture(scope="module")
def app_client(served):
    app = create_app(served, ServeArgs(checkpoint="x", max_new_tokens=40), source="tiny")
    with TestClient(app) as client:
        yield client


def test_the_application_serves_the_folder(app_client, served):
    assert app_client.get("/v1/model").json()["kv_cache"] is True
    reply = app_client.post("/v1/predict", json={"prompt": PROMPTS[0], "max_new_tokens": 6})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["prompt_tokens"] == 3 and body["text"] is None
    assert body["tokens"] == served.run([_job(served, PROMPTS[0], steps=6)])[0]


def test_a_folder_is_refused_for_onnx_and_ema(folder):
    with pytest.raises(ConfigError, match="backend=torch"):
        load_served(ServeArgs(checkpoint=str(folder), backend="onnx"))
    with pytest.raises(ConfigError, match="no EMA"):
        load_served(ServeArgs(checkpoint=str(folder), ema=True))


def test_an_hf_causal_lm_export_serves_with_the_cache_too(folder, served, tmp_path):
    """model=hf_causal_lm trained here, exported (config.yaml + model.pt): the same decoder."""
    cfg = Config()
    cfg.model.name, cfg.model.hf_config = "hf_causal_lm", str(folder)
    cfg.data.name, cfg.data.vocab_size, cfg.data.seq_len = "tokens", VOCAB, 16
    lm = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    torch.save(HFCausalLM(lm).state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.yaml").write_text(config_yaml(cfg))
    exported, _ = load_served(ServeArgs(checkpoint=str(tmp_path), device="cpu"))
    assert exported.decoder is not None and exported.stop_ids == (EOS,)
    jobs = [_job(served, prompt, steps=8) for prompt in PROMPTS]
    assert exported.run(jobs) == served.run(jobs)


class PastKeyValuesAPI(torch.nn.Module):
    """The model as transformers releases before the ``cache`` keyword call it:
    ``past_key_values`` in and out."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=None
    ):
        assert past_key_values is not None or not use_cache  # the decoder made the first one
        out = self.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=past_key_values,
            use_cache=use_cache,
        )
        return SimpleNamespace(logits=out.logits, past_key_values=out.cache)


def test_the_decoder_speaks_the_older_past_key_values_api(served):
    jobs = [_job(served, p, steps=8) for p in PROMPTS]
    expected = served.run(jobs)
    cached = served.decoder
    served.decoder = CausalLMDecoder(PastKeyValuesAPI(cached.lm), torch.device("cpu"))
    try:
        assert served.decoder.cache_key == "past_key_values"
        assert served.run(jobs) == expected
    finally:
        served.decoder = cached


def test_text_prompts_get_the_tokenizers_leading_special_tokens(folder, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    for path in folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    tok.save(str(tmp_path / "tokenizer.json"))
    model, _ = load_served(ServeArgs(checkpoint=str(tmp_path), device="cpu"))
    # The BOS before the text, as transformers' tokenizer gives it; no EOS after it.
    assert model.job("hello world", max_new_tokens=2, temperature=0.0, seed=None).tokens == [
        1,
        3,
        4,
    ]
    assert model.text([4, 3]) == "world hello"


def test_a_llama_export_of_this_project_serves_with_the_cache(folder, served, tmp_path):
    """model=llama (config.yaml + model.pt): served through the cached decoder, as the
    transformers LlamaForCausalLM of its own tensors; greedy tokens equal the no-cache path (this
    project's Llama recomputing the whole sequence) and transformers' generate."""
    from sdnet_trainer import compose
    from sdnet_trainer.models import build_model
    from sdnet_trainer.models.llama.hf import load_hf_weights

    cfg = compose(
        [
            "model=llama3_debug",
            "data=tokens",
            f"model.hf_config={folder / 'config.json'}",
            f"data.vocab_size={VOCAB}",
            "data.seq_len=16",
        ]
    )
    llama = build_model(cfg.model)
    load_hf_weights(llama, folder)
    torch.save(llama.state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.yaml").write_text(config_yaml(cfg))
    exported, _ = load_served(ServeArgs(checkpoint=str(tmp_path), device="cpu"))
    assert isinstance(exported.decoder, CausalLMDecoder) and exported.info()["kv_cache"]
    lm = exported.decoder.lm
    assert isinstance(lm, transformers.LlamaForCausalLM)
    # The same tensors, not a copy: serving holds the weights once.
    ours = exported.runner.model
    assert lm.model.embed_tokens.weight.data_ptr() == ours.embed.tok.weight.data_ptr()
    jobs = [_job(exported, prompt, steps=8) for prompt in PROMPTS]
    cached = exported.run(jobs)
    assert cached == served.run(jobs)
    assert cached[0] == _reference(folder, PROMPTS[0], 8)
    exported.decoder = None  # the runner: no cache, the whole sequence at every token
    assert exported.run(jobs) == cached
    assert exported.stop_ids == ()  # data=tokens: no tokenizer, no EOS
    # Trained on text: the tokenizer's EOS (id 0 of this one) ends a generation.
    from tests.support import write_bpe_tokenizer

    cfg.data.tokenizer = str(write_bpe_tokenizer(tmp_path / "tok", template=None))
    (tmp_path / "config.yaml").write_text(config_yaml(cfg))
    with_eos, _ = load_served(ServeArgs(checkpoint=str(tmp_path), device="cpu"))
    assert with_eos.stop_ids == (0,) and with_eos.info()["stop_ids"] == [0]
