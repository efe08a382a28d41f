"""Random prompts of an exact token count, from the model's own
``tokenizer.json`` (the ``tokenizers`` package, not vLLM: importing vLLM
costs over a minute on a loaded 2-core host)."""

from __future__ import annotations

from pathlib import Path

from kvlens.bench.grid import BenchError


def rng(seed: int, *key: int):
    """A numpy Generator for (seed, key...): the same prompts and arrivals for
    the same seed and grid position."""
    import numpy as np  # here for start-up cost: `kvlens --help` imports this module

    return np.random.default_rng([int(seed) & 0xFFFFFFFF, *key])


class PromptMaker:
    """Random prompts of an exact token count, built like vLLM's
    ``RandomDataset``: consecutive non-special token ids from a random
    offset, decoded, re-encoded and adjusted until the count matches.
    Raises BenchError when ``model_dir`` has no ``tokenizer.json``."""

    def __init__(self, model_dir: Path | str):
        from tokenizers import Tokenizer  # here for start-up cost, and it is an optional extra

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise BenchError(f"no tokenizer.json in {model_dir} (pass --model DIR)")
        self.tok = Tokenizer.from_file(str(path))
        special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.vocab = self.tok.get_vocab_size()
        self.allowed = [i for i in range(self.vocab) if i not in special]
        # tokens the server adds itself (BOS...), as vLLM subtracts them
        probe = "hello"
        self.num_special = max(
            0,
            len(self.tok.encode(probe, add_special_tokens=True).ids)
            - len(self.tok.encode(probe, add_special_tokens=False).ids),
        )

    def make(self, n_tokens: int, rng) -> str:
        """A prompt that re-encodes to exactly ``n_tokens`` (with the server's
        special tokens). Decode/encode does not always round-trip, so a few
        random starting points are tried; the closest one is the fallback."""
        target = max(1, n_tokens - self.num_special)
        best, best_err = "", None
        for _attempt in range(20):
            off = int(rng.integers(0, len(self.allowed)))
            ids = [self.allowed[(off + i) % len(self.allowed)] for i in range(target)]
            for _ in range(12):
                text = self.tok.decode(ids)
                ids = self.tok.encode(text, add_special_tokens=False).ids
                err = abs(len(ids) - target)
                if best_err is None or err < best_err:
                    best, best_err = text, err
                if err == 0:
                    return text
                if len(ids) > target:
                    ids = ids[:target]
                else:
                    extra = rng.integers(0, len(self.allowed), size=target - len(ids))
                    ids = ids + [self.allowed[int(j)] for j in extra]
        return best
