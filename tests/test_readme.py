"""The README's code must run as written."""

import re
from pathlib import Path

import torch

from stalepipe.config import ModelConfig
from stalepipe.training.models import build_model

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_user_loop_example_runs_and_trains():
    text = README.read_text()
    snippet = re.search(
        r"To add a delay to your own training loop:\n\n```python\n(.*?)```", text, re.S
    )
    assert snippet, "README lost its user-loop example"
    model = build_model(
        ModelConfig(
            vocab_size=64,
            dim=32,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            ffn_dim=64,
            max_seq_len=16,
        ),
        seed=0,
    )
    batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))

    def next_batch(step):
        return batch, batch

    namespace = {"torch": torch, "model": model, "next_batch": next_batch, "steps": 20}
    exec(compile(snippet.group(1), "README.md", "exec"), namespace)  # noqa: S102
    opt = namespace["opt"]
    assert opt.step_count == 20
    assert model(batch, batch).item() < 3.5  # it learned the fixed batch (log 64 = 4.16 at init)


# ---- the README's shell commands ---------------------------------------------------------------


def _shell_commands() -> list[str]:
    """Every command of the README's bash blocks, continuation lines joined, comments cut."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [" ".join(line.split("#")[0].split()) for line in lines if line.split("#")[0].strip()]


def _train_args(command: str) -> list[str] | None:
    """The arguments after `stalepipe train` (plain or under torchrun), or None."""
    m = re.search(r"(?:^|\s)(?:-m )?stalepipe train(?:\s+(.*))?$", command)
    return m.group(1).split() if m and m.group(1) else ([] if m else None)


def _train_commands() -> list[list[str]]:
    found = [_train_args(c) for c in _shell_commands()]
    return [a for a in found if a is not None and "..." not in a and "--help" not in a]


def test_every_readme_train_command_has_a_valid_config(capsys):
    """Each `stalepipe train` line builds its config (no run): no refused or renamed setting.
    A `--config RUN/config.json` line must name a run an earlier line trains."""
    import json

    from stalepipe.cli import main

    commands = _train_commands()
    assert len(commands) >= 5, "README lost its train commands"
    trained: dict[str, dict] = {}
    for args in commands:
        if "--config" in args:
            path = args[args.index("--config") + 1]
            name = path.removeprefix("runs/").removesuffix("/config.json")
            assert name in trained, f"{path}: no earlier README command trains run {name!r}"
            continue
        assert main(["train", *args, "--print-config"]) == 0, args
        cfg = json.loads(capsys.readouterr().out)
        from stalepipe.config import ExperimentConfig

        warned = ExperimentConfig.from_dict(cfg).warnings()  # what `train` would print first
        assert not warned, f"{args} warns: {warned}"
        if "--resume" in args:  # a resume line must repeat the config of the run it resumes
            assert trained.get(cfg["name"], cfg) == cfg, f"{args} resumes with another config"
        trained.setdefault(cfg["name"], cfg)


def test_readme_torchrun_commands_split_the_batch_evenly(capsys):
    """The data-parallel emulator gives each of the N ranks train.batch_size / N rows in
    train.num_microbatches / N microbatches (train.distributed.init_data_parallel)."""
    import json

    from stalepipe.cli import main

    runs = [c for c in _shell_commands() if c.startswith(("torchrun", "srun torchrun"))]
    assert runs, "README lost its torchrun examples"
    for command in runs:
        args = _train_args(command)
        if args is None or "..." in args:
            continue
        ranks = int(re.search(r"--nproc-per-node (\d+)", command).group(1))
        assert main(["train", *args, "--print-config"]) == 0, command
        train = json.loads(capsys.readouterr().out)["train"]
        assert train["batch_size"] % ranks == 0 and train["num_microbatches"] % ranks == 0, command


def test_readme_reads_on_a_screen():
    """Issue 42: the first screen says what stalepipe is, its two set-up commands and the
    everyday commands; no prose line or table row is wider than 100 characters."""
    text = README.read_text()
    first = "\n".join(text.splitlines()[:45])
    for command in ("make demo", "make test", "pip install", "stalepipe train", "stalepipe sweep",
                    "stalepipe report", "stalepipe verdict", "stalepipe simulate"):  # fmt: skip
        assert command in first, command
    in_code, wide = False, []
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and len(line) > 100:
            wide.append(n)
    assert not wide, f"README lines over 100 characters outside code blocks: {wide}"
