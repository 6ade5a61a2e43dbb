"""`stalepipe eval RUN`: validation loss / perplexity on any shard set, and multiple-choice tasks
scored by log-likelihood, offline.

Multiple-choice tasks are JSONL files, one item per line:
    {"context": "...", "choices": ["...", "..."], "answer": 0}
(`question` is accepted for `context`). An item is scored as lm-evaluation-harness scores its
multiple-choice tasks: the log-probability of each choice's tokens given the context, `acc` takes
the highest sum, `acc_norm` the highest sum per byte of the choice (removes the length bias).
Every sequence starts with the tokenizer's `eot`, as documents do in our shards.

The built-in task `shakespeare-cloze` is generated from the packaged Shakespeare excerpt, so the
command works on a fresh machine without downloads: given two lines, which of four lines is the
real next one? Items come from the excerpt's validation document only (the one the default
`data.val_fraction` holds out), so a model trained on the excerpt has not seen them.
For lm-evaluation-harness itself, see docs/moe.md ("Downstream evaluation").
"""

from __future__ import annotations

import contextlib
import math
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from stalepipe.config import ExperimentConfig
from stalepipe.config.sections import check_device_name
from stalepipe.fileio import check_writable, write_json_atomic
from stalepipe.training.data import EVAL_SEED, Tokenizer, TokenLoader, check_vocab, tokenizer_class
from stalepipe.training.data.manifest import SPLITS, unigram_entropy
from stalepipe.training.rundir.checkpoint import list_checkpoints
from stalepipe.training.rundir.directory import run_data_dir
from stalepipe.training.tools.eval_tasks import (  # re-exported: part of evaluate's API
    BUILTIN_TASKS,
    EvalError,
    MCItem,
    get_task,
    load_task,
    shakespeare_cloze,
    write_lm_eval_task,
    write_task,
)
from stalepipe.training.tools.trained import load_trained
from stalepipe.training.train.devices import check_cuda
from stalepipe.training.train.emulated import evaluate_full


def continuation_logprob(logits: torch.Tensor, tokens: torch.Tensor, start: int) -> float:
    """Sum of log p(tokens[t] | tokens[:t]) for t >= start, from logits (T-1, V) of tokens[:-1].

    The loop-free form of: sum(log_softmax(logits[t - 1])[tokens[t]] for t in range(start, T)).
    """
    logp = F.log_softmax(logits[start - 1 :].float(), dim=-1)  # (T - start, V)
    return logp.gather(-1, tokens[start:].unsqueeze(-1)).sum().item()


@torch.no_grad()
def choice_logprobs(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    items: list[MCItem],
    *,
    max_len: int,
    batch_size: int = 16,
    device: str | torch.device = "cpu",
) -> list[list[float]]:
    """log p(choice | eot + context) for every choice of every item.

    Sequences are cut from the left to `max_len + 1` tokens (the choice is always kept whole when
    it fits), right-padded into batches: a causal model's logits at a position do not depend on
    later (padding) tokens, so batching does not change the scores.
    """
    seqs: list[tuple[list[int], int]] = []  # (tokens, index of the first choice token)
    for item in items:
        ctx = [tokenizer.eot, *tokenizer.encode(item.context)]
        for choice in item.choices:
            cont = tokenizer.encode(choice)
            if not cont:
                raise EvalError(f"empty choice in item with context {item.context[:40]!r}")
            toks = (ctx + cont)[-(max_len + 1) :]
            seqs.append((toks, max(1, len(toks) - len(cont))))
    scores: list[float] = []
    for b in _bar(range(0, len(seqs), batch_size), "choices", "batch"):
        chunk = seqs[b : b + batch_size]
        width = max(len(t) for t, _ in chunk) - 1
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, (toks, _) in enumerate(chunk):
            x[r, : len(toks) - 1] = torch.tensor(toks[:-1])
        logits = model(x.to(device)).float().cpu()  # (b, width, V)
        for r, (toks, start) in enumerate(chunk):
            scores.append(
                continuation_logprob(logits[r, : len(toks) - 1], torch.tensor(toks), start)
            )
    out, k = [], 0
    for item in items:
        out.append(scores[k : k + len(item.choices)])
        k += len(item.choices)
    return out


def _bar(it: Any, desc: str, unit: str) -> Any:
    """A progress bar on stderr while `stalepipe eval` works (silent when not a terminal)."""
    return tqdm(it, desc=desc, unit=unit, leave=False, disable=None)


def multiple_choice_metrics(items: list[MCItem], logprobs: list[list[float]]) -> dict[str, float]:
    """acc (argmax of the log-likelihood) and acc_norm (argmax per UTF-8 byte), lm-eval style,
    and `chance`: the accuracy of guessing (the mean of 1 / number of choices)."""
    acc = acc_norm = 0
    for item, lps in zip(items, logprobs, strict=True):
        per_byte = [lp / max(1, len(c.encode("utf-8"))) for lp, c in zip(lps, item.choices)]
        acc += max(range(len(lps)), key=lps.__getitem__) == item.answer
        acc_norm += max(range(len(lps)), key=per_byte.__getitem__) == item.answer
    n = len(items)
    chance = sum(1 / len(item.choices) for item in items) / n
    return {"acc": acc / n, "acc_norm": acc_norm / n, "chance": chance, "num_items": n}


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    data_dir: str | Path,
    *,
    seq_len: int,
    num_batches: int,
    batch_size: int,
    split: str = "val",
    seed: int = EVAL_SEED,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Mean next-token cross-entropy over batches 0..num_batches-1 of `split`, its perplexity,
    and the number of tokens scored (the same batches every time for the same seed)."""
    loader = TokenLoader(data_dir, split, seq_len, seed)
    was_training = model.training
    model.eval()  # MoE: CE only, no auxiliary losses
    total = 0.0
    for i in _bar(range(num_batches), f"{split} loss", "batch"):
        x, y = loader.batch(i, batch_size)
        total += model(x.to(device), y.to(device)).item()
    model.train(was_training)
    loss = total / num_batches
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": num_batches * batch_size * seq_len,
    }


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def run_tokenizer(tokenizer_name: str, data_dir: Path | None) -> Tokenizer:
    """The run's tokenizer: byte and gpt2 need no files, bpe its data directory's tokenizer.json."""
    cls = tokenizer_class(tokenizer_name)
    if tokenizer_name == "bpe":
        if data_dir is None or not (data_dir / "tokenizer.json").is_file():
            raise EvalError(
                "the run's bpe tokenizer is in its data directory, which is not here; pass "
                "--data-dir DIR (the directory with tokenizer.json)"
            )
        return cls.load(data_dir)
    return cls()


def _eval_data_dir(
    data_dir: str | Path | None, run_dir: Path, cfg: ExperimentConfig, needed: bool
) -> Path | None:
    """`--data-dir` if given, else the run's own data (prepared first when it is a built-in
    corpus) when the loss or a bpe tokenizer needs it, else None."""
    if data_dir is not None:
        path = Path(data_dir)
        if not path.is_dir():
            raise EvalError(f"--data-dir {path} is not a directory")
        return path
    if not needed:
        return None
    return run_data_dir(run_dir, cfg, fix="pass --data-dir DIR (the directory with its shards)")


def evaluate_run(
    run: str | Path,
    *,
    data_dir: str | Path | None = None,
    split: str = "val",
    num_batches: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    full_split: bool = False,
    tasks: tuple[str, ...] = ("shakespeare-cloze",),
    num_items: int = 200,
    skip_loss: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """Evaluate the newest checkpoint of `run`: {"checkpoint", "step", "val": {...} | None,
    "tasks": {name: metrics}}. `data_dir` defaults to the run's own data directory (prepared
    first when it is a built-in corpus); `seq_len`, `num_batches` and `batch_size` to the run's
    (data.seq_len, train.num_eval_batches, train.batch_size), so the val loss of the defaults is the
    one the training loop logged for that checkpoint."""
    check_eval_flags(
        split=split, num_batches=num_batches, batch_size=batch_size, seq_len=seq_len,
        num_items=num_items, device=device,
    )  # fmt: skip
    trained = load_trained(run)
    cfg = trained.config
    bad = [
        k for k, t in trained.state_dict.items() if t.is_floating_point() and not t.isfinite().all()
    ]
    if bad:
        raise _nonfinite(trained.path, f"has non-finite weights ({bad[0]})")
    model = trained.model(device)
    seq_len = seq_len or cfg.data.seq_len
    num_batches = num_batches or cfg.train.num_eval_batches
    batch_size = batch_size or cfg.train.batch_size
    if seq_len > cfg.model.max_seq_len:
        raise EvalError(f"--seq-len must be <= model.max_seq_len={cfg.model.max_seq_len}")
    needed = not skip_loss or cfg.data.tokenizer == "bpe"
    data_path = _eval_data_dir(data_dir, trained.path.parent, cfg, needed)
    result: dict[str, Any] = {"checkpoint": str(trained.path), "step": trained.step, "val": None}
    with trained.autocast(device):  # the precision the run trained (and validated) in
        if not skip_loss:
            assert data_path is not None
            check_vocab(data_path, cfg.model.vocab_size)
            if full_split:  # every token once, in non-overlapping windows
                loader = TokenLoader(data_path, split, seq_len, EVAL_SEED)
                loss, tokens = evaluate_full(
                    model, loader, batch_size, torch.device(device), contextlib.nullcontext()
                )
                val = {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens, "full": True}
            else:
                val = validation_loss(
                    model,
                    data_path,
                    seq_len=seq_len,
                    num_batches=num_batches,
                    batch_size=batch_size,
                    split=split,
                    device=device,
                )
            if not math.isfinite(val["loss"]):
                raise _nonfinite(trained.path, f"gives a non-finite {split} loss ({val['loss']})")
            chance = chance_losses(data_path, cfg.model.vocab_size)
            result["val"] = {"data_dir": str(data_path), "split": split, **val, **chance}
        result["tasks"] = {}
        if tasks:
            tokenizer = run_tokenizer(cfg.data.tokenizer, data_path)
            for task in tasks:
                items = get_task(task, num_items)
                lps = choice_logprobs(
                    model, tokenizer, items, max_len=cfg.model.max_seq_len, device=device
                )
                result["tasks"][task] = multiple_choice_metrics(items, lps)
    return result


def check_eval_flags(
    *,
    split: str,
    num_batches: int | None,
    batch_size: int | None,
    seq_len: int | None,
    num_items: int,
    device: str,
) -> None:
    """Refuse a flag `stalepipe eval` cannot use before the checkpoint is read, each in one line
    listing what it takes: a split the shards do not have, a count below 1 (`--batches 0` once
    meant the default silently: leaving the flag out says that), a device this machine lacks
    (the check `stalepipe train` makes)."""
    if split not in SPLITS:
        raise EvalError(
            f"--split must be one of {', '.join(SPLITS)} (the splits `stalepipe data prepare` "
            f"writes), got {split!r}"
        )
    counts = {
        "--batches": (num_batches, "leave it out for the run's train.num_eval_batches"),
        "--batch-size": (batch_size, "leave it out for the run's train.batch_size"),
        "--seq-len": (seq_len, "leave it out for the run's data.seq_len"),
        "--num-items": (num_items, "the default is 200"),
    }
    for flag, (value, default) in counts.items():
        if value is not None and value < 1:
            raise EvalError(f"{flag} must be a whole number >= 1, got {value}; {default}")
    check_device_name(device, "--device")
    check_cuda(device, "--device")


def _nonfinite(ckpt: Path, what: str) -> EvalError:
    """A checkpoint that cannot be evaluated: one line naming it and an earlier one."""
    earlier = [p for p in list_checkpoints(ckpt.parent) if p.name < ckpt.name]
    fix = f"evaluate an earlier one (stalepipe eval {earlier[-1]})" if earlier else "retrain it"
    return EvalError(f"checkpoint {ckpt} {what}: the run diverged or the file is damaged; {fix}")


def chance_losses(data_dir: Path, vocab_size: int) -> dict[str, float]:
    """What a model that learned nothing scores: `uniform_loss` = ln(vocab size), and
    `unigram_loss` = the entropy of the training tokens' frequencies (a model that learned
    only which tokens are common; `data/manifest.py:unigram_entropy`)."""
    out = {"uniform_loss": math.log(vocab_size)}
    with suppress(OSError, ValueError):  # shards of another tool without a train split
        out["unigram_loss"] = unigram_entropy(str(Path(data_dir).resolve()))
    return out


def save_results(result: dict[str, Any], path: str | Path | None = None) -> Path:
    """Write `result` as JSON; by default beside its checkpoint as `eval_<step>.json` (one file
    per evaluated checkpoint, so sync and async runs compare step by step)."""
    run_dir = Path(result["checkpoint"]).parent if path is None else None
    if run_dir is not None:
        path = run_dir / f"eval_{result['step']:08d}.json"
    path = check_writable(Path(path), within=run_dir)  # never through a link
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(path, result, within=run_dir)


def eval_main(
    run: str | None,
    *,
    data_dir: str | None = None,
    split: str = "val",
    batches: int | None = None,
    full_split: bool = False,
    batch_size: int | None = None,
    seq_len: int | None = None,
    task: list[str] | None = None,
    num_items: int = 200,
    no_tasks: bool = False,
    no_loss: bool = False,
    device: str = "cpu",
    out: str | None = None,
    write_task: str | None = None,
) -> str:
    """`stalepipe eval` (its flags as keywords): evaluate `run` and save the results, or with
    `write_task` only write the shakespeare-cloze items; returns the text to print."""
    if write_task:
        if num_items < 1:
            raise EvalError(f"--num-items must be a whole number >= 1, got {num_items}")
        path, yaml = write_cloze_task(write_task, num_items)
        return f"wrote {num_items} shakespeare-cloze items to {path}, lm-eval task {yaml}"
    if not run:
        raise EvalError("stalepipe eval needs RUN (a run directory or checkpoint file)")
    result = evaluate_run(
        run,
        data_dir=data_dir,
        split=split,
        num_batches=batches,
        batch_size=batch_size,
        seq_len=seq_len,
        full_split=full_split,
        tasks=() if no_tasks else tuple(task or BUILTIN_TASKS),
        num_items=num_items,
        skip_loss=no_loss,
        device=device,
    )
    return f"{format_results(result)}\nresults written to {save_results(result, out)}"


def write_cloze_task(path: str | Path, num_items: int) -> tuple[Path, Path]:
    """The built-in shakespeare-cloze items as JSONL at `path`, and its lm-eval task .yaml."""
    jsonl = write_task(shakespeare_cloze(num_items), path)
    return jsonl, write_lm_eval_task(jsonl)


def format_results(result: dict[str, Any]) -> str:
    """The human-readable summary `stalepipe eval` prints."""
    lines = [f"checkpoint {result['checkpoint']} (step {result['step']})"]
    val = result.get("val")
    if val:
        lines.append(
            f"{val['split']} loss {val['loss']:.4f}  perplexity {val['perplexity']:.2f}  "
            f"({val['tokens']:,} tokens of {val['data_dir']}"
            f"{', every window of the split' if val.get('full') else ''})"
        )
        if "uniform_loss" in val:
            unigram = f", unigram {val['unigram_loss']:.4f}" if "unigram_loss" in val else ""
            lines.append(f"  chance: uniform {val['uniform_loss']:.4f}{unigram}")
    for name, m in result.get("tasks", {}).items():
        lines.append(
            f"{name}: acc {m['acc']:.3f}  acc_norm {m['acc_norm']:.3f}  ({m['num_items']} items; "
            f"chance {m.get('chance', math.nan):.3f})"
        )
    return "\n".join(lines)


__all__ = [
    "BUILTIN_TASKS",
    "EvalError",
    "check_eval_flags",
    "MCItem",
    "choice_logprobs",
    "continuation_logprob",
    "eval_main",
    "evaluate_run",
    "format_results",
    "get_task",
    "load_task",
    "multiple_choice_metrics",
    "save_results",
    "shakespeare_cloze",
    "validation_loss",
    "write_cloze_task",
    "write_lm_eval_task",
    "write_task",
]
