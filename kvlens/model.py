"""A tiny random-weight Llama plus a small BPE tokenizer, generated locally.

No hub access: the config is built with ``transformers`` (random weights from
a fixed seed), the tokenizer is trained with ``tokenizers`` on generated text,
and both are written with ``save_pretrained`` so vLLM loads the directory as
any other model. ``head_dim`` is 32: vLLM's CPU attention kernel rejects 16.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("kvlens.model")

SEED = 1234
VOCAB_SIZE = 2000
MAX_LEN = 4096

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]

_WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are "
    "cache block prefill decode token request transfer memory push pull handshake "
    "latency throughput router engine model layer head attention key value write read "
    "fast slow first last time phase span trace metric queue batch server client "
    "hello world story once upon there lived small large quick brown fox jumps over lazy dog "
    "red green blue river mountain city market music light night day morning evening "
    "one two three four five six seven eight nine ten hundred thousand"
).split()


def _is_ready(path: Path) -> bool:
    return (
        (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
        and (path / "tokenizer_config.json").is_file()
    )


def _corpus(rng: random.Random, n_lines: int = 4000) -> list[str]:
    lines = []
    for _ in range(n_lines):
        n = rng.randint(5, 30)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", "!", "?", ","]))
    # every printable ASCII char so nothing maps to <unk>
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def _build_tokenizer(out: Path, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_LEN,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def ensure_model(path: Path | str, seed: int = SEED) -> Path:
    """Generate the tiny model at ``path`` unless it is already there.

    Idempotent and deterministic (fixed seeds). Written to a temporary sibling
    directory and renamed into place, so an interrupted run never leaves a
    half-written model that later looks ready.
    """
    path = Path(path).expanduser().resolve()
    if _is_ready(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("generating tiny random-weight Llama at %s", path)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    random.seed(seed)
    torch.manual_seed(seed)

    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=str(path.parent)))
    try:
        fast = _build_tokenizer(tmp, seed)
        cfg = LlamaConfig(
            vocab_size=len(fast),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=MAX_LEN,
            rms_norm_eps=1e-5,
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id,
            tie_word_embeddings=False,
            dtype="float32",
        )
        model = LlamaForCausalLM(cfg).to(torch.float32)
        model.eval()
        model.save_pretrained(str(tmp), safe_serialization=True)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("tiny model ready at %s", path)
    return path


if __name__ == "__main__":  # pragma: no cover
    import sys

    logging.basicConfig(level=logging.INFO)
    print(ensure_model(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".kvlens/model")))
