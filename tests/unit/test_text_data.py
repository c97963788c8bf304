"""Tokenizers (data.tokenizer), data=text's token cache and packing, data=chat's assistant-only
targets, and the language-model loss's ignore_index, all offline: a byte-level BPE tokenizer is
trained with Hugging Face `tokenizers` on a generated corpus, and a tiktoken BPE file is written
by hand."""

from __future__ import annotations

import base64
import json
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import sdnet_trainer.data.text as text_module
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data import build_datasets
from sdnet_trainer.data.chat import TEMPLATES
from sdnet_trainer.data.token_cache import CACHE_FOLDER, IGNORE_INDEX, token_dtype
from sdnet_trainer.data.tokenizer import load_tokenizer
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.gpt import GPT
from sdnet_trainer.training.evaluation import metric_sums
from sdnet_trainer.training.trainer import Trainer
from tests.support import EOS_TOKEN, IM_END, IM_START, corpus_line, write_bpe_tokenizer

EOS = EOS_TOKEN


def write_tokenizer(folder: Path, *, template: str | None = TEMPLATES["chatml"]) -> Path:
    return write_bpe_tokenizer(folder, template=template)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def text_config(root: Path, tokenizer: Path, **kwargs) -> DataConfig:
    return DataConfig(
        name="text", root=str(root), tokenizer=str(tokenizer), seq_len=8, vocab_size=512, **kwargs
    )


def write_corpus(root: Path) -> list[str]:
    """A .txt, a .jsonl and a .parquet file; the documents in the order they are read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    txt = "\n".join(corpus_line(i) for i in range(30)) + "\n"
    (root / "a.txt").write_text(txt)
    lines = [corpus_line(i) for i in range(30, 60)]
    with open(root / "b.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps({"text": line, "id": 1}) + "\n")
    table = [corpus_line(i) for i in range(60, 90)]
    pq.write_table(pa.table({"text": table}), root / "c.parquet")
    return [txt, *lines, *table]


# ---------------------------------------------------------------------------------- tokenizers


def test_tokenizer_folder_or_file_gives_ids_eos_and_chat_template(tokenizer_dir):
    folder = load_tokenizer(str(tokenizer_dir))
    single = load_tokenizer(str(tokenizer_dir / "tokenizer.json"))
    assert folder.eos == EOS and folder.eos_id == 0 and folder.bos_id is None
    assert folder.chat_template == TEMPLATES["chatml"]
    assert folder.vocab_size == 300 and folder.fingerprint == single.fingerprint
    ids = folder.encode(["the cat sat"])[0]
    assert folder.decode(ids) == "the cat sat" and single.encode(["the cat sat"])[0] == ids
    # Special tokens written in the text are those tokens (a chat template's markers).
    assert folder.encode([f"{IM_START}user"])[0][0] == 1


def test_tiktoken_bpe_file(tmp_path):
    merges = [b"th", b"the", b" c", b" ca", b" cat"]
    pieces = [bytes([b]) for b in range(256)] + merges
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(p).decode()} {r}\n" for r, p in enumerate(pieces)))
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.vocab_size == 256 + len(merges) + 1
    assert tokenizer.eos == EOS and tokenizer.eos_id == 256 + len(merges)
    ids = tokenizer.encode(["the cat"])[0]
    assert ids == [256 + 1, 256 + 4] and tokenizer.decode(ids) == "the cat"


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("missing.json", None, "does not exist"),
        ("tokenizer.json", b'{"model": {"type": "nonsense"}}', "is not a tokenizer.json"),
        ("tokenizer.model", b"\x00\xff binary protobuf", "neither a tokenizer.json nor a tiktoken"),
        ("tokenizer.model", b"dGg= 0\ndGg= 1\n", "ranks are not 0..N-1"),
    ],
)
def test_bad_tokenizer_files_name_the_key_and_file(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as info:
        load_tokenizer(str(path))
    assert f"data.tokenizer={str(path)!r}" in str(info.value)


def test_a_hub_id_is_fetched_as_its_files(tmp_path, tokenizer_dir, monkeypatch):
    """A data.tokenizer that is no local path but a Hub id reads the repository's tokenizer.json
    and tokenizer_config.json (hf_hub_download stands in for the network here)."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    asked = []

    def download(repo: str, filename: str) -> str:
        asked.append((repo, filename))
        if repo != "org/tok":
            raise OSError(f"{repo} not found")
        return str(tokenizer_dir / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    fetched, local = load_tokenizer("org/tok"), load_tokenizer(str(tokenizer_dir))
    assert asked == [("org/tok", "tokenizer.json"), ("org/tok", "tokenizer_config.json")]
    assert fetched.encode(["the cat sat"]) == local.encode(["the cat sat"])
    assert (fetched.eos_id, fetched.chat_template) == (local.eos_id, local.chat_template)
    with pytest.raises(ConfigError, match=r"data.tokenizer='org/other' .* cannot be fetched"):
        load_tokenizer("org/other")
    asked.clear()  # a missing file's name is not taken for a Hub id
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer("missing/tokenizer.json")
    assert asked == []


def test_bad_tokenizer_config_and_folder(tmp_path, tokenizer_dir):
    with pytest.raises(ConfigError, match="folder without tokenizer.json"):
        load_tokenizer(str(tmp_path))
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer_config.json is not readable JSON"):
        load_tokenizer(str(folder))


# ------------------------------------------------------------------------------ text and cache


def test_text_cache_packs_documents_with_eos_built_once_rebuilt_on_change(
    tmp_path, tokenizer_dir, monkeypatch
):
    documents = write_corpus(tmp_path / "corpus")
    cfg = text_config(tmp_path / "corpus", tokenizer_dir)
    builds = []
    encode = text_module.encode_documents
    monkeypatch.setattr(
        text_module, "encode_documents", lambda *a, **k: builds.append(1) or encode(*a, **k)
    )
    train, val = build_datasets(cfg)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    expected = [i for doc in documents for i in [*tokenizer.encode([doc])[0], tokenizer.eos_id]]
    cache = train.cache
    assert cache.tokens.dtype == np.uint16 and isinstance(cache.tokens, np.memmap)
    assert cache.folder == tmp_path / "corpus" / CACHE_FOLDER
    # Every document followed by EOS, in sorted file order, packed back to back.
    assert cache.tokens.tolist() == expected and builds == [1]
    assert len(train) + len(val) >= (len(expected) - 1) // 8 - 1
    for i in (0, 3, len(train) - 1):
        inputs, targets = train[i]
        assert inputs.tolist() == expected[i * 8 : i * 8 + 8]
        assert targets.tolist() == expected[i * 8 + 1 : i * 8 + 9]
    assert val[0][0].tolist() == expected[val.start : val.start + 8]
    assert torch.equal(train[-1][0], train[len(train) - 1][0])  # negative indices from the end
    with pytest.raises(IndexError, match=f"PackedTokens index {len(train)} out of range"):
        train[len(train)]

    build_datasets(cfg)  # unchanged: mapped, not tokenized again
    assert builds == [1]
    with open(tmp_path / "corpus" / "b.jsonl", "a") as f:
        f.write(json.dumps({"text": "far away birds"}) + "\n")
    train, _ = build_datasets(cfg)
    assert builds == [1, 1]
    assert train.cache.length == len(expected) + len(tokenizer.encode(["far away birds"])[0]) + 1
    files = {p.name for p in cache.folder.iterdir() if not p.name.endswith("lock")}
    assert files == {f"{train.cache.name}.{end}" for end in ("tokens", "json")}  # old one removed

    # Another place for the cache, and the documents' boundaries masked.
    masked, _ = build_datasets(
        text_config(
            tmp_path / "corpus", tokenizer_dir, cache_dir=str(tmp_path / "c"), mask_documents=True
        )
    )
    assert masked.cache.folder == tmp_path / "c" and builds == [1, 1, 1]
    assert masked.mask_eos == tokenizer.eos_id
    blocked = text_config(tmp_path / "corpus", tokenizer_dir, cache_dir=str(tmp_path / "c" / "x"))
    (tmp_path / "c" / "x").write_text("a file where the cache's folder would be")
    with pytest.raises(ConfigError, match="set data.cache_dir to a writable folder"):
        build_datasets(blocked)
    for i in range(len(masked)):
        inputs, targets = masked[i]
        plain = torch.tensor(masked.cache.tokens[i * 8 + 1 : i * 8 + 9].astype(np.int64))
        after_eos = inputs == tokenizer.eos_id
        assert torch.equal(targets[~after_eos], plain[~after_eos])
        assert (targets[after_eos] == IGNORE_INDEX).all()


def test_documents_open_with_the_tokenizers_bos(tmp_path):
    folder = write_tokenizer(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": IM_START}))
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"body": corpus_line(i)}) + "\n" for i in range(40))
    )
    cfg = text_config(tmp_path / "docs.jsonl", folder, text_column="body")
    train, _ = build_datasets(cfg)
    tokenizer = load_tokenizer(str(folder))
    expected = [
        i for n in range(40) for i in [1, *tokenizer.encode([corpus_line(n)])[0], tokenizer.eos_id]
    ]
    assert tokenizer.bos_id == 1 and train.cache.tokens.tolist() == expected


def test_token_dtype_widens_past_16_bits():
    assert token_dtype(300) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(128_256) == np.uint32


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("bad.jsonl", '{"text": "ok"}\n{"text": broken\n', r"bad.jsonl:2 is not a line of JSON"),
        ("bad.jsonl", '{"body": "x"}\n', r"bad.jsonl:1 has no string field 'text'"),
        ("bad.jsonl", "[1, 2]\n", r"bad.jsonl:1 is not a JSON object"),
        ("bad.parquet", "PAR1 not parquet", r"bad.parquet cannot be read as parquet"),
        ("bad.txt", b"\xff\xfe text", r"bad.txt is not UTF-8"),
    ],
)
def test_bad_text_files_name_the_file(tmp_path, tokenizer_dir, name, content, message):
    root = tmp_path / "data"
    root.mkdir()
    path = root / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=message):
        build_datasets(text_config(root, tokenizer_dir))
    with pytest.raises(ConfigError, match="data.root=.* is a folder without"):
        build_datasets(text_config(tmp_path / "data" / CACHE_FOLDER, tokenizer_dir))


def test_text_checks_the_vocabulary_and_keeps_bytes_without_tokenizer(tmp_path, tokenizer_dir):
    write_corpus(tmp_path / "corpus")
    small = text_config(tmp_path / "corpus", tokenizer_dir)
    small.vocab_size = 64
    with pytest.raises(ConfigError, match="data.vocab_size=64 is smaller than the 300 tokens"):
        build_datasets(small)
    plain = DataConfig(name="text", root=str(tmp_path / "corpus" / "a.txt"), seq_len=8)
    train, _ = build_datasets(plain)
    assert type(train).__name__ == "TextBytes"
    plain.mask_documents = True
    with pytest.raises(ConfigError, match="data.mask_documents=true needs data.tokenizer"):
        build_datasets(plain)


def test_concurrent_builds_tokenize_once_and_workers_reopen_the_maps(
    tmp_path, tokenizer_dir, monkeypatch
):
    """Ranks starting together: one builds, the others wait on the lock and map its files. A
    data set pickled for a spawned loader worker carries the file names, not the tokens."""
    write_corpus(tmp_path / "corpus")
    builds = []
    encode = text_module.encode_documents
    monkeypatch.setattr(
        text_module, "encode_documents", lambda *a, **k: builds.append(1) or encode(*a, **k)
    )
    cfg = text_config(tmp_path / "corpus", tokenizer_dir)
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: build_datasets(cfg)[0], range(3)))
    assert builds == [1]
    assert all(r.cache.tokens.tolist() == results[0].cache.tokens.tolist() for r in results)
    copy = pickle.loads(pickle.dumps(results[0]))
    assert len(pickle.dumps(results[0])) < 1000 and isinstance(copy.cache.tokens, np.memmap)
    assert all(torch.equal(a, b) for a, b in zip(copy[5], results[0][5]))


# ----------------------------------------------------------------------------------------- chat

CONVERSATION = [
    {"role": "system", "content": "be kind"},
    {"role": "user", "content": "the cat"},
    {"role": "assistant", "content": "sat on a mat"},
    {"role": "user", "content": "and dogs"},
    {"role": "assistant", "content": "ran far away"},
]


def chat_config(root: Path, tokenizer: Path, **kwargs) -> DataConfig:
    return DataConfig(
        name="chat", root=str(root), tokenizer=str(tokenizer), seq_len=16, vocab_size=512, **kwargs
    )


def test_chat_trains_on_the_assistant_tokens_only(tmp_path, tokenizer_dir):
    root = tmp_path / "chat.jsonl"
    root.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(12)) + "\n")
    train, val = build_datasets(chat_config(root, tokenizer_dir))
    tok = load_tokenizer(str(tokenizer_dir))

    def ids(text: str) -> list[int]:
        return tok.encode([text])[0]

    # By hand: prompt pieces 0, the assistant's replies with their end-of-turn marker 1, then
    # the EOS that separates conversations 0.
    pieces = [
        (f"{IM_START}system\nbe kind{IM_END}\n{IM_START}user\nthe cat{IM_END}\n", 0),
        (f"{IM_START}assistant\n", 0),
        (f"sat on a mat{IM_END}\n", 1),
        (f"{IM_START}user\nand dogs{IM_END}\n{IM_START}assistant\n", 0),
        (f"ran far away{IM_END}\n", 1),
    ]
    one = [i for text, _ in pieces for i in ids(text)] + [tok.eos_id]
    flags = [flag for text, flag in pieces for _ in ids(text)] + [0]
    cache = train.cache
    assert cache.tokens[: len(one)].tolist() == one
    assert cache.trained[: len(one)].tolist() == flags
    assert cache.tokens.tolist() == one * 12 and cache.trained.tolist() == flags * 12
    assert tok.decode([t for t, f in zip(one, flags) if f]) == (
        f"sat on a mat{IM_END}\nran far away{IM_END}\n"
    )
    # Packed windows: a target counts exactly where its token is the assistant's.
    for dataset in (train, val):
        for i in range(len(dataset)):
            inputs, targets = dataset[i]
            begin = dataset.start + i * 16
            tokens = cache.tokens[begin + 1 : begin + 17].astype(np.int64)
            trained = cache.trained[begin + 1 : begin + 17].astype(bool)
            assert inputs.tolist() == cache.tokens[begin : begin + 16].tolist()
            assert targets.tolist() == np.where(trained, tokens, IGNORE_INDEX).tolist()
    # The tokenizer's template and the named fallback are the same chatml here.
    named, _ = build_datasets(chat_config(root, tokenizer_dir, chat_template="chatml"))
    assert named.cache.name == train.cache.name
    # Llama 3's layout: the replies and their <|eot_id|> are trained, the headers are not.
    llama, _ = build_datasets(chat_config(root, tokenizer_dir, chat_template="llama3"))
    trained = llama.cache.tokens[llama.cache.trained.astype(bool)].tolist()
    assert tok.decode(trained) == "sat on a mat<|eot_id|>ran far away<|eot_id|>" * 12


def test_chat_errors_name_the_key_or_the_line(tmp_path, tokenizer_dir):
    root = tmp_path / "chat.jsonl"
    root.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + '{"messages": "hi"}\n')
    with pytest.raises(ConfigError, match=r"chat.jsonl:2: no 'messages' list"):
        build_datasets(chat_config(root, tokenizer_dir))
    root.write_text(json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n")
    with pytest.raises(ConfigError, match=r"chat.jsonl:1: message 0 is not an object"):
        build_datasets(chat_config(root, tokenizer_dir))
    with pytest.raises(ConfigError, match="data.chat_template='zephyr' is not a known template"):
        build_datasets(chat_config(root, tokenizer_dir, chat_template="zephyr"))
    bare = write_tokenizer(tmp_path / "bare", template=None)
    with pytest.raises(ConfigError, match="has no chat_template .* data.chat_template=chatml"):
        build_datasets(chat_config(root, bare))
    # A template whose shorter renderings are not prefixes of the longer ones (the message count
    # in front): the assistant's tokens cannot be found.
    counting = write_tokenizer(
        tmp_path / "counting", template="{{ messages | length }}{{ messages[-1]['content'] }}"
    )
    root.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    with pytest.raises(ConfigError, match="does not begin with"):
        build_datasets(chat_config(root, counting))
    with pytest.raises(ConfigError, match="data.tokenizer is not set"):
        build_datasets(DataConfig(name="chat", root=str(root)))


# ------------------------------------------------------------------------ the loss's ignore_index


def test_prompt_tokens_carry_no_gradient(tmp_path, tokenizer_dir):
    root = tmp_path / "chat.jsonl"
    root.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(8)) + "\n")
    train, _ = build_datasets(chat_config(root, tokenizer_dir))
    inputs, targets = (torch.stack(t) for t in zip(*(train[i] for i in range(4))))
    ignored = targets == IGNORE_INDEX
    assert ignored.any() and (~ignored).any()
    torch.manual_seed(0)
    model = GPT(vocab_size=300, seq_len=16, dim=32, n_layers=1, n_heads=2)
    logits = model(inputs).detach().requires_grad_()
    # The Trainer's own loss function (also the pipeline's last-stage loss).
    trainer = SimpleNamespace(cfg=SimpleNamespace(loss=SimpleNamespace(label_smoothing=0.0)))
    loss = Trainer.loss_fn(trainer, logits, targets)
    loss.backward()
    assert logits.grad is not None
    assert torch.equal(logits.grad[ignored], torch.zeros_like(logits.grad[ignored]))
    assert (logits.grad[~ignored].abs().sum(-1) > 0).all()
    kept = F.cross_entropy(logits[~ignored], targets[~ignored])
    torch.testing.assert_close(loss, kept, rtol=1e-6, atol=0)
    # Evaluation's sums count only the trained targets.
    sums = metric_sums(logits.detach(), targets)
    assert sums["count"].item() == (~ignored).sum().item()
    torch.testing.assert_close(sums["loss"] / sums["count"], kept.detach())
    # A micro-batch without a trained target: loss 0 and no gradient, not 0/0.
    logits.grad = None
    empty = Trainer.loss_fn(trainer, logits, torch.full_like(targets, IGNORE_INDEX))
    empty.backward()
    assert empty.item() == 0.0 and not logits.grad.any()
