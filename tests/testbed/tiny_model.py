"""A tiny Qwen3 model for the real vLLM in the test bed: made here, never downloaded.

``python -m tests.testbed.tiny_model DIR`` (with the Python of the real vLLM's venv: it needs
torch, transformers and tokenizers) writes a Hugging Face model directory: a Qwen3ForCausalLM
(hidden 64, 2 layers, head_dim 32, the smallest the CPU attention backend takes) with random
weights from a fixed seed, and a byte-level BPE tokenizer trained on this file's own text, with
Qwen3's special tokens and a chat template whose generation prompt opens ``<think>``, as Qwen3
thinking models do. `vllm serve DIR --reasoning-parser qwen3` then answers like the real model
in shape: with a small ``max_tokens`` the text is all ``reasoning``, ``content`` is null and
``finish_reason`` is ``length``. The same inputs give the same files, byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 20261201
VOCAB_SIZE = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3's template, cut to what the probe and the tests send: system/user/assistant turns, and a
# generation prompt that opens the thinking block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}"
    "{{- '<think>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def _corpus() -> list[str]:
    text = Path(__file__).read_text()
    prose = "Thinking Process: the user asks a question. Let me think about it step by step. "
    return [text, prose * 20]


def make_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tokenizer.get_vocab_size()


def word_cycle(out: Path) -> list[int]:
    """The tokens the model answers with, in order: those that decode to letters only."""
    import random

    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    words = [
        i
        for i in range(len(tokenizer))
        if tokenizer.decode([i]).strip().isalpha() and i >= len(SPECIAL)
    ]
    random.Random(SEED).shuffle(words)
    return words


def _answer_in_a_cycle(model: object, cycle: list[int]) -> None:
    import torch

    embed = model.model.embed_tokens.weight  # type: ignore[attr-defined]
    with torch.no_grad():
        for layer in model.model.layers:  # type: ignore[attr-defined]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # Tokens outside the cycle lead into it; the head scores token t's successor by t's
        # embedding, and nothing else above zero.
        embed[[t for t in range(embed.shape[0]) if t not in set(cycle)]] = embed[cycle[-1]].clone()
        head = torch.zeros_like(embed)
        for before, after in zip(cycle, cycle[1:] + cycle[:1], strict=True):
            head[after] = embed[before]
        model.lm_head.weight.copy_(head)  # type: ignore[attr-defined]


def make_model(out: Path, vocab_size: int) -> None:
    import torch

    cycle = word_cycle(out)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    eos = SPECIAL.index("<|im_end|>")
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,  # divisible by TP=2: each rank holds one head
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=SPECIAL.index("<|endoftext|>"),
        eos_token_id=eos,
        torch_dtype="bfloat16",
    )
    model = Qwen3ForCausalLM(config)
    _answer_in_a_cycle(model, cycle)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    generation = {"eos_token_id": [eos], "pad_token_id": SPECIAL.index("<|endoftext|>")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    make_model(out, make_tokenizer(out))
    print(f"tiny Qwen3 model written to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
