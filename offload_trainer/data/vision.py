"""Image-text data for vision-language models (Mllama: Llama-3.2-Vision), in the format TRL, LLaMA-Factory and axolotl
users have: records whose `messages` hold image parts (`{"type": "image"}`) beside text parts, and an `images` list
(paths, relative to the data file, or the images themselves in a `datasets` Image column), one per image part.

Images are opened only when their batch is collated (never all in memory); every path is checked to exist when the
dataset is built, so a missing file is reported before any model loads, naming the row. The text is the processor's
chat template; with `assistant_only_loss` (the default here) only the assistant turns carry a loss, found by rendering
the conversation turn by turn as for text (formats.py); the image tokens never do. The processor makes the batch the
model takes: `pixel_values`, `aspect_ratio_ids` / `aspect_ratio_mask`, `cross_attention_mask`.
"""
from __future__ import annotations

import os

import torch

from ..errors import DataError
from .formats import IGNORE_INDEX, Tokenize, _conversation, row_number, say_untrained

# A chat template for processors built here (random-init named architectures): image parts become the image token.
IMAGE_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                  "<|image|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|endoftext|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def build_processor(config, tokenizer):
    """A processor for a random-init Mllama-shaped model: its image processor at the config's tile size, and
    `tokenizer` with the image token added (at id `config.image_token_index` when that is the next id)."""
    import transformers

    vc = config.vision_config
    image_cls = getattr(transformers, "MllamaImageProcessorPil", None) or transformers.MllamaImageProcessor
    images = image_cls(size={"height": vc.image_size, "width": vc.image_size}, max_image_tiles=vc.max_num_tiles)
    if "<|image|>" not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|image|>"]})
    tokenizer.chat_template = tokenizer.chat_template if "image" in (tokenizer.chat_template or "") else IMAGE_TEMPLATE
    return transformers.MllamaProcessor(image_processor=images, tokenizer=tokenizer,
                                        chat_template=tokenizer.chat_template)


def image_parts(messages) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for c in m["content"] if isinstance(c, dict) and c.get("type") == "image")


def _readable(path: str, what: str) -> None:
    """The image's header parses (a few hundred bytes read, nothing decoded): a damaged or non-image file is reported
    when the dataset is built, not at its first batch."""
    from PIL import Image

    try:
        with Image.open(path):
            pass
    except Exception as e:  # PIL raises its own error types for a damaged or non-image file
        raise DataError(f"{what} cannot be read as an image ({type(e).__name__}: {str(e)[:120]})") from None


class ImageTextRecords(torch.utils.data.Dataset):
    """The raw records (messages, images), checked as they are built: every image part has its image, every path
    exists. Rows stay records: the collator renders, tokenizes and opens the images of a batch."""

    def __init__(self, raw, where: str, root: str):
        self.raw, self.where, self.root = raw, where, root
        idle = []  # (row, roles) of records with no assistant turn: the collator trains only those (assistant_only)
        for i in range(len(raw)):
            rec = raw[i]
            self._check(row_number(rec, i), rec)
            roles = [m.get("role") if isinstance(m, dict) else None for m in rec["messages"]]
            if "assistant" not in roles:
                idle.append((row_number(rec, i), roles))
        if idle:
            say_untrained(where, len(idle), len(raw), idle[0][0], f"only messages whose role is 'assistant' are "
                          f"trained, and its roles are {idle[0][1]}", "fix the data")

    def _check(self, row: int, rec: dict) -> None:
        where = f"{self.where} row {row}"
        messages, images = rec.get("messages"), rec.get("images") or []
        if not isinstance(messages, list):
            raise DataError(f"{where}: messages is missing, or not a list of messages")
        if image_parts(messages) != len(images):
            raise DataError(f"{where}: {image_parts(messages)} image part(s) in messages but "
                            f"{len(images)} image(s) in images: give one image per {{\"type\": \"image\"}} part")
        for path in images:
            if not isinstance(path, str):
                if not hasattr(path, "convert"):  # (a datasets Image column gives PIL images)
                    raise DataError(f"{where}: image {path!r} ({type(path).__name__}) is neither a "
                                    f"path nor an image: give each image as a path relative to the data file")
                continue
            if not os.path.isfile(self.path(path)):
                raise DataError(f"{where}: image {path!r} does not exist (paths are relative to the "
                                f"data file's directory)")
            _readable(self.path(path), f"{where}: image {path!r}")

    def path(self, p: str) -> str:
        return p if os.path.isabs(p) else os.path.join(self.root, p)

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int) -> dict:
        rec = self.raw[i]
        return {"row": row_number(rec, i), "messages": rec["messages"], "images": list(rec.get("images") or [])}


class ImageTextCollator:
    """Records -> the model's batch: the chat template's text tokenized turn by turn (labels on the assistant turns
    with `assistant_only`), the images opened and tiled by the processor, padded to the batch's longest row."""

    def __init__(self, processor, records: ImageTextRecords, *, max_length: int, assistant_only: bool = True):
        self.processor, self.records, self.max_length = processor, records, max_length
        self.tok = processor.tokenizer
        self.image_id = self.tok.convert_tokens_to_ids("<|image|>")
        self.spec = Tokenize(fmt="messages", assistant_only=assistant_only)

    def _open(self, row: int, path):
        from PIL import Image

        if not isinstance(path, str):  # a datasets Image column: already an image
            return path.convert("RGB")
        try:
            with Image.open(self.records.path(path)) as im:
                return im.convert("RGB")
        except Exception as e:  # PIL raises its own error types for a damaged or non-image file
            raise DataError(f"{self.records.where} row {row}: image {path!r} cannot be read "
                            f"({type(e).__name__}: {str(e)[:120]})") from None

    def _ids_and_labels(self, rec: dict) -> tuple[list[int], list[int]]:
        where = f"{self.records.where} row {rec['row']}"
        ids, labels = [], []
        for piece, trained in _conversation(rec["messages"], self.processor, self.spec, where):
            piece = self.tok(piece, add_special_tokens=False)["input_ids"] if isinstance(piece, str) else piece
            ids += piece
            labels += [t if trained is True and t != self.image_id else IGNORE_INDEX for t in piece]
        return ids[: self.max_length], labels[: self.max_length]

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        images = [[self._open(r["row"], p) for p in r["images"]] for r in rows]
        pairs = [self._ids_and_labels(r) for r in rows]
        texts = [self.processor.apply_chat_template(r["messages"], tokenize=False) for r in rows]
        self.tok.padding_side = "right"
        batch = dict(self.processor(text=texts, images=images if any(images) else None, padding=True,
                                    return_tensors="pt", add_special_tokens=False))
        n = min(batch["input_ids"].shape[1], self.max_length)
        for key in ("input_ids", "attention_mask", "cross_attention_mask"):  # (cut to max_length, as the labels)
            if key in batch:
                batch[key] = batch[key][:, :n]
        labels = torch.full((len(rows), n), IGNORE_INDEX, dtype=torch.long)
        for b, (ids, lab) in enumerate(pairs):
            got = batch["input_ids"][b, : len(ids)].tolist()
            if got != ids:  # (the processor's own tokenization of the text must give the same ids)
                raise DataError(f"{self.records.where} row {rows[b]['row']}: the chat template's text does not "
                                f"tokenize turn by turn as a whole: its assistant tokens cannot be told apart")
            labels[b, : len(lab)] = torch.tensor(lab)
        batch["labels"] = labels
        return batch


class RandomImageText(torch.utils.data.Dataset):
    """`dataset_path: random` for a vision-language model: rows of random tokens, each with one random image of every
    tile (the image token first), for throughput checks. Labels: the tokens, but the image token."""

    def __init__(self, config, seq_len: int, num_samples: int, seed: int = 0, dtype=torch.float32):
        self.config, self.seq, self.n, self.seed, self.dtype = config, seq_len, num_samples, seed, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        row = {k: v[0] for k, v in random_image_text_batch(self.config, 1, self.seq, generator=g).items()}
        labels = row["input_ids"].clone()
        labels[labels == self.config.image_token_index] = IGNORE_INDEX
        row["pixel_values"] = row["pixel_values"].to(self.dtype)
        return {**row, "labels": labels}


def random_image_text_batch(cfg, batch: int, seq: int, device="cpu", generator=None) -> dict:
    """Random inputs for an Mllama-style model: one image of `max_num_tiles` tiles per sequence (the image token
    first, every text token attending to every tile), for benchmarks and tests. Labels are the input ids."""
    vc, tc = cfg.vision_config, cfg.text_config
    tiles = vc.max_num_tiles
    ids = torch.randint(0, tc.vocab_size, (batch, seq), generator=generator)
    ids[:, 0] = cfg.image_token_index
    pixels = torch.randn(batch, 1, tiles, vc.num_channels, vc.image_size, vc.image_size, generator=generator)
    ratios = [list(r) for r in vc.supported_aspect_ratios]
    square = next(r for r in ratios if r[0] * r[1] == tiles)  # e.g. 2 x 2 tiles
    out = dict(input_ids=ids, pixel_values=pixels.to(torch.bfloat16),
               aspect_ratio_ids=torch.full((batch, 1), ratios.index(square) + 1),
               aspect_ratio_mask=torch.ones(batch, 1, tiles, dtype=torch.long),
               cross_attention_mask=torch.ones(batch, seq, 1, tiles, dtype=torch.long))
    return {k: v.to(device) for k, v in out.items()}
