"""The component configs: one frozen dataclass per component, each validating its own fields.

A component receives only its section. Rules that join sections (stages vs layers, the delay
policy vs the stage count, the distributed engine's limits) live in `experiment.py`. The delay
section has a module of its own, `delay.py`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from stalepipe.config.base import ConfigError, check, declares_settings, multiples_near, option
from stalepipe.config.limits import MAX_STEPS
from stalepipe.config.registry import LR_SCHEDULES, OPTIMIZERS, PIPELINE_SCHEDULES


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """LLaMA-style decoder shape. `num_kv_heads < num_heads` gives grouped-query attention."""

    vocab_size: int = option(256, "vocabulary size (must cover the tokenizer's ids)")
    dim: int = option(96, "residual stream width")
    num_layers: int = option(3, "number of transformer blocks")
    num_heads: int = option(4, "attention heads (dim must be divisible by it)")
    num_kv_heads: int = option(2, "key/value heads for GQA (divides num_heads)")
    ffn_dim: int = option(256, "SwiGLU hidden width")
    max_seq_len: int = option(128, "longest sequence RoPE is precomputed for")
    rope_theta: float = option(10000.0, "RoPE base frequency")
    norm_eps: float = option(1e-5, "RMSNorm epsilon")
    tie_embeddings: bool = option(True, "share the input embedding and the output head")
    init_std: float = option(0.02, "std of the normal init of linear and embedding weights")
    dropout: float = option(
        0.0, "dropout on attention probabilities and both residual branches (0 = off)"
    )
    # Mixture of Experts (docs/moe.md); num_experts = 0 is a dense model and ignores the rest.
    num_experts: int = option(0, "routed experts per MoE layer (0 = dense SwiGLU MLPs)")
    top_k: int = option(2, "experts each token is routed to (1..num_experts)")
    expert_ffn_dim: int = option(0, "hidden width of one expert (0 = ffn_dim)")
    num_shared_experts: int = option(0, "always-on experts per MoE layer (DeepSeekMoE style)")
    num_dense_layers: int = option(0, "first N blocks keep a dense SwiGLU of width ffn_dim")
    aux_loss_weight: float = option(0.01, "load-balancing loss weight (Switch Transformer)")
    z_loss_weight: float = option(0.001, "router z-loss weight (ST-MoE)")

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "dim",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "ffn_dim",
            "max_seq_len",
        ):
            check(getattr(self, name) >= 1, f"model.{name} must be >= 1, got {getattr(self, name)}")
        check(
            self.dim % self.num_heads == 0,
            f"model.dim ({self.dim}) must be divisible by model.num_heads ({self.num_heads})",
        )
        check(
            (self.dim // self.num_heads) % 2 == 0,
            f"model.dim / model.num_heads must be even for RoPE, got {self.dim // self.num_heads}",
        )
        check(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads "
            f"({self.num_kv_heads})",
        )
        check(self.rope_theta > 0, f"model.rope_theta must be > 0, got {self.rope_theta}")
        check(self.norm_eps > 0, f"model.norm_eps must be > 0, got {self.norm_eps}")
        check(self.init_std > 0, f"model.init_std must be > 0, got {self.init_std}")
        check(0 <= self.dropout < 1, f"model.dropout must be in [0, 1), got {self.dropout}")
        self._check_moe()

    def _check_moe(self) -> None:
        E = self.num_experts
        check(E >= 0, f"model.num_experts must be >= 0 (0 = dense), got {E}")
        for name in ("expert_ffn_dim", "num_shared_experts", "num_dense_layers"):
            v = getattr(self, name)
            check(v >= 0, f"model.{name} must be >= 0, got {v}")
        for name in ("aux_loss_weight", "z_loss_weight"):
            v = getattr(self, name)
            check(v >= 0, f"model.{name} must be >= 0, got {v}")
        if E == 0:
            for name in ("num_shared_experts", "num_dense_layers"):
                check(
                    getattr(self, name) == 0,
                    f"model.{name} needs an MoE model; set model.num_experts >= 1 or {name} 0",
                )
            return
        check(
            1 <= self.top_k <= E,
            f"model.top_k must be in [1, model.num_experts={E}], got {self.top_k}",
        )
        check(
            self.num_dense_layers < self.num_layers,
            f"model.num_dense_layers must be in [0, model.num_layers={self.num_layers}), got "
            f"{self.num_dense_layers}",
        )

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def expert_hidden_dim(self) -> int:
        """Hidden width of one routed (or shared) expert."""
        return self.expert_ffn_dim or self.ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has an MoE MLP (dense models and the first dense layers don't)."""
        return self.num_experts > 0 and layer >= self.num_dense_layers


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from. `stalepipe data prepare` writes shards into `data_dir`."""

    corpus: str = option("shakespeare", "built-in corpus name, or 'text' for --text files")
    tokenizer: str = option("byte", "tokenizer: byte | gpt2 | bpe | hf (a tokenizer.json)")
    bpe_vocab_size: int = option(4096, "vocab size when training the 'bpe' tokenizer")
    data_dir: str = option("", "token shard directory ('' = data_cache/<corpus>-<tokenizer>)")
    seq_len: int = option(64, "tokens per training sequence")
    val_fraction: float = option(0.05, "share of documents held out for validation")
    seed: int = option(0, "data order seed; batch k is a pure function of (seed, k)")

    def __post_init__(self) -> None:
        check(
            self.tokenizer in ("byte", "gpt2", "bpe", "hf"),
            f"data.tokenizer must be one of byte, gpt2, bpe, hf; got {self.tokenizer!r}",
        )
        check(self.seq_len >= 2, f"data.seq_len must be >= 2, got {self.seq_len}")
        check(
            0.0 < self.val_fraction < 1.0,
            f"data.val_fraction must be in (0, 1), got {self.val_fraction}",
        )
        check(
            self.bpe_vocab_size >= 257,
            f"data.bpe_vocab_size must be >= 257, got {self.bpe_vocab_size}",
        )

    def resolved_dir(self) -> str:
        return self.data_dir or f"data_cache/{self.corpus}-{self.tokenizer}"


@declares_settings("optim", OPTIMIZERS.settings)
@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer choice and hyperparameters. `None` means "the optimizer's own default"
    (see docs/optimizers.md); the resolved values are written to the run's config.json.
    The fields below are those optimizers share; an optimizer's own hyperparameters (muon's
    ns_steps, say) are the settings its spec declares (`OptimizerSpec.settings`), held in
    `declared` and read, set and shown like these (config/base.py, `declares_settings`).
    A field the chosen optimizer does not read (`OptimizerSpec.reads`, config/registry.py) must
    stay `None`; one it fixes (`OptimizerSpec.fixed`) may repeat the fixed value."""

    name: str = option("adamw", lambda: f"optimizer: {OPTIMIZERS.choices()}")
    lr: float | None = option(None, "peak learning rate (matrix params for muon)")
    beta1: float | None = option(None, "first-moment / momentum coefficient")
    beta2: float | None = option(None, "second-moment coefficient")
    eps: float | None = option(None, "denominator epsilon")
    weight_decay: float | None = option(
        None, "decoupled weight decay (not applied to norms/biases)"
    )
    # the registered optimizers' own settings off their defaults (config/base.py)
    declared: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        spec = OPTIMIZERS[self.name]  # ConfigError for an unknown name
        for names, ok, allowed in (
            (("lr",), lambda v: v > 0, "> 0"),
            (("beta1", "beta2"), lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
            (("eps", "weight_decay"), lambda v: v >= 0, ">= 0"),
        ):
            for name in names:
                v = getattr(self, name)
                check(v is None or ok(v), f"optim.{name} must be {allowed}, got {v}")
        self._check_fields_read(spec.reads, spec.fixed)

    def _check_fields_read(self, reads: tuple[str, ...], fixed: dict[str, Any]) -> None:
        """Refuse a value in a field the optimizer does not read (it would be ignored)."""
        shared = [f.name for f in dataclasses.fields(self) if f.name not in ("name", "declared")]
        unused = [  # in config.json's (alphabetical) order
            f
            for f in sorted((*shared, *OptimConfig.declared_settings()))
            if f not in reads and getattr(self, f) is not None and getattr(self, f) != fixed.get(f)
        ]
        if not unused:
            return
        names = ", ".join(f"optim.{f}" for f in unused)
        why = "".join(
            f" ({self.name} fixes optim.{f} at {fixed[f]!r})" for f in unused if f in fixed
        )
        users = [n for n, spec in OPTIMIZERS.items() if set(unused) & set(spec.reads)]
        raise ConfigError(
            f"{names} {'is' if len(unused) == 1 else 'are'} not used by optim.name="
            f"{self.name!r}{why}, which reads {', '.join(f'optim.{f}' for f in reads)}; set "
            f"{names} to none (used by {', '.join(users) or 'no optimizer'})"
        )


# The schedules are `PIPELINE_SCHEDULES` (config/registry.py; schedules/generators.py registers
# them): the distributed engine runs those with `runtime`, and refuses a delay.policy other than
# the one a schedule realises. The emulator has no schedule: its delay is delay.policy.
DEFAULT_SCHEDULE = "1f1b"


def _runtime_schedules() -> list[str]:
    return [n for n, spec in PIPELINE_SCHEDULES.items() if spec.runtime]


def _chunked_schedules() -> list[str]:
    """The runtime schedules with several stages per process."""
    return [n for n, spec in PIPELINE_SCHEDULES.items() if spec.runtime and spec.chunks != 1]


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How the model is split into stages, and which engine runs them.

    The emulator (engine=emulate) uses `num_stages` for per-stage staleness in one process; the
    distributed runtime (engine=distributed) runs one process per stage (times `num_replicas`),
    or `num_chunks` stages per process under interleaved-1f1b, zb-v and dualpipev.
    """

    num_stages: int = option(1, "pipeline stages P (<= model.num_layers)")
    engine: str = option("emulate", "emulate (one process) | distributed (one process per stage)")
    schedule: str = option(
        DEFAULT_SCHEDULE,
        lambda: (
            f"distributed engine's schedule: {' | '.join(_runtime_schedules())} (the "
            "emulator has none)"
        ),
    )
    num_chunks: int = option(
        1,
        "stages per process (interleaved-1f1b: >= 2; zb-v, dualpipev: 2; "
        "processes = num_stages / num_chunks)",
    )
    num_replicas: int = option(1, "data-parallel replicas of each stage (distributed engine)")
    backend: str = option("auto", "torch.distributed backend: auto | gloo | nccl")
    timeout_s: float = option(120.0, "seconds a rank waits for a peer before failing the run")
    partition: str = option(
        "balanced",
        "stage split: balanced (by FLOPs, the head on the last stage) | uniform | blocks per "
        "stage, e.g. 3,2,2,1",
    )

    def __post_init__(self) -> None:
        check(self.num_stages >= 1, f"pipeline.num_stages must be >= 1, got {self.num_stages}")
        check(
            self.partition in ("balanced", "uniform")
            or re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", self.partition) is not None,
            "pipeline.partition must be balanced, uniform or blocks per stage (e.g. 3,2,2,1), "
            f"got {self.partition!r}",
        )
        check(
            self.engine in ("emulate", "distributed"),
            f"pipeline.engine must be emulate or distributed; got {self.engine!r}",
        )
        if not PIPELINE_SCHEDULES[self.schedule].runtime:  # ConfigError for an unknown name
            raise ConfigError(
                f"pipeline.schedule {self.schedule} is not run by the distributed engine; "
                f"choose from {', '.join(_runtime_schedules())}"
            )
        check(
            self.num_replicas >= 1,
            f"pipeline.num_replicas must be >= 1, got {self.num_replicas}",
        )
        self._check_chunks()
        check(
            self.backend in ("auto", "gloo", "nccl"),
            f"pipeline.backend must be auto, gloo or nccl; got {self.backend!r}",
        )
        check(self.timeout_s > 0, f"pipeline.timeout_s must be > 0, got {self.timeout_s}")

    def _check_chunks(self) -> None:
        S, C = self.num_stages, self.num_chunks
        check(C >= 1, f"pipeline.num_chunks must be >= 1, got {C}")
        chunks = PIPELINE_SCHEDULES[self.schedule].chunks
        if chunks == 1:
            check(
                C == 1,
                f"pipeline.num_chunks {C} is read by pipeline.schedule "
                f"{' | '.join(_chunked_schedules())} only (every other schedule runs one stage per "
                f"process); set pipeline.num_chunks 1 or one of those schedules",
            )
            return
        if chunks is not None:
            assert chunks == 2 and self.placement == "v", self.schedule  # what the text says
            check(
                C == 2,
                f"pipeline.schedule {self.schedule} runs two stages per process, in a V (rank "
                f"r: stages r and 2R-1-r): set pipeline.num_chunks 2",
            )
            check(S % 2 == 0, f"pipeline.schedule {self.schedule} needs an even "
                  f"pipeline.num_stages (two per process), got {S}")  # fmt: skip
            return
        check(
            C >= 2,
            "pipeline.schedule interleaved-1f1b runs several stages per process: set "
            "pipeline.num_chunks to 2 or more (processes = pipeline.num_stages / num_chunks)",
        )
        ok = [c for c in range(2, S // 2 + 1) if S % c == 0]
        check(
            S % C == 0 and S // C >= 2,
            f"pipeline.schedule interleaved-1f1b needs pipeline.num_stages ({S}) = "
            f"pipeline.num_chunks ({C}) x at least 2 processes; "
            + (
                f"set pipeline.num_chunks to {' or '.join(map(str, ok))}"
                if ok
                else f"set pipeline.num_stages to {2 * C}"
            ),
        )

    @property
    def placement(self) -> str:
        """How stages map to processes (`pipeline.schedule.stage_rank`)."""
        return PIPELINE_SCHEDULES[self.schedule].placement

    @property
    def num_ranks(self) -> int:
        """Processes per pipeline (one replica's): num_stages / num_chunks."""
        return self.num_stages // self.num_chunks

    @property
    def num_processes(self) -> int:
        """Processes of a distributed run: num_ranks x num_replicas."""
        return self.num_ranks * self.num_replicas


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training loop: steps, batch, LR schedule, eval, checkpoints."""

    num_steps: int = option(200, "optimizer steps")
    batch_size: int = option(16, "sequences per global batch (split into microbatches)")
    num_microbatches: int = option(1, "microbatches per step; gradients are summed, loss averaged")
    lr_schedule: str = option(
        "cosine", lambda: f"LR schedule after the linear warmup: {LR_SCHEDULES.choices()}"
    )
    warmup_steps: int = option(20, "linear warmup steps")
    decay_frac: float = option(0.2, "WSD: fraction of steps in the final decay phase")
    min_lr_ratio: float = option(0.1, "final LR as a fraction of the peak")
    grad_clip: float = option(1.0, "global grad-norm clip (0 = off)")
    eval_every: int = option(50, "evaluate val loss every N steps (0 = only at the end)")
    num_eval_batches: int = option(8, "val batches per evaluation")
    final_eval_full: bool = option(
        False, "at the end, also score the whole val split (val_loss_full; the emulator engine)"
    )
    log_every: int = option(10, "write a metrics line every N steps")
    ckpt_every: int = option(0, "checkpoint every N steps (0 = only at the end)")
    ckpt_every_s: float = option(
        300.0, "also checkpoint once this many seconds passed since the last one (0 = off)"
    )
    keep_last: int = option(2, "checkpoints kept on disk")
    seed: int = option(0, "model init and dropout seed")
    threads: int = option(0, "torch intra-op threads (0 = leave torch's default)")
    device: str = option("cpu", "cpu | cuda | cuda:N")
    dtype: str = option(
        "float32", "compute dtype: float32 | bfloat16 (autocast; fp32 master weights)"
    )
    compile: bool = option(False, "torch.compile each block (numerics differ from eager's)")
    tf32: bool = option(True, "allow TF32 matmuls on CUDA (ignored on CPU)")
    progress: bool = option(
        True, "show progress: a bar on a terminal, a plain line every ~10% or 60 s otherwise"
    )
    tensorboard: bool = option(False, "also write metrics for TensorBoard to <run>/tensorboard")

    def __post_init__(self) -> None:
        check(
            1 <= self.num_steps <= MAX_STEPS,
            f"train.num_steps must be in [1, {MAX_STEPS:,}] (a run longer than that is a typo), "
            f"got {self.num_steps:,}",
        )
        check(self.batch_size >= 1, f"train.batch_size must be >= 1, got {self.batch_size}")
        check(
            self.num_microbatches >= 1,
            f"train.num_microbatches must be >= 1, got {self.num_microbatches}",
        )
        check(
            self.batch_size % self.num_microbatches == 0,
            f"train.batch_size ({self.batch_size}) must be divisible by train.num_microbatches "
            f"({self.num_microbatches}); set train.batch_size to "
            f"{multiples_near(self.batch_size, self.num_microbatches)}",
        )
        LR_SCHEDULES[self.lr_schedule]  # ConfigError for an unknown name
        check(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        check(
            0.0 <= self.decay_frac <= 1.0,
            f"train.decay_frac must be in [0, 1], got {self.decay_frac}",
        )
        check(
            0.0 <= self.min_lr_ratio <= 1.0,
            f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
        )
        check(self.grad_clip >= 0, f"train.grad_clip must be >= 0, got {self.grad_clip}")
        for name in ("eval_every", "ckpt_every", "ckpt_every_s", "threads"):
            check(getattr(self, name) >= 0, f"train.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("num_eval_batches", "log_every", "keep_last"):
            check(getattr(self, name) >= 1, f"train.{name} must be >= 1, got {getattr(self, name)}")
        check_device_name(self.device, "train.device")
        check(
            self.dtype in ("float32", "bfloat16"),
            f"train.dtype must be float32 or bfloat16, got {self.dtype!r}",
        )

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.num_microbatches


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device_name(device: str, key: str) -> None:
    """ConfigError unless `device` is a device stalepipe runs on: cpu, cuda or cuda:N (whether
    this machine has it is `train.devices.check_cuda`, asked when a run starts)."""
    check(
        _DEVICE.fullmatch(device) is not None,
        f"{key} must be cpu, cuda or cuda:N (N = a GPU index >= 0), got {device!r}",
    )


TRACKER_NAMES = ("tensorboard", "wandb", "trackio", "mlflow")  # rundir/trackers.py


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Experiment trackers beside metrics.jsonl (rundir/trackers.py); offline by default."""

    tracker: str = option(
        "", "comma list of tensorboard | wandb | trackio | mlflow ('' = metrics.jsonl only)"
    )
    project: str = option("stalepipe", "the trackers' project / experiment name")
    staleness: bool = option(False, "log update_rel/sS and grad_cos/sS per stage (emulator)")

    def __post_init__(self) -> None:
        names = [n.strip() for n in self.tracker.split(",") if n.strip()]
        bad = [n for n in names if n not in TRACKER_NAMES]
        choices = ", ".join(TRACKER_NAMES)
        check(not bad, f"log.tracker: unknown tracker {bad[:1]}; choose from {choices}")
        check(bool(self.project.strip()), "log.project must not be empty")

    @property
    def trackers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n.strip() for n in self.tracker.split(",") if n.strip()))
