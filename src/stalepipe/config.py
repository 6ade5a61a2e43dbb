"""Experiment configuration: frozen dataclasses and dotted overrides (presets: `presets.py`).

Each component owns one dataclass and receives only that one. `ExperimentConfig` composes them.
Every field carries a one-line help text in its metadata; `stalepipe train --help` prints them
with their defaults. Overrides use dotted keys: `--optim.lr 3e-4 --train.steps 200`.

Validation happens in `__post_init__` and raises `ConfigError` (a `ValueError`) whose message
names the field, its allowed range and the fix, so the CLI can print it as one line. Each rule is
checked here once: a section's own rules in its `__post_init__`, rules that join sections (stages
vs layers, the delay policy vs the stage count, the distributed engine's limits) in
`ExperimentConfig.__post_init__`. Lower layers may rely on a config they receive being valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from stalepipe.errors import UserError


class ConfigError(UserError, ValueError):
    """A bad configuration value; the message names the field and what it accepts."""


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _multiples_near(n: int, d: int) -> str:
    """The multiples of `d` next to `n` (>= 1), as 'a or b', for a divisibility fix."""
    below = n // d * d
    return f"{below} or {below + d}" if below else str(d)


def unknown_choice(
    what: str, name: str, choices: Iterable[str], key: str | None = None
) -> ConfigError:
    """The error for a name missing from a registry: lists the choices, suggests the closest.

    'unknown {what} {name!r}', or 'unknown {what} {key}={name!r}' when `key` is the config
    field the name came from.
    """
    choices = list(choices)
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.4)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    given = f"{key}={name!r}" if key else repr(name)
    return ConfigError(f"unknown {what} {given} (choose from {', '.join(choices)}){hint}")


# --------------------------------------------------------------------------------------------
# Component configs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """LLaMA-style decoder shape. `num_kv_heads < num_heads` gives grouped-query attention."""

    vocab_size: int = _f(256, "vocabulary size (must cover the tokenizer's ids)")
    dim: int = _f(96, "residual stream width")
    num_layers: int = _f(3, "number of transformer blocks")
    num_heads: int = _f(4, "attention heads (dim must be divisible by it)")
    num_kv_heads: int = _f(2, "key/value heads for GQA (divides num_heads)")
    ffn_dim: int = _f(256, "SwiGLU hidden width")
    max_seq_len: int = _f(128, "longest sequence RoPE is precomputed for")
    rope_theta: float = _f(10000.0, "RoPE base frequency")
    norm_eps: float = _f(1e-5, "RMSNorm epsilon")
    tie_embeddings: bool = _f(True, "share the input embedding and the output head")
    init_std: float = _f(0.02, "std of the normal init of linear and embedding weights")
    dropout: float = _f(
        0.0, "dropout on attention probabilities and both residual branches (0 = off)"
    )
    # Mixture of Experts (docs/moe.md); num_experts = 0 is a dense model and ignores the rest.
    num_experts: int = _f(0, "routed experts per MoE layer (0 = dense SwiGLU MLPs)")
    top_k: int = _f(2, "experts each token is routed to (1..num_experts)")
    expert_ffn_dim: int = _f(0, "hidden width of one expert (0 = ffn_dim)")
    num_shared_experts: int = _f(0, "always-on experts per MoE layer (DeepSeekMoE style)")
    num_dense_layers: int = _f(0, "first N blocks keep a dense SwiGLU of width ffn_dim")
    aux_loss_weight: float = _f(0.01, "load-balancing loss weight (Switch Transformer)")
    z_loss_weight: float = _f(0.001, "router z-loss weight (ST-MoE)")

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
            _check(
                getattr(self, name) >= 1, f"model.{name} must be >= 1, got {getattr(self, name)}"
            )
        _check(
            self.dim % self.num_heads == 0,
            f"model.dim ({self.dim}) must be divisible by model.num_heads ({self.num_heads})",
        )
        _check(
            (self.dim // self.num_heads) % 2 == 0,
            f"model.dim / model.num_heads must be even for RoPE, got {self.dim // self.num_heads}",
        )
        _check(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads "
            f"({self.num_kv_heads})",
        )
        _check(self.rope_theta > 0, f"model.rope_theta must be > 0, got {self.rope_theta}")
        _check(self.norm_eps > 0, f"model.norm_eps must be > 0, got {self.norm_eps}")
        _check(self.init_std > 0, f"model.init_std must be > 0, got {self.init_std}")
        _check(0 <= self.dropout < 1, f"model.dropout must be in [0, 1), got {self.dropout}")
        self._check_moe()

    def _check_moe(self) -> None:
        E = self.num_experts
        _check(E >= 0, f"model.num_experts must be >= 0 (0 = dense), got {E}")
        for name in ("expert_ffn_dim", "num_shared_experts", "num_dense_layers"):
            v = getattr(self, name)
            _check(v >= 0, f"model.{name} must be >= 0, got {v}")
        for name in ("aux_loss_weight", "z_loss_weight"):
            v = getattr(self, name)
            _check(v >= 0, f"model.{name} must be >= 0, got {v}")
        if E == 0:
            for name in ("num_shared_experts", "num_dense_layers"):
                _check(
                    getattr(self, name) == 0,
                    f"model.{name} needs an MoE model; set model.num_experts >= 1 or {name} 0",
                )
            return
        _check(
            1 <= self.top_k <= E,
            f"model.top_k must be in [1, model.num_experts={E}], got {self.top_k}",
        )
        _check(
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

    corpus: str = _f("shakespeare", "built-in corpus name, or 'text' for --text files")
    tokenizer: str = _f("byte", "tokenizer: byte | gpt2 | bpe")
    bpe_vocab_size: int = _f(4096, "vocab size when training the 'bpe' tokenizer")
    data_dir: str = _f("", "token shard directory ('' = data_cache/<corpus>-<tokenizer>)")
    seq_len: int = _f(64, "tokens per training sequence")
    val_fraction: float = _f(0.05, "share of documents held out for validation")
    seed: int = _f(0, "data order seed; batch k is a pure function of (seed, k)")

    def __post_init__(self) -> None:
        _check(
            self.tokenizer in ("byte", "gpt2", "bpe"),
            f"data.tokenizer must be one of byte, gpt2, bpe; got {self.tokenizer!r}",
        )
        _check(self.seq_len >= 2, f"data.seq_len must be >= 2, got {self.seq_len}")
        _check(
            0.0 < self.val_fraction < 1.0,
            f"data.val_fraction must be in (0, 1), got {self.val_fraction}",
        )
        _check(
            self.bpe_vocab_size >= 257,
            f"data.bpe_vocab_size must be >= 257, got {self.bpe_vocab_size}",
        )

    def resolved_dir(self) -> str:
        return self.data_dir or f"data_cache/{self.corpus}-{self.tokenizer}"


# The OptimConfig fields each optimizer reads; optim/registry.py holds their defaults (and a test
# checks that each optimizer's build changes with every field listed here).
OPTIMIZER_FIELDS: dict[str, tuple[str, ...]] = {
    "adamw": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "muon": ("lr", "beta1", "weight_decay", "nesterov", "ns_steps", "muon_scale", "adam_lr"),
    "soap": ("lr", "beta1", "beta2", "eps", "weight_decay", "precond_freq"),
    "adan": ("lr", "beta1", "beta2", "beta3", "eps", "weight_decay"),
    "lion": ("lr", "beta1", "beta2", "weight_decay"),
    "mars": ("lr", "beta1", "beta2", "eps", "weight_decay", "gamma", "adam_lr"),
}
# Fields an optimizer does not let a config change but records at the value it uses (config.json
# of every muon run so far has optim.eps 1e-8, the fixed eps of Muon's AdamW part); a config may
# repeat that value.
FIXED_OPTIM_FIELDS: dict[str, dict[str, Any]] = {"muon": {"eps": 1e-8}}


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer choice and hyperparameters. `None` means "the optimizer's own default"
    (see docs/optimizers.md); the resolved values are written to the run's config.json.
    A field the chosen optimizer does not read (`OPTIMIZER_FIELDS`) must stay `None`."""

    name: str = _f("adamw", f"optimizer: {' | '.join(OPTIMIZER_FIELDS)}")
    lr: float | None = _f(None, "peak learning rate (matrix params for muon)")
    beta1: float | None = _f(None, "first-moment / momentum coefficient")
    beta2: float | None = _f(None, "second-moment coefficient")
    beta3: float | None = _f(None, "third coefficient (adan: gradient-difference EMA)")
    eps: float | None = _f(None, "denominator epsilon")
    weight_decay: float | None = _f(None, "decoupled weight decay (not applied to norms/biases)")
    nesterov: bool | None = _f(None, "Nesterov momentum (muon)")
    ns_steps: int | None = _f(None, "Newton-Schulz iterations (muon)")
    muon_scale: str | None = _f(None, "muon LR scaling: 'original' | 'match_rms'")
    adam_lr: float | None = _f(None, "LR of the AdamW part of composite optimizers (muon, mars)")
    precond_freq: int | None = _f(None, "preconditioner update frequency (soap)")
    gamma: float | None = _f(None, "variance-reduction scale (mars)")

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_FIELDS:
            raise unknown_choice("optimizer", self.name, OPTIMIZER_FIELDS, key="optim.name")
        for names, ok, allowed in (
            (("lr", "adam_lr"), lambda v: v > 0, "> 0"),
            (("beta1", "beta2", "beta3"), lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
            (("eps", "weight_decay", "gamma"), lambda v: v >= 0, ">= 0"),
            (("ns_steps", "precond_freq"), lambda v: v >= 1, ">= 1"),
        ):
            for name in names:
                v = getattr(self, name)
                _check(v is None or ok(v), f"optim.{name} must be {allowed}, got {v}")
        _check(
            self.muon_scale in (None, "original", "match_rms"),
            f"optim.muon_scale must be 'original' or 'match_rms', got {self.muon_scale!r}",
        )
        self._check_fields_read()

    def _check_fields_read(self) -> None:
        """Refuse a value in a field the optimizer does not read (it would be ignored)."""
        reads = OPTIMIZER_FIELDS[self.name]
        fixed = FIXED_OPTIM_FIELDS.get(self.name, {})
        unused = [
            f
            for f in _OPTIM_HYPER_FIELDS
            if f not in reads and getattr(self, f) is not None and getattr(self, f) != fixed.get(f)
        ]
        if not unused:
            return
        names = ", ".join(f"optim.{f}" for f in unused)
        why = "".join(
            f" ({self.name} fixes optim.{f} at {fixed[f]!r})" for f in unused if f in fixed
        )
        users = [n for n, fs in OPTIMIZER_FIELDS.items() if set(unused) & set(fs)]
        raise ConfigError(
            f"{names} {'is' if len(unused) == 1 else 'are'} not used by optim.name="
            f"{self.name!r}{why}, which reads {', '.join(f'optim.{f}' for f in reads)}; set "
            f"{names} to none (used by {', '.join(users) or 'no optimizer'})"
        )


_OPTIM_HYPER_FIELDS = tuple(f.name for f in dataclasses.fields(OptimConfig) if f.name != "name")


# The delay policies by name (besides fixed:N); delay/policies.py implements each one.
POLICY_NAMES = ("sync", "2bw", "pipedream", "wpipe")


@dataclass(frozen=True, kw_only=True)
class DelayConfig:
    """Gradient-delay policy and mitigations (GUIDE section 2)."""

    policy: str = _f("sync", "delay policy: sync | 2bw | pipedream | wpipe | fixed:N")
    ef: bool = _f(False, "update-level error feedback W+ = W - 2U_k + U_{k-1}")
    taylor: float = _f(0.0, "DC-ASGD Taylor compensation lambda (0 = off)")
    taylor_adaptive: bool = _f(False, "adaptive lambda: taylor / sqrt(EMA of g^2)")
    taylor_ema: float = _f(0.95, "EMA coefficient of g^2 for adaptive Taylor")
    taylor_eps: float = _f(1e-8, "adaptive Taylor: added to sqrt(EMA of g^2)")
    sync_start: int = _f(0, "first K steps run without delay")
    sync_cooldown: float = _f(0.0, "last K steps without delay: K if >= 1, else a fraction")
    sync_cooldown_wsd: bool = _f(False, "cooldown = WSD's LR decay phase (overrides sync_cooldown)")
    mode: str = _f("fast", "emulator mode: fast (whole model) | exact (per stage, per microbatch)")

    def __post_init__(self) -> None:
        policy = self.policy
        if policy.startswith("fixed:"):
            n = policy.split(":", 1)[1]
            _check(n.isdigit(), f"delay.policy fixed:N needs an integer N >= 0, got {policy!r}")
        else:
            _check(
                policy in POLICY_NAMES,
                f"delay.policy must be {', '.join(POLICY_NAMES)} or fixed:N (N >= 0 steps); "
                f"got {policy!r}",
            )
        _check(self.taylor >= 0, f"delay.taylor must be >= 0, got {self.taylor}")
        _check(
            0.0 <= self.taylor_ema < 1.0,
            f"delay.taylor_ema must be in [0, 1), got {self.taylor_ema}",
        )
        _check(self.sync_start >= 0, f"delay.sync_start must be >= 0, got {self.sync_start}")
        _check(
            self.sync_cooldown >= 0,
            f"delay.sync_cooldown must be >= 0 (steps, or a fraction < 1), got "
            f"{self.sync_cooldown}",
        )
        _check(
            self.sync_cooldown < 1 or float(self.sync_cooldown).is_integer(),
            f"delay.sync_cooldown >= 1 is a step count and must be a whole number, got "
            f"{self.sync_cooldown}",
        )
        _check(self.taylor_eps > 0, f"delay.taylor_eps must be > 0, got {self.taylor_eps}")
        _check(
            self.mode in ("fast", "exact"),
            f"delay.mode must be 'fast' or 'exact', got {self.mode!r}",
        )


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How the model is split into stages, and which engine runs them.

    The emulator (engine=emulate) uses `num_stages` for per-stage staleness in one process; the
    distributed runtime (engine=distributed) runs one process per stage (times `data_parallel`).
    """

    num_stages: int = _f(1, "pipeline stages P (<= model.num_layers)")
    engine: str = _f("emulate", "emulate (one process) | distributed (one process per stage)")
    schedule: str = _f("1f1b", "runtime schedule: gpipe | 1f1b | 2bw | pipedream")
    data_parallel: int = _f(1, "data-parallel replicas of each stage (distributed engine)")
    backend: str = _f("auto", "torch.distributed backend: auto | gloo | nccl")
    timeout_s: float = _f(120.0, "seconds a rank waits for a peer before failing the run")

    def __post_init__(self) -> None:
        _check(self.num_stages >= 1, f"pipeline.num_stages must be >= 1, got {self.num_stages}")
        _check(
            self.engine in ("emulate", "distributed"),
            f"pipeline.engine must be emulate or distributed; got {self.engine!r}",
        )
        _check(
            self.data_parallel >= 1,
            f"pipeline.data_parallel must be >= 1, got {self.data_parallel}",
        )
        _check(
            self.backend in ("auto", "gloo", "nccl"),
            f"pipeline.backend must be auto, gloo or nccl; got {self.backend!r}",
        )
        _check(self.timeout_s > 0, f"pipeline.timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training loop: steps, batch, LR schedule, eval, checkpoints."""

    steps: int = _f(200, "optimizer steps")
    batch_size: int = _f(16, "sequences per global batch (split into microbatches)")
    num_microbatches: int = _f(1, "microbatches per step; gradients are summed, loss averaged")
    lr_schedule: str = _f("cosine", "LR schedule: cosine (warmup + cosine) | wsd | constant")
    warmup_steps: int = _f(20, "linear warmup steps")
    decay_frac: float = _f(0.2, "WSD: fraction of steps in the final decay phase")
    min_lr_ratio: float = _f(0.1, "final LR as a fraction of the peak")
    grad_clip: float = _f(1.0, "global grad-norm clip (0 = off)")
    eval_every: int = _f(50, "evaluate val loss every N steps (0 = only at the end)")
    eval_batches: int = _f(8, "val batches per evaluation")
    log_every: int = _f(10, "write a metrics line every N steps")
    ckpt_every: int = _f(0, "checkpoint every N steps (0 = only at the end)")
    keep_last: int = _f(2, "checkpoints kept on disk")
    seed: int = _f(0, "model init and dropout seed")
    threads: int = _f(0, "torch intra-op threads (0 = leave torch's default)")
    device: str = _f("cpu", "cpu | cuda | cuda:N")
    dtype: str = _f("float32", "compute dtype: float32 | bfloat16 (autocast; fp32 master weights)")
    compile: bool = _f(False, "torch.compile the model (first steps are slow while it compiles)")
    tf32: bool = _f(True, "allow TF32 matmuls on CUDA (ignored on CPU)")
    progress: bool = _f(True, "show a progress bar")
    tensorboard: bool = _f(False, "also write metrics for TensorBoard to <run>/tensorboard")

    def __post_init__(self) -> None:
        _check(self.steps >= 1, f"train.steps must be >= 1, got {self.steps}")
        _check(self.batch_size >= 1, f"train.batch_size must be >= 1, got {self.batch_size}")
        _check(
            self.num_microbatches >= 1,
            f"train.num_microbatches must be >= 1, got {self.num_microbatches}",
        )
        _check(
            self.batch_size % self.num_microbatches == 0,
            f"train.batch_size ({self.batch_size}) must be divisible by train.num_microbatches "
            f"({self.num_microbatches}); set train.batch_size to "
            f"{_multiples_near(self.batch_size, self.num_microbatches)}",
        )
        _check(
            self.lr_schedule in ("cosine", "wsd", "constant"),
            f"train.lr_schedule must be cosine, wsd or constant; got {self.lr_schedule!r}",
        )
        _check(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(
            0.0 <= self.decay_frac <= 1.0,
            f"train.decay_frac must be in [0, 1], got {self.decay_frac}",
        )
        _check(
            0.0 <= self.min_lr_ratio <= 1.0,
            f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
        )
        _check(self.grad_clip >= 0, f"train.grad_clip must be >= 0, got {self.grad_clip}")
        for name in ("eval_every", "ckpt_every", "threads"):
            _check(
                getattr(self, name) >= 0, f"train.{name} must be >= 0, got {getattr(self, name)}"
            )
        for name in ("eval_batches", "log_every", "keep_last"):
            _check(
                getattr(self, name) >= 1, f"train.{name} must be >= 1, got {getattr(self, name)}"
            )
        _check(
            self.dtype in ("float32", "bfloat16"),
            f"train.dtype must be float32 or bfloat16, got {self.dtype!r}",
        )

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.num_microbatches


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """Everything one run needs. `name` is the run directory under `out_dir`."""

    name: str = _f("run", "run name: results go to <out_dir>/<name>")
    out_dir: str = _f("runs", "parent directory of run directories")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    delay: DelayConfig = field(default_factory=DelayConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        _check(
            bool(self.name) and "/" not in self.name,
            f"name must be a non-empty directory name without '/', got {self.name!r}",
        )
        _check(
            self.pipeline.num_stages <= self.model.num_layers,
            f"pipeline.num_stages ({self.pipeline.num_stages}) must be <= model.num_layers "
            f"({self.model.num_layers})",
        )
        _check(
            self.data.seq_len <= self.model.max_seq_len,
            f"data.seq_len ({self.data.seq_len}) must be <= model.max_seq_len "
            f"({self.model.max_seq_len})",
        )
        self._check_delay()
        if self.pipeline.engine == "distributed":
            self._check_distributed()

    def _check_delay(self) -> None:
        """Rules of the delay config that depend on the pipeline and the training loop."""
        P, L = self.pipeline.num_stages, self.model.num_layers
        if self.delay.policy == "wpipe":
            even = [p for p in (P - 1, P + 1) if 2 <= p <= L and p % 2 == 0]
            fix = (
                f"set pipeline.num_stages to {' or '.join(map(str, even))}"
                if even
                else "it needs model.num_layers >= 2"
            )
            _check(
                P % 2 == 0,
                f"delay.policy wpipe needs an even pipeline.num_stages (WPipe splits the model "
                f"into two equal groups of stages, two per worker), got {P}; {fix}",
            )
        if self.delay.sync_cooldown_wsd:
            _check(
                self.train.lr_schedule == "wsd",
                f"delay.sync_cooldown_wsd aligns the cooldown with WSD's decay phase, but "
                f"train.lr_schedule is {self.train.lr_schedule!r}; set train.lr_schedule to wsd, "
                f"or delay.sync_cooldown_wsd to false and the cooldown in delay.sync_cooldown",
            )

    def _check_distributed(self) -> None:
        """Rules of the distributed engine (pipeline.engine distributed) alone."""
        pc, tc = self.pipeline, self.train
        P, m, B, D = pc.num_stages, tc.num_microbatches, tc.batch_size, pc.data_parallel
        _check(
            B % (m * D) == 0,
            f"train.batch_size ({B}) must be divisible by train.num_microbatches x "
            f"pipeline.data_parallel ({m} x {D}); set train.batch_size to "
            f"{_multiples_near(B, m * D)}",
        )
        if pc.schedule == "2bw" and m < P - 1:
            # the fix: the smallest count that works with this batch, or fewer stages
            ok = [n for n in range(P - 1, B // D + 1) if B % (n * D) == 0]
            more = f"train.num_microbatches to {ok[0]} or " if ok else ""
            raise ConfigError(
                f"pipeline.schedule 2bw needs train.num_microbatches >= pipeline.num_stages - 1 "
                f"= {P - 1} (a forward would need weights not yet updated), got {m}; "
                f"set {more}pipeline.num_stages to {m + 1}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExperimentConfig:
        return _from_dict(cls, d, prefix="")


def _from_dict(cls: type, d: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in d.items():
        if key not in names:
            raise ConfigError(_unknown_key_msg(prefix + key, _all_keys(ExperimentConfig)))
        if dataclasses.is_dataclass(hints[key]):
            kwargs[key] = _from_dict(hints[key], value, prefix + key + ".")
        else:
            kwargs[key] = value
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# Dotted overrides
# --------------------------------------------------------------------------------------------


def _all_keys(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Flat map 'section.field' -> Field for every leaf field."""
    hints = typing.get_type_hints(cls)
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_all_keys(hints[f.name], prefix + f.name + "."))
        else:
            out[prefix + f.name] = f
    return out


def _leaf_type(cls: type, dotted: str) -> Any:
    *path, leaf = dotted.split(".")
    for part in path:
        cls = typing.get_type_hints(cls)[part]
    return typing.get_type_hints(cls)[leaf]


def _unknown_key_msg(key: str, keys: dict[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.5)
    hint = f"; did you mean --{close[0]}?" if close else "; see `stalepipe train --help`"
    return f"unknown config key --{key}{hint}"


def parse_value(text: str, tp: Any, key: str) -> Any:
    """Parse a CLI string into the field's annotated type (handles `X | None`)."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        if text.lower() in ("none", "null"):
            return None
        tp = next(a for a in args if a is not type(None))
    try:
        if tp is bool:
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
        if tp is str:
            return text
    except ValueError:
        pass
    else:
        raise AssertionError(f"unsupported field type {tp} for {key}")
    raise ConfigError(f"--{key} expects a {tp.__name__}, got {text!r}")


def apply_overrides(cfg: ExperimentConfig, overrides: dict[str, str]) -> ExperimentConfig:
    """Return `cfg` with dotted-key string overrides applied (validated, typed)."""
    keys = _all_keys(ExperimentConfig)
    nested: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, text in overrides.items():
        if key not in keys:
            raise ConfigError(_unknown_key_msg(key, keys))
        value = parse_value(text, _leaf_type(ExperimentConfig, key), key)
        if "." in key:
            section, leaf = key.split(".", 1)
            nested.setdefault(section, {})[leaf] = value
        else:
            top[key] = value
    changes = {s: dataclasses.replace(getattr(cfg, s), **v) for s, v in nested.items()}
    return dataclasses.replace(cfg, **changes, **top)


def config_help() -> str:
    """Every overridable key with its type, default and help text, grouped by section."""
    lines = []
    section = None
    default_cfg = ExperimentConfig()
    for key, f in _all_keys(ExperimentConfig).items():
        sec = key.split(".")[0] if "." in key else ""
        if sec != section:
            section = sec
            lines.append(f"\n[{sec or 'run'}]")
        obj = default_cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        tp = _leaf_type(ExperimentConfig, key)
        tname = getattr(tp, "__name__", str(tp)).replace("NoneType", "None")
        if isinstance(tp, types.UnionType):
            tname = " | ".join(a.__name__ for a in typing.get_args(tp)).replace("NoneType", "None")
        lines.append(f"  --{key:<26} {tname:<12} default {obj!r}: {f.metadata.get('help', '')}")
    return "\n".join(lines)
