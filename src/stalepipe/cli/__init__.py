"""`stalepipe <command>`: the command-line interface. Every command has --help.

Bad input prints one line (`stalepipe: error: ...`) and exits with status 2; nothing is written.
The exit codes: `stalepipe.errors` and docs/failures.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from stalepipe.cli.checkpoint import _add_checkpoint
from stalepipe.cli.common import Subparsers, runs
from stalepipe.cli.data import _add_data
from stalepipe.cli.generate import _add_generate
from stalepipe.cli.studies import _add_demo, _add_report, _add_sweep, _add_toy, _add_verdict
from stalepipe.config import (
    PIPELINE_SCHEDULES,
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    config_help,
    upgrade_record,
)
from stalepipe.config.sections import DEFAULT_SCHEDULE
from stalepipe.config.shapes import count_params, describe
from stalepipe.errors import Preempted, UserError
from stalepipe.presets import PRESETS, get_preset

# Each cmd_* imports its command's machinery inside, not at the top (and build_config its
# file reader): this module builds every command's parser, so `stalepipe --help` and each
# `stalepipe COMMAND --help` would load it all (torch for most) before answering. The other
# cli modules follow the same rule.

HF_PREFIX = "hf:"  # `--init-from hf:DIR` (rundir.hf_checkpoint.PREFIX, spelled out: no torch)


def parse_overrides(tokens: Sequence[str]) -> dict[str, str]:
    """`--a.b 1 --c=2` -> {"a.b": "1", "c": "2"}; anything else is a usage error."""
    out: dict[str, str] = {}
    it = iter(tokens)
    for tok in it:
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(
                f"unexpected argument {tok!r}; overrides look like --train.num_steps 100"
            )
        key = tok[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            value = next(it, None)
            if value is None:
                raise ConfigError(f"--{key} needs a value")
        out[key] = value
    return out


def build_config(
    preset: str | None, config_file: str | None, overrides: dict[str, str]
) -> ExperimentConfig:
    """The defaults, then a preset (`--preset`, or a config file's top-level `preset = "..."`),
    then the config file's values (TOML or JSON, e.g. a run's config.json), then the dotted
    flags: each over the one before (`stalepipe config show` prints where each value came
    from)."""
    if preset and config_file:
        raise ConfigError(
            f"--preset and --config exclude each other; start the file from the preset with a "
            f'top-level line preset = "{preset}"'
        )
    if not config_file:
        base = get_preset(preset) if preset else ExperimentConfig()
        return apply_overrides(base, onto_the_emulator(base, overrides))
    from stalepipe.config.files import check_types, file_preset, over, read_config_file

    data = read_config_file(config_file)
    start = file_preset(data, config_file)
    if start is not None and start not in PRESETS:
        raise ConfigError(
            f"config file {config_file}: preset {start!r} is not one of {', '.join(PRESETS)}"
        )
    data = upgrade_record(data)  # an older run's record too
    check_types(data, ExperimentConfig, f"config file {config_file}")
    if start is None:
        cfg = ExperimentConfig.from_dict(data, strict=False)
    else:
        cfg = ExperimentConfig.from_dict(over(get_preset(start).to_dict(), data), strict=False)
    return apply_overrides(cfg, onto_the_emulator(cfg, overrides))


def onto_the_emulator(cfg: ExperimentConfig, overrides: dict[str, str]) -> dict[str, str]:
    """`--pipeline.engine emulate` on a runtime run's config (resuming it on the emulator, say):
    the runtime's own settings (its schedule, chunks and replicas) go back to the emulator's
    defaults, unless a flag sets them, when the schedule's delay is the run's delay policy, so
    the trajectory is the same and nothing the run did is dropped. Otherwise (a schedule whose
    delay is not the policy's) the emulator's refusal names the fix."""
    pc = cfg.pipeline
    if overrides.get("pipeline.engine") != "emulate" or pc.engine == "emulate":
        return overrides
    policy = overrides.get("delay.policy", cfg.delay.policy)
    if PIPELINE_SCHEDULES[pc.schedule].policy != policy:
        return overrides
    runtime_only = {
        "pipeline.schedule": DEFAULT_SCHEDULE,
        "pipeline.num_chunks": "1",
        "pipeline.num_replicas": "1",
    }
    return {**runtime_only, **overrides}


# ------------------------------------------------------------------------------------------
# commands: each one's parser (`_add_*`), then what it runs (`cmd_*`), in `--help` order
# ------------------------------------------------------------------------------------------


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help=f"start from a preset: {', '.join(PRESETS)}")
    p.add_argument(
        "--config",
        help="start from a config file: .toml or .json (e.g. a run's "
        "config.json; docs/cluster.md, 'Config files')",
    )


def _add_train(sub: Subparsers) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (any config field can be overridden)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a model. Override any config field with --section.field VALUE, e.g.\n"
        "  stalepipe train --preset cpu-small --optim.lr 3e-3 --train.num_steps 200",
        epilog="config fields:" + config_help(),
    )
    _add_config_args(p)
    add = p.add_argument
    add("--name", help="run name (same as --name in the config)")
    add("--resume", action="store_true", help="continue the run from its last checkpoint")
    add("--overwrite", action="store_true", help="delete an existing run of this name first")
    add(
        "--init-from",
        metavar="RUN[@STEP]|hf:DIR",
        help="start a new run from another run's newest "
        "checkpoint (or the one of STEP, or a ckpt_* checkpoint), with this run's settings; or "
        "from the weights of a Hugging Face Llama / Mixtral directory (hf:DIR, step 0, its shape "
        "in --model.* flags); the parent is recorded in meta.json",
    )
    add("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(fn=cmd_train)


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    overrides = parse_overrides(extra)
    cfg = build_config(args.preset, args.config, overrides)
    from stalepipe.training.peers.topology import under_torchrun

    if cfg.pipeline.engine == "distributed" and not (under_torchrun() or args.print_config):
        from stalepipe.training.launch.server import start_rank_server

        start_rank_server()  # its imports beside this process's (launch.server)
    from stalepipe.training.rundir.resume import parent_checkpoint, saved_run_location
    from stalepipe.training.train.loop import train

    # `--config RUN/config.json --resume` continues RUN from any working directory
    where = saved_run_location(args.config) if args.resume and args.config else None
    if where is not None and "out_dir" not in overrides:
        cfg = dataclasses.replace(cfg, out_dir=where[0], name=where[1])
    if args.name:
        cfg = dataclasses.replace(cfg, name=args.name)
    if args.print_config:
        print(cfg.to_json())
        return 0
    init_from, init_hf = None, None
    if args.init_from and args.init_from.startswith(HF_PREFIX):  # before anything is written
        from stalepipe.training.rundir.hf_checkpoint import open_hf

        (hf := open_hf(args.init_from)).check_fits(cfg.model)
        init_hf = hf.path
    elif args.init_from:
        init_from = parent_checkpoint(args.init_from, cfg.train.num_steps)
    if cfg.pipeline.engine == "distributed":  # one process per stage (docs/runtime.md)
        from stalepipe.training.launch.train import launch_train
        from stalepipe.training.rundir.startup import StartUp

        start = StartUp(
            resume=args.resume, overwrite=args.overwrite, init_from=init_from, init_hf=init_hf
        )
        return launch_train(cfg, start)
    result = train(
        cfg, resume=args.resume, overwrite=args.overwrite, init_from=init_from, init_hf=init_hf
    )
    if os.environ.get("RANK", "0") != "0" or not result.train_losses:
        return 0  # torchrun: rank 0 speaks for the run; nothing trained: said so already
    print(result.summary())
    return 0


def _add_simulate(sub: Subparsers) -> None:
    p = sub.add_parser(
        "simulate",
        help="time pipeline schedules: bubbles, throughput, memory, staleness",
        description="Discrete-event simulation of a pipeline schedule (per-rank action lists) "
        "on an analytic (--model/--device) or given (--times) cost model.",
    )
    add = p.add_argument
    add(
        "--schedule",
        default="1f1b",
        help="gpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-v | dualpipev | 2bw | pipedream | wpipe",
    )
    add("--compare", help="comma-separated schedules to show side by side")
    add("--stages", type=int, default=4, help="pipeline ranks P")
    add("--microbatches", type=int, default=8, help="microbatches per step m")
    add("--steps", type=int, default=1, help="optimizer steps N")
    add("--chunks", type=int, help="model chunks per rank (interleaved-1f1b; default 2)")
    add("--model", help="preset (e.g. smollm-360m) or llama-10b: analytic costs")
    add("--device", default="h100", help="h100 | h200 | a100 | cpu")
    add("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed")
    add("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    add("--microbatch-size", type=int, default=1, help="sequences per microbatch")
    add(
        "--partition",
        default="balanced",
        help="stage split with --model: balanced (by cost, default) | uniform | blocks per "
        'stage, e.g. "10,8,7,7" (as --pipeline.partition)',
    )
    add("--times", help='given costs, e.g. "f=1,b=2,opt=0.1,comm=0.05"')
    add("--sync-start", type=int, default=0, help="first K steps synchronous")
    add("--sync-cooldown", type=float, default=0.0, help="last K steps (or fraction) synchronous")
    add("--plot", help="write a Gantt chart (.png / .svg / .pdf)")
    add("--csv", help="write the timed actions (.csv)")
    add("--text", help="write the schedules' compact text form (.txt)")
    p.set_defaults(fn=runs("stalepipe.lab.sim.simulate:simulate_main"))


def _add_info(sub: Subparsers) -> None:
    p = sub.add_parser("info", help="parameter / FLOP counts and the stage split of a config")
    _add_config_args(p)
    p.set_defaults(fn=cmd_info)


def cmd_info(args: argparse.Namespace, extra: list[str]) -> int:
    cfg = build_config(args.preset, args.config, parse_overrides(extra))
    pc = cfg.pipeline
    print("\n".join(describe(cfg.model, cfg.data.seq_len, pc.num_stages, pc.partition)))
    return 0


def _add_config(sub: Subparsers) -> None:
    p = sub.add_parser(
        "config",
        help="show the resolved config and where each value comes from",
        description="Resolve a config as `stalepipe train` would (preset or --config file, then "
        "--section.field flags) and print every field with its source: flag, file, preset or "
        "default. Config files are TOML or JSON (docs/cluster.md, 'Config files').",
    )
    p.add_argument("action", choices=["show"], help="show: print the resolved config")
    _add_config_args(p)
    p.set_defaults(fn=cmd_config)


def cmd_config(args: argparse.Namespace, extra: list[str]) -> int:
    from stalepipe.config.files import file_preset, read_config_file, value_sources

    overrides = parse_overrides(extra)
    cfg = build_config(args.preset, args.config, overrides)
    data = read_config_file(args.config) if args.config else None
    preset = file_preset(data, args.config) if data is not None else args.preset
    data = upgrade_record(data) if data is not None else None
    rows = value_sources(cfg, preset=preset, file_data=data, overrides=overrides)
    layers = ["defaults", *([f"preset {preset}"] if preset else [])]
    layers += [*([f"file {args.config}"] if args.config else []), "flags"]
    print(f"# each over the one before: {' < '.join(layers)}")
    width = max(len(k) for k, _, _ in rows)
    for key, value, where in rows:
        print(f"{key:<{width}}  {json.dumps(value):<24}  {where}")
    return 0


def _add_presets(sub: Subparsers) -> None:
    p = sub.add_parser("presets", help="list the built-in presets")
    p.set_defaults(fn=cmd_presets)


def cmd_presets(args: argparse.Namespace, extra: list[str]) -> int:
    for name, fn in PRESETS.items():
        cfg = fn()
        n = count_params(cfg.model)["total"]
        print(f"{name:<14} {n / 1e6:8.2f}M params  {(fn.__doc__ or '').strip().splitlines()[0]}")
    return 0


def _add_export(sub: Subparsers) -> None:
    p = sub.add_parser(
        "export",
        help="export a run's checkpoint for Hugging Face transformers",
        description="Write safetensors + config.json (+ tokenizer) that transformers loads as "
        "LlamaForCausalLM (dense) or MixtralForCausalLM (MoE).",
    )
    p.add_argument("run", metavar="RUN", help="run directory, run name, or checkpoint file")
    # the keys of export.EXPORTERS, spelled out so that --help does not import torch
    p.add_argument("--format", choices=["hf"], default="hf", help="output format (default hf)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: the run's dtype)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(fn=runs("stalepipe.training.tools.export:export_main"))


def _add_eval(sub: Subparsers) -> None:
    p = sub.add_parser(
        "eval",
        help="validation loss / perplexity and multiple-choice tasks of a run, offline",
        description="Evaluate a run's newest checkpoint: loss and perplexity on a shard set, "
        "and multiple-choice tasks (built-in shakespeare-cloze, or JSONL files of "
        '{"context", "choices", "answer"}) scored by log-likelihood. Results go to '
        "<run>/eval_<step>.json.",
    )
    add = p.add_argument
    add("run", metavar="RUN", nargs="?", help="run directory, run name, or checkpoint")
    add("--data-dir", help="token shard directory (default: the run's data)")
    add("--split", default="val", help="shard split to score (default val)")
    add("--batches", type=int, help="batches to score (default train.num_eval_batches)")
    add("--full-split", action="store_true", help="score every token of the split once")
    add("--batch-size", type=int, help="sequences per batch (default the run's)")
    add("--seq-len", type=int, help="tokens per sequence (default the run's)")
    add("--task", action="append", help="shakespeare-cloze or a .jsonl file (repeatable)")
    add("--num-items", type=int, default=200, help="items of built-in tasks")
    add("--no-tasks", action="store_true", help="only the loss")
    add("--no-loss", action="store_true", help="only the tasks")
    add("--device", default="cpu", help="cpu | cuda | cuda:N")
    add("--out", help="results JSON (default <run>/eval_<step>.json)")
    add(
        "--write-task",
        metavar="PATH",
        help="write the shakespeare-cloze items as JSONL (+ an lm-eval task .yaml) and exit",
    )
    p.set_defaults(fn=runs("stalepipe.training.tools.evaluate:eval_main"))


COMMANDS = (
    _add_train,
    _add_data,
    _add_demo,
    _add_simulate,
    _add_info,
    _add_config,
    _add_presets,
    _add_export,
    _add_eval,
    _add_generate,
    _add_checkpoint,
    _add_sweep,
    _add_report,
    _add_verdict,
    _add_toy,
)


def make_parser() -> argparse.ArgumentParser:
    """The `stalepipe` argument parser: one subcommand per entry of COMMANDS."""
    parser = argparse.ArgumentParser(
        prog="stalepipe",
        description="Asynchronous pipeline-parallel LLM pretraining and gradient-delay studies.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def _spaced_set(argv: list[str]) -> str | None:
    """`sweep --set KEY VALUE` (a space for the '='), as the fix: 'KEY=VALUE'; None when
    fine (only `sweep` has --set; other commands take --section.field VALUE)."""
    if not argv or argv[0] != "sweep":
        return None
    for i, tok in enumerate(argv[:-2]):
        key, value = argv[i + 1], argv[i + 2]
        if tok == "--set" and "=" not in key and not value.startswith("-"):
            return f"{key}={value}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `stalepipe` console script."""
    parser = make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if (bad := _spaced_set(argv)) is not None:
        print(f"stalepipe: error: --set expects KEY=VALUE: write --set {bad}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra and args.fn not in (cmd_train, cmd_info, cmd_config):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args, extra) or 0
    except Preempted as e:  # not an error: the checkpoint is written, --resume continues
        if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks for the run
            print(f"stalepipe: {e}", file=sys.stderr)
        return e.exit_code
    except UserError as e:
        print(f"stalepipe: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(
            "stalepipe: interrupted at once; checkpoints already written are kept", file=sys.stderr
        )
        return 130
    except BrokenPipeError:  # `stalepipe ... | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
