"""Multiple-choice tasks for `stalepipe eval`: JSONL files of items (see `experiments.evaluate`),
and the built-in `shakespeare-cloze`, generated from the packaged Shakespeare excerpt's
validation document so it works offline and a model trained on the excerpt has not seen it."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from stalepipe.config import DataConfig
from stalepipe.errors import UserError
from stalepipe.training.data import load_corpus, val_mask

BUILTIN_TASKS = ("shakespeare-cloze",)


class EvalError(UserError):
    """Bad eval input (task file, data directory); the message names the fix."""


@dataclass(frozen=True)
class MCItem:
    """One multiple-choice item: `choices[answer]` is the right continuation of `context`."""

    context: str
    choices: tuple[str, ...]
    answer: int


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------


def load_task(path: str | Path) -> list[MCItem]:
    """Read a JSONL multiple-choice task; EvalError naming the line for a malformed item."""
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"task file {path} does not exist")
    items = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            context = d["context"] if "context" in d else d["question"]
            choices, answer = tuple(str(c) for c in d["choices"]), int(d["answer"])
            assert isinstance(context, str) and len(choices) >= 2 and 0 <= answer < len(choices)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise EvalError(
                f"{path}:{lineno} is not a task item; expected "
                '{"context": str, "choices": [>= 2 str], "answer": index into choices}'
            ) from None
        items.append(MCItem(context, choices, answer))
    if not items:
        raise EvalError(f"task file {path} has no items")
    return items


def write_task(items: list[MCItem], path: str | Path) -> Path:
    """Write `items` as JSONL (the format `load_task` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for item in items:
            d = {"context": item.context, "choices": list(item.choices), "answer": item.answer}
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    return path


def write_lm_eval_task(jsonl_path: str | Path, task_name: str | None = None) -> Path:
    """Write an lm-evaluation-harness task config (`<stem>.yaml`) beside a JSONL task, so that
    `lm_eval --include_path DIR --tasks NAME` scores it from the local file, offline.

    Same scoring as ours (log-likelihood of each choice, acc and acc_norm), except that lm-eval
    does not prepend `eot` to the context. `target_delimiter: ""` because our contexts end in the
    separator (a newline) already.
    """
    jsonl_path = Path(jsonl_path).resolve()
    name = task_name or "stalepipe_" + jsonl_path.stem.replace("-", "_")
    yaml_path = jsonl_path.with_suffix(".yaml")
    yaml_path.write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {json.dumps(str(jsonl_path))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n"
        "  - metric: acc\n"
        "  - metric: acc_norm\n"
    )
    return yaml_path


def shakespeare_cloze(
    num_items: int = 200, seed: int = 0, num_choices: int = 4, context_lines: int = 2
) -> list[MCItem]:
    """ "Which line comes next?" from the excerpt's held-out document (deterministic in seed).

    Context: `context_lines` consecutive lines, each ending in a newline. Choices: the real next
    line and `num_choices - 1` other lines of the same document, in a seeded random order; only
    lines of >= 20 characters are asked about or used as distractors.
    """
    docs = list(load_corpus("excerpt", None, progress=False).documents())
    mask = val_mask([name for name, _ in docs], DataConfig().val_fraction)
    text = "\n".join(t for (_, t), is_val in zip(docs, mask, strict=True) if is_val)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    long = sorted({ln for ln in lines if len(ln) >= 20})
    rng = random.Random(seed)
    candidates = [i for i in range(context_lines, len(lines)) if len(lines[i]) >= 20]
    # Spread the items over the document; never two items on the same line.
    picks = sorted(rng.sample(candidates, min(num_items, len(candidates))))
    items = []
    for i in picks:
        answer_text = lines[i]
        distractors = rng.sample([ln for ln in long if ln != answer_text], num_choices - 1)
        choices = [answer_text, *distractors]
        rng.shuffle(choices)
        context = "".join(ln + "\n" for ln in lines[i - context_lines : i])
        items.append(MCItem(context, tuple(choices), choices.index(answer_text)))
    return items


def get_task(name_or_path: str, num_items: int = 200) -> list[MCItem]:
    """A built-in task by name, or a JSONL file by path."""
    if name_or_path == "shakespeare-cloze":
        return shakespeare_cloze(num_items)
    if not name_or_path.endswith(".jsonl") and not Path(name_or_path).exists():
        raise EvalError(
            f"unknown task {name_or_path!r}: give a built-in task ({', '.join(BUILTIN_TASKS)}) "
            "or a .jsonl file"
        )
    return load_task(name_or_path)


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------
