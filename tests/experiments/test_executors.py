"""Sweeps through submitit (sweeps/executors.py): the SLURM array script, submitit's local
executor giving the pool's records, a preempted task requeueing itself, and bad flags."""

import dataclasses
import json
import subprocess

import pytest

from stalepipe.errors import UserError
from stalepipe.lab.sweeps import executors
from stalepipe.lab.sweeps.executors import SlurmOptions, sbatch_script
from stalepipe.lab.sweeps.grid import expand
from stalepipe.lab.sweeps.sweep import run_sweep
from stalepipe.training.launch import task as trainer
from stalepipe.training.launch.task import run_task


def test_the_sbatch_array_script_carries_every_option(tmp_path):
    opts = SlurmOptions(partition="gpu", account="proj", qos="high", time_min=120,
                        gpus_per_run=1, cpus_per_run=8, mem="64G", array_parallelism=4,
                        sbatch=("constraint=h100", "exclusive"), setup=("module load cuda",))  # fmt: skip
    text = sbatch_script(tmp_path / "sweep", opts, 10)
    for line in ["#SBATCH --array=0-9%4", "#SBATCH --partition=gpu", "#SBATCH --account=proj",
                 "#SBATCH --qos=high", "#SBATCH --time=120", "#SBATCH --gpus-per-node=1",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --mem=64G", "#SBATCH --constraint=h100",
                 "#SBATCH --exclusive", "#SBATCH --signal=USR1@90", "module load cuda",
                 "submitit.core._submit"]:  # fmt: skip
        assert line in text, line
    assert str(tmp_path / "sweep" / executors.SUBMITIT_DIR) in text


def test_bad_slurm_options_are_one_line_errors():
    with pytest.raises(UserError, match="--slurm-time must be >= 1"):
        SlurmOptions(time_min=0)
    with pytest.raises(UserError, match="give KEY=VALUE"):
        SlurmOptions(sbatch=("not a line",))


def test_cli_refuses_slurm_flags_without_the_slurm_executor(capsys):
    from stalepipe.cli import main

    code = main(["sweep", "--grid", "delay.policy=sync", "--slurm-partition", "gpu", "--dry-run"])
    assert code == 2 and "--slurm-* options configure --executor slurm" in capsys.readouterr().err


def test_a_preempted_task_requeues_itself(monkeypatch):
    calls = []
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0))  # fmt: skip

    def preempted(cfg, threads):
        raise SystemExit(75)

    monkeypatch.setattr("stalepipe.training.launch.task.run_one", preempted)
    assert run_task({}, 1) == 75 and calls == [["scontrol", "requeue", "12_3"]]


def test_a_refused_requeue_is_said_in_the_log_and_the_exit_status(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    refused = subprocess.CompletedProcess([], 1, "", "scontrol: error: Requeue of job disabled\n")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: refused)
    monkeypatch.setattr(
        "stalepipe.training.launch.task.run_one", lambda c, t: exec("raise SystemExit(75)")
    )
    assert run_task({}, 1) == 76  # EXIT_REQUEUE_FAILED: sacct shows it, not a quiet 75
    err = capsys.readouterr().err
    assert "scontrol requeue 77 failed (exit 1: scontrol: error: Requeue of job disabled)" in err
    assert "rerun the sweep to resume it" in err


# sbatch's long options (sbatch(1), Slurm 23-24): a generated line outside them would make
# sbatch refuse the whole script on the cluster, after the user waited for the queue
SBATCH_OPTIONS = set(
    [
        "account",
        "acctg-freq",
        "array",
        "batch",
        "bb",
        "bbf",
        "begin",
        "chdir",
        "cluster-constraint",
        "clusters",
        "comment",
        "constraint",
        "container",
        "contiguous",
        "core-spec",
        "cores-per-socket",
        "cpu-freq",
        "cpus-per-gpu",
        "cpus-per-task",
        "deadline",
        "delay-boot",
        "dependency",
        "distribution",
        "error",
        "exclude",
        "exclusive",
        "export",
        "export-file",
        "extra",
        "extra-node-info",
        "get-user-env",
        "gid",
        "gpu-bind",
        "gpu-freq",
        "gpus",
        "gpus-per-node",
        "gpus-per-socket",
        "gpus-per-task",
        "gres",
        "gres-flags",
        "hint",
        "hold",
        "ignore-pbs",
        "input",
        "job-name",
        "kill-on-invalid-dep",
        "licenses",
        "mail-type",
        "mail-user",
        "mcs-label",
        "mem",
        "mem-bind",
        "mem-per-cpu",
        "mem-per-gpu",
        "mincpus",
        "network",
        "nice",
        "no-kill",
        "no-requeue",
        "nodefile",
        "nodelist",
        "nodes",
        "ntasks",
        "ntasks-per-core",
        "ntasks-per-gpu",
        "ntasks-per-node",
        "ntasks-per-socket",
        "open-mode",
        "output",
        "overcommit",
        "oversubscribe",
        "parsable",
        "partition",
        "power",
        "prefer",
        "priority",
        "profile",
        "propagate",
        "qos",
        "quiet",
        "reboot",
        "requeue",
        "reservation",
        "signal",
        "sockets-per-node",
        "spread-job",
        "switches",
        "thread-spec",
        "threads-per-core",
        "time",
        "time-min",
        "tmp",
        "uid",
        "use-min-nodes",
        "verbose",
        "wait",
        "wait-all-nodes",
        "wckey",
        "wrap",
    ]
)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_dry_run_prints_the_script_with_sbatch_options_only(device, capsys):
    from stalepipe.cli import main

    argv = ["sweep", "optimizers", "--scale", "135m", "--executor", "slurm", "--dry-run"]
    assert main([*argv, "--set", f"train.device={device}"]) == 0
    out = capsys.readouterr().out
    script = out[out.index("#!") :]
    assert (
        out.splitlines()[out[: out.index("#!")].count("\n")] == "#!/bin/bash"
    )  # a line of its own
    lines = [ln for ln in script.splitlines() if ln.startswith("#SBATCH")]
    names = {ln.split()[1].lstrip("-").split("=")[0] for ln in lines}
    assert names <= SBATCH_OPTIONS, names - SBATCH_OPTIONS
    assert "#SBATCH --requeue" in lines and "#SBATCH --signal=USR1@90" in lines
    if device == "cuda":  # a GPU, CPUs and memory for each run, unasked
        assert {
            "#SBATCH --gpus-per-node=1",
            "#SBATCH --cpus-per-task=8",
            "#SBATCH --mem=64G",
        } <= set(lines)
    else:
        assert not any("gpus" in ln for ln in lines) and "#SBATCH --mem=8G" in lines
    assert main([*argv, "--set", f"train.device={device}", "--slurm-gpus-per-run", "0"]) == (
        2 if device == "cuda" else 0
    )
    if device == "cuda":
        assert "--slurm-gpus-per-run 0, but the runs train on CUDA" in capsys.readouterr().err


def _finals(out, names):
    rows = {n: [json.loads(x) for x in (out / n / "metrics.jsonl").read_text().splitlines()]
            for n in names}  # fmt: skip
    return {n: [r["loss"] for r in rs if "loss" in r] for n, rs in rows.items()}


def test_submitit_local_gives_the_pools_records(tiny_config, tmp_path):
    """The same two runs through the pool and through submitit's LocalExecutor (a real
    subprocess, as a SLURM array task runs it): the same losses, bit for bit."""
    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=4, eval_every=0)
    )
    specs = expand([[("sync", {"delay.policy": "sync"}), ("2bw", {"delay.policy": "2bw"})]])
    pool = run_sweep(trainer, specs, base, tmp_path / "pool", log=lambda m: None)
    sub = run_sweep(trainer, specs, base, tmp_path / "sub", log=lambda m: None, executor="submitit-local",
                    workers=2)  # fmt: skip
    assert sorted(pool.ran) == sorted(sub.ran) == ["2bw_s0", "sync_s0"] and not sub.failed
    names = ["sync_s0", "2bw_s0"]
    assert _finals(tmp_path / "pool", names) == _finals(tmp_path / "sub", names)
    assert (tmp_path / "sub" / executors.SUBMITIT_DIR).is_dir()


def test_slurm_without_sbatch_and_srun_is_one_line_that_makes_nothing(
    tmp_path, monkeypatch, capsys
):
    """Off the cluster, `--executor slurm` was submitit's traceback after the sweep and its
    runs' directories were made; now one line before anything is, and the commands found
    on PATH let it through."""
    from stalepipe.cli import main
    from stalepipe.lab.sweeps.executors import check_slurm

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    out = tmp_path / "sweep"
    argv = ["sweep", "--grid", "optim.lr=1e-3,2e-3", "--seeds", "1", "--out", str(out)]
    assert main([*argv, "--executor", "slurm"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "stalepipe: error: --executor slurm submits a job array with SLURM's sbatch and srun, but "
        "sbatch and srun are not on this machine's PATH; start the sweep on the cluster's login "
        "node, or pass --executor local to run it here (--dry-run prints the array's sbatch "
        "script without SLURM)\n"
    )
    assert not out.exists()
    assert main([*argv, "--executor", "slurm", "--dry-run"]) == 0  # the offered way works
    assert not out.exists()
    (bin_dir / "sbatch").write_text("#!/bin/sh\n")
    (bin_dir / "sbatch").chmod(0o755)
    with pytest.raises(UserError, match=r"but srun is not on this machine's PATH"):
        check_slurm()
    (bin_dir / "srun").write_text("#!/bin/sh\n")
    (bin_dir / "srun").chmod(0o755)
    check_slurm()
