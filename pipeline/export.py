"""`dipaco export --round R --out DIR`: every path of a round as a Hugging Face checkpoint.

    DIR/paths/<id>/   config.json, model.safetensors (sharded above 2 GB), generation_config.json,
                      tokenizer files: what `AutoModelForCausalLM.from_pretrained` reads, nothing of
                      dipaco's needed (a private module, model.path_specific_blocks, is in its path)
    DIR/router/       the router that sends a text to its path (the run's committed router/, _SUCCESS)
    DIR/README.md     the model card: grid, rounds, data, evaluation, how to route
    DIR/export.json   what was exported, from which run root and round

The conversion is models/hf.py's (the key map); this file only reads committed modules and writes
the directory. It is built under `DIR.partial` and renamed into place, so a DIR that exists is a
whole export: a rerun returns it at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from models.grid import all_path_ids, parse_path_id
from models.hf import save_path
from models.modular import ModelShape
from pipeline.core.config import Config
from pipeline.core.errors import InputError
from pipeline.routing.tokenizer import load_tokenizer
from pipeline.state import layout
from pipeline.state.module_store import load_path_modules
from pipeline.state.storage import RunRoot
from pipeline.tracking.uris import redact

log = logging.getLogger("dipaco")
EXPORT_INFO = "export.json"


def newest_modules(root: RunRoot) -> int:
    """The newest round whose modules are committed (round 0's once the run is initialised)."""
    round_index = layout.next_round(root)
    while round_index > 0 and not root.is_committed(layout.modules_dir(round_index)):
        round_index -= 1
    return round_index


def export_path(root: RunRoot, config: Config, round_index: int, path_id: str, out: Path, tokenizer) -> Path:
    """One path at the start of a round -> a save_pretrained directory (models/hf.py save_path)."""
    shape = ModelShape.from_config(config.model)
    modules = load_path_modules(root, round_index, parse_path_id(path_id, config.model.grid), shape, config.model.grid)
    return save_path(out, shape, modules, tokenizer)


def export_round(config: Config, root: RunRoot, round_index: int, out: str | Path) -> dict:
    """Every path of the round, the router and the model card under `out` (see the module docstring)."""
    out = Path(out)
    if (out / EXPORT_INFO).is_file():
        return json.loads((out / EXPORT_INFO).read_text())
    if out.exists():
        raise InputError(f"{out}: exists and is not a dipaco export; choose a new --out directory")
    if not root.is_committed(layout.modules_dir(round_index)):
        where = root.path(layout.modules_dir(round_index))
        raise InputError(f"{where}: round {round_index}'s modules are not committed")
    started, partial = time.time(), out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a crashed export's leftovers
    tokenizer = load_tokenizer(root, config.model.tokenizer)
    paths = all_path_ids(config.model.grid)
    for path_id in paths:
        export_path(root, config, round_index, path_id, partial / "paths" / path_id, tokenizer)
    router = layout.routing(config.router.discriminative_after, round_index).router
    if root.is_committed(router):
        root.get_dir(router, partial / "router")
        (partial / "router" / "_SUCCESS").write_bytes(root.read_bytes(f"{router}/_SUCCESS"))
    evals = {r: root.read_json(layout.eval_file(r)) for r in range(round_index + 1) if root.exists(layout.eval_file(r))}
    info = {
        "round": round_index,
        "grid": list(config.model.grid),
        "paths": paths,
        "source_run_root": redact(root.url),
        "tokenizer": config.model.tokenizer,
        "seconds": round(time.time() - started, 1),
    }
    (partial / "README.md").write_text(model_card(config, info, evals))
    (partial / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    os.replace(partial, out)  # the whole export appears at once
    log.info("exported round %d: %d paths to %s", round_index, len(paths), out)
    return info


def model_card(config: Config, info: dict, evals: dict[int, dict]) -> str:
    """README.md: what the checkpoints are, how they were trained and scored, and how to route."""
    m, t = config.model, config.train
    dense = len(info["paths"]) == 1
    rows = "\n".join(
        f"| {r} | {_num(e.get('perplexity'))} | {_num(e.get('bits_per_byte'))} | "
        + ", ".join(f"{p} {_num(v.get('perplexity'))}" for p, v in sorted((e.get("paths") or {}).items()))
        + " |"
        for r, e in sorted(evals.items())
    )
    source = f"started from `{m.init_from}`" if m.init_from else f"started from random weights (seed {m.init_seed})"
    route = (
        "A dense run: `paths/p0/` is the model; no routing is needed."
        if dense
        else "Route a text by its first "
        f"{config.router.prefix_tokens} tokens, as training did: `router/` is the run's router "
        "(`pipeline.routing.router.Router.load`; embedder `"
        + config.router.embedder
        + "`"
        + (
            f", the mean of hidden state {config.router.model_layer} of round {config.router.model_round}'s path "
            "model over the prefix, which `model.init_from` at round 0 makes the starting checkpoint itself"
            if config.router.embedder == "model"
            else ""
        )
        + "), and "
        "`Router.route_texts([text])` names the path directory to load. Without dipaco, any path "
        "is a complete language model; the router picks the one trained on text like yours."
    )
    return f"""# dipaco export: round {info["round"]} of `{info["source_run_root"]}`

{len(info["paths"])} path(s) of a DiPaCo grid `{info["grid"]}` (blocks per level {list(m.blocks_per_level)}, \
{m.path_specific_blocks} private block(s) per path), each a complete Hugging Face causal LM in
`paths/<id>/`, {source}, after {info["round"]} outer round(s) of {t.inner_steps} inner steps.

## Load one path

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("paths/{info["paths"][0]}")
tokenizer = AutoTokenizer.from_pretrained("paths/{info["paths"][0]}")
ids = [tokenizer.eos_token_id] + tokenizer("The French Revolution was", add_special_tokens=False)["input_ids"]
```

Training packed documents after an end-of-text token, so a prompt starts with one, as above (the
registered MLflow model does the same); then `model.generate(torch.tensor([ids]), ...)`.

## Routing

{route}

## Data

Training: `{config.data.train}`; held out: `{config.data.eval}`; tokenizer: {info["tokenizer"]}.

## Evaluation (routed, held-out documents)

| round | perplexity | bits per byte | per path perplexity |
|---|---|---|---|
{rows or "| - | not evaluated | | |"}
"""


def _num(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"
