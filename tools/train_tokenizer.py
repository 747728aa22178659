"""Train the shipped byte-level BPE tokenizer on the real Arena prompts and responses.

    python tools/train_tokenizer.py [--data ../shared/data] [--out tetri_server/assets/tokenizer]

Writes tokenizer.json and tokenizer_config.json (a transformers fast tokenizer). The output is
committed, because a fresh install has no shared data folder; `make_model` only copies it.
Training is deterministic: texts are fed in a sorted order, so two runs give identical bytes
(`--check` trains twice and compares).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data"
DEFAULT_OUT = REPO / "tetri_server" / "assets" / "tokenizer"

VOCAB_SIZE = 8192
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Order fixes the ids: <pad>=0, <s>=1, </s>=2, <|im_start|>=3, <|im_end|>=4.
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

# ChatML. The prompt starts with <s> because apply_chat_template tokenizes without adding
# special tokens; a plain encode adds <s> itself (the post-processor), like Llama.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def read_texts(data_dir: Path) -> list[str]:
    """All prompt and response texts, sorted so training input order is fixed."""
    paths = [data_dir / "arena_prompts.jsonl.gz"]
    paths += sorted(data_dir.glob("arena_responses_*.jsonl.gz"))
    texts: list[str] = []
    for path in paths:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                text = row.get("prompt", row.get("response", ""))
                if text:
                    texts.append(text)
    return sorted(set(texts))


def batches(texts: list[str], size: int = 1000) -> Iterator[list[str]]:
    for start in range(0, len(texts), size):
        yield texts[start : start + size]


def train(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(batches(texts), trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def write(tok: Tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    text = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="train twice, compare bytes")
    args = ap.parse_args(argv)

    texts = read_texts(args.data)
    print(f"training on {len(texts)} texts, {sum(map(len, texts)) / 1e6:.1f} M chars")
    write(train(texts), args.out)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            write(train(texts), Path(tmp))
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if (Path(tmp) / name).read_bytes() != (args.out / name).read_bytes():
                    print(f"NOT deterministic: {name} differs between two runs")
                    return 1
        print("deterministic: two runs gave identical bytes")
    for path in sorted(args.out.iterdir()):
        print(f"{path}  {path.stat().st_size / 1e3:.0f} kB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
