"""recipes/llama3_sft.yaml end to end on the CPU: a tiny Llama saved by transformers and a BPE
tokenizer trained offline go in (model.weights=hf:, data=chat), a few steps run from the command
line, ``format=hf`` exports the checkpoint with the tokenizer's files, and transformers'
AutoModelForCausalLM / AutoTokenizer load the export as it is: its logits equal the project's
model rebuilt from the same checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from sdnet_trainer.checkpoint import find_checkpoint
from sdnet_trainer.data.chat import TEMPLATES
from sdnet_trainer.data.tokenizer import load_tokenizer
from sdnet_trainer.export import ExportArgs, export
from sdnet_trainer.export.rebuild import load_model, trainer_class, training_config
from tests.support import CPU, corpus_line, run_cli, tiny_llama_config, write_bpe_tokenizer

transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")

VOCAB = 320  # the tokenizer's 300 tokens, padded as checkpoints pad their embeddings
SEQ_LEN = 32


def _hf_llama(folder) -> None:
    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=VOCAB,
        intermediate_size=48,
        max_position_embeddings=64,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        eos_token_id=0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="40KB")


def _conversations(path, count: int = 24) -> None:
    with path.open("w") as f:
        for i in range(count):
            messages = [
                {"role": "user", "content": corpus_line(i)},
                {"role": "assistant", "content": corpus_line(i + 1)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def test_sft_recipe_trains_from_hf_and_exports_back(tmp_path):
    hf_in, tokenizer = tmp_path / "hf_in", tmp_path / "tokenizer"
    _hf_llama(hf_in)
    write_bpe_tokenizer(tokenizer, template=TEMPLATES["chatml"])
    chats = tmp_path / "chat.jsonl"
    _conversations(chats)
    run_dir = tmp_path / "run"
    launch = run_cli(
        [
            "+recipe=llama3_sft",
            *CPU,
            f"model.weights=hf:{hf_in}",
            f"data.root={chats}",
            f"data.tokenizer={tokenizer}",
            f"data.vocab_size={VOCAB}",
            f"data.seq_len={SEQ_LEN}",
            "loop.max_steps=3",
            "loop.global_batch_size=4",
            "loop.eval_at_end=false",
            "sched.warmup_steps=1",
            "optim.lr=1e-3",  # the recipe's 2e-5 would barely move the weights in 3 steps
            "logging.trackers=[]",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        timeout=180,
    )
    assert launch.returncode == 0, launch.output[-3000:]
    out = tmp_path / "export"
    result = export(ExportArgs(checkpoint=str(run_dir / "checkpoints"), format="hf", out=str(out)))
    names = {p.name for p in result.files}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours_tokenizer = load_tokenizer(str(tokenizer))
    text = corpus_line(3)
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == ours_tokenizer.encode([text])[0]
    assert hf_tokenizer.eos_token_id == ours_tokenizer.eos_id == 0
    assert "<|im_start|>" in hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False
    )

    # The project's model, rebuilt from the same checkpoint as export rebuilds it.
    checkpoint = find_checkpoint(str(run_dir / "checkpoints"), key="checkpoint")
    cfg = training_config(checkpoint)
    ours = load_model(trainer_class(checkpoint, cfg, None)(cfg), checkpoint).eval()
    tokens = torch.tensor([ids + ids[:4]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, ours(tokens), rtol=0, atol=1e-5)
    # Trained: the weights moved from the Hugging Face checkpoint's.
    start = transformers.AutoModelForCausalLM.from_pretrained(hf_in)
    assert not torch.equal(start.lm_head.weight, reloaded.lm_head.weight)
