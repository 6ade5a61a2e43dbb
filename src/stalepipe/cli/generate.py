"""`stalepipe generate RUN PROMPT`: sample text from a run's newest checkpoint (read through the
verified loader, `experiments.trained`) or from an HF model directory (`hf:DIR`, or a directory
holding model.safetensors: what `stalepipe export` writes; `rundir.hf_checkpoint`).

The prompt is encoded with the tokenizer the model was trained with (the run's data directory,
or the directory's tokenizer.json) after the document separator every training document starts
with; sampling (`models.sample`) stops at the next separator or after --max-new-tokens.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from stalepipe.cli.common import Subparsers, runs
from stalepipe.errors import UserError

HF_FILES = ("model.safetensors", "model.safetensors.index.json")


def _add_generate(sub: Subparsers) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a run's checkpoint or an HF export",
        description="Continue PROMPT with a trained model: a run (directory, name or "
        "checkpoint) or a Hugging Face Llama / Mixtral directory (hf:DIR). The same seed gives "
        "the same text.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add("run", metavar="RUN", help="run directory, run name, checkpoint, or hf:DIR")
    add("prompt", metavar="PROMPT", help="the text to continue")
    add("--max-new-tokens", type=int, default=100, help="tokens to sample at most")
    add("--temperature", type=float, default=1.0, help="softmax temperature; 0 is greedy")
    add("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    add("--seed", type=int, default=0, help="seed of the draws")
    add("--device", default="cpu", help="cpu | cuda | cuda:N")
    add("--data-dir", help="the run's token data (its tokenizer), when not found by itself")
    p.set_defaults(fn=runs("stalepipe.cli.generate:generate_main"))


def _check(max_new_tokens: int, temperature: float, top_k: int) -> None:
    for ok, what in (
        (max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {max_new_tokens}"),
        (temperature >= 0, f"--temperature must be >= 0 (0 is greedy), got {temperature}"),
        (top_k >= 0, f"--top-k must be >= 0 (0: all tokens), got {top_k}"),
    ):
        if not ok:
            raise UserError(what)


def _is_hf(run: str) -> bool:
    return run.startswith("hf:") or any((Path(run) / name).is_file() for name in HF_FILES)


def _from_hf(run: str, device: str):
    """(model, tokenizer, max_seq_len, autocast) of an HF directory."""
    from stalepipe.training.data.hf_tokenizer import FILENAME, HfTokenizer
    from stalepipe.training.models import build_model
    from stalepipe.training.rundir.hf_checkpoint import load_hf_weights, open_hf

    checkpoint = open_hf(run)
    if not (checkpoint.path / FILENAME).is_file():
        raise UserError(f"{checkpoint.path} has no {FILENAME}; copy the model's tokenizer there")
    cfg = checkpoint.model_config()
    model = build_model(cfg, seed=0, device=device)
    load_hf_weights(dict(model.named_parameters()), cfg, checkpoint.path)
    tokenizer = HfTokenizer.from_file(checkpoint.path / FILENAME)
    return model.eval(), tokenizer, cfg.max_seq_len, contextlib.nullcontext()


def _from_run(run: str, device: str, data_dir: str | None):
    """(model, tokenizer, max_seq_len, autocast) of a run's newest checkpoint."""
    from stalepipe.training.data import load_tokenizer
    from stalepipe.training.rundir.directory import locate_run_data
    from stalepipe.training.tools.trained import load_trained

    trained = load_trained(run)
    cfg = trained.config
    data = Path(data_dir) if data_dir else locate_run_data(trained.path.parent, cfg)
    if data is None:
        raise UserError(
            f"the tokenizer of {run} is in its data directory {cfg.data.resolved_dir()}, which "
            f"is not here; pass --data-dir DIR (the run's token data)"
        )
    tokenizer = load_tokenizer(data)
    model = trained.model(device)
    return model, tokenizer, cfg.model.max_seq_len, trained.autocast(device)


def generate_main(
    run: str,
    prompt: str,
    *,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    device: str = "cpu",
    data_dir: str | None = None,
) -> str:
    """`stalepipe generate`: the prompt and its sampled continuation."""
    _check(max_new_tokens, temperature, top_k)
    from stalepipe.training.models.sample import sample

    if _is_hf(run):
        model, tokenizer, max_seq_len, autocast = _from_hf(run, device)
    else:
        model, tokenizer, max_seq_len, autocast = _from_run(run, device, data_dir)
    ids = [tokenizer.eot, *tokenizer.encode(prompt)]
    with autocast:
        out = sample(
            model,
            ids,
            max_new_tokens=max_new_tokens,
            max_seq_len=max_seq_len,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            stop=tokenizer.eot,
        )
    if out and out[-1] == tokenizer.eot:
        out = out[:-1]
    return prompt + tokenizer.decode(out)
