"""The test models' language (:mod:`kvtier.launch.testmodel`): seeded made-up words, a corpus of
sentences over them, the byte-level BPE tokenizer trained on it with the ``tokenizers`` library,
and seeded prompts of those words for tests and benchmarks."""

from __future__ import annotations

import json
import random
from pathlib import Path

_SPECIAL = ["<s>", "</s>", "<unk>", "<pad>"]


def word_list(seed: int, count: int = 1500) -> list[str]:
    """``count`` distinct made-up words from a seeded syllable generator."""
    rng = random.Random(seed)
    onsets = ["b", "k", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "pl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    codas = ["", "", "n", "r", "s", "l", "m", "k"]
    words: set[str] = set()
    while len(words) < count:
        syllables = rng.randint(1, 3)
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables)))
    return sorted(words)


def corpus(seed: int, num_sentences: int = 4000) -> list[str]:
    """Seeded sentences over :func:`word_list`, with punctuation and digits so BPE sees them."""
    rng = random.Random(seed + 1)
    words = word_list(seed)
    lines = []
    for _ in range(num_sentences):
        n = rng.randint(4, 18)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        lines.append(sentence.capitalize() + rng.choice([".", "!", "?", ", " + str(rng.randint(0, 999)) + "."]))
    return lines


def random_prompt(seed: int, num_words: int) -> str:
    """A seeded prompt of ``num_words`` words from the model's word list (for tests and benchmarks)."""
    rng = random.Random(seed)
    words = word_list(0)
    return " ".join(rng.choice(words) for _ in range(num_words))


def random_prompt_ids(tokenizer_path: Path, num_tokens: int, seed: int) -> list[int]:
    """Exactly ``num_tokens`` token ids of a seeded :func:`random_prompt` encoded with the
    ``tokenizer.json`` at ``tokenizer_path`` (the test model's own; benchmarks that drive an engine
    with ``prompt_token_ids``)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    words = num_tokens
    ids = tok.encode(random_prompt(seed, words)).ids
    while len(ids) < num_tokens:
        words *= 2
        ids = tok.encode(random_prompt(seed, words)).ids
    return list(ids[:num_tokens])


def write_tokenizer(out: Path, vocab_size: int, seed: int) -> int:
    """Train the BPE tokenizer on :func:`corpus` and write ``tokenizer.json``, ``tokenizer_config.json``
    and ``special_tokens_map.json`` into ``out``; returns the trained vocabulary size (at most ``vocab_size``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}, indent=2))
    return tok.get_vocab_size()
