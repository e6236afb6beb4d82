"""What a new user judges the demo by, measured on a finished `make demo`: held-out bits per byte
and whether the registered champion writes words.

`python -m benchmarks.demo_check [--config configs/demo.yaml]` loads `models:/<name>@champion` as a
user would (through MLflow), asks it to continue five prompts with 30 tokens each (the pyfunc's
default sampling params: temperature 0.8, top k 40, seed 0), and counts the share of the words it
writes that occur in the training text. A continuation cut off by the token budget ends in a word
fragment; that one trailing fragment is left out of the count. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import re

from pipeline.core.config import load_config
from pipeline.run import Run
from pipeline.stages import summarize

PROMPTS = [
    "The French Revolution was",
    "Photosynthesis is the process",
    "The city is located",
    "In mathematics, a prime number",
    "The band released their first album",
]
NEW_TOKENS = 30
WORD = re.compile(r"[A-Za-z]+")


def training_words(globs: str | list[str]) -> set[str]:
    words: set[str] = set()
    for pattern in [globs] if isinstance(globs, str) else globs:
        for file in sorted(glob.glob(pattern)):
            opener = gzip.open if file.endswith(".gz") else open
            with opener(file, "rt", encoding="utf-8") as handle:
                for line in handle:
                    words.update(w.lower() for w in WORD.findall(json.loads(line).get("text", "")))
    return words


def continuation_words(text: str) -> list[str]:
    """The words of a continuation, without a fragment cut off at its end by the token budget."""
    words = WORD.findall(text)
    if words and text.rstrip() == text and text.endswith(words[-1]):
        words = words[:-1]
    return [w.lower() for w in words]


def main(argv: list[str] | None = None) -> dict:
    import mlflow

    from pipeline.tracking.uris import CHAMPION, tracking_uri

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    mlflow.set_tracking_uri(tracking_uri(config))
    model = mlflow.pyfunc.load_model(f"models:/{config.mlflow.registered_model}@{CHAMPION}")
    continuations = model.predict(PROMPTS, params={"max_new_tokens": NEW_TOKENS})
    known = training_words(config.data.train)
    words = [w for text in continuations for w in continuation_words(text)]
    evals = summarize(Run(config))["eval"]
    last = evals[max(evals)]
    result = {
        "bits_per_byte": last.get("bits_per_byte"),
        "perplexity": last.get("perplexity"),
        "round": last.get("round"),
        "words": len(words),
        "known_word_share": sum(w in known for w in words) / len(words) if words else 0.0,
        "unknown_words": sorted({w for w in words if w not in known}),
        "continuations": dict(zip(PROMPTS, continuations)),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
