"""Regenerate the built-in corpus and tokenizer shipped in offload_trainer/assets/.

The corpus is small, deterministic and learnable (arithmetic, orderings, short templated
stories), so a tiny random-init model shows a falling loss within a few dozen CPU steps.
The tokenizer is a byte-level BPE trained on that corpus (no network needed).

    python scripts/make_builtin_assets.py
"""
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parents[1] / "offload_trainer" / "assets"
NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
NAMES = "Ada Ben Cleo Dev Eli Fay Gus Hana Ivo June Kai Lena".split()
THINGS = [("apple", "red"), ("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"),
          ("banana", "yellow"), ("orange", "orange"), ("plum", "purple"), ("cloud", "grey")]
PLACES = "the park,the market,the library,the river,the station,the garden,the harbour".split(",")


def lines(rng: random.Random):
    for _ in range(900):
        a, b = rng.randint(0, 30), rng.randint(0, 30)
        yield f"{a} plus {b} equals {a + b}."
    for _ in range(300):
        i = rng.randrange(7)
        yield f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}."
    for _ in range(300):
        i = rng.randrange(12)
        yield f"After {NUMBERS[i]} comes {NUMBERS[i + 1]}."
    for _ in range(300):
        thing, color = rng.choice(THINGS)
        yield f"The {thing} is {color}."
    for _ in range(700):
        n1, n2 = rng.sample(NAMES, 2)
        place = rng.choice(PLACES)
        thing, color = rng.choice(THINGS)
        day = rng.choice(DAYS)
        yield (f"On {day}, {n1} went to {place} with {n2}. {n1} found a {color} {thing} there "
               f"and gave it to {n2}. {n2} said thank you, and they walked home together.")


def sft_pairs(rng: random.Random):
    for _ in range(400):
        a, b = rng.randint(0, 30), rng.randint(0, 30)
        yield {"prompt": f"What is {a} plus {b}?", "completion": f" {a} plus {b} equals {a + b}."}
    for _ in range(200):
        thing, color = rng.choice(THINGS)
        yield {"prompt": f"What color is the {thing}?", "completion": f" The {thing} is {color}."}


def main() -> None:
    rng = random.Random(0)
    corpus = list(lines(rng))
    rng.shuffle(corpus)
    (ASSETS / "corpus.txt").write_text("\n".join(corpus) + "\n")
    pairs = list(sft_pairs(rng))
    with open(ASSETS / "sft.jsonl", "w") as f:
        for p in pairs:
            f.write(json.dumps(p) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus + [p["prompt"] + p["completion"] for p in pairs], trainer)
    out = ASSETS / "tokenizer"
    out.mkdir(exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    chat = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
           "pad_token": "<|pad|>", "model_max_length": 4096, "chat_template": chat}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"{len(corpus)} lines, {len(pairs)} pairs, vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
