"""`stalepipe export RUN --format hf`: a run's checkpoint as a Hugging Face model directory.

Writes `config.json`, `model.safetensors` (or shards plus `model.safetensors.index.json`),
`generation_config.json` and, where the tokenizer can be expressed, `tokenizer.json` +
`tokenizer_config.json`, so that `AutoModelForCausalLM.from_pretrained(DIR)` loads
`LlamaForCausalLM` (dense) or `MixtralForCausalLM` (MoE) with logits equal to ours, and
`AutoTokenizer.from_pretrained(DIR)` gives the ids the run was trained on.

The names and config keys are `models.hf`'s (the one table that `train --init-from hf:DIR`
reads back): no reshaping, expert weights under the Mixtral checkpoint names that every
transformers version loads (version 5 fuses them into `gate_up_proj` / `down_proj` on load).
Mixtral has no shared experts and no dense layers, so MoE configs with either are refused.

The output directory is made by stalepipe and marked as an export (`fileio.MARKER`):
`--overwrite` replaces only such a directory, holding only what an export writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from stalepipe.config import ExperimentConfig, ModelConfig
from stalepipe.fileio import (
    check_removable,
    check_writable,
    follow_umask,
    make_temp_dir,
    mark_owned,
    owned_kind,
    refuse_protected,
    remove_owned_dir,
)
from stalepipe.lazy import require
from stalepipe.training.data.gpt2 import (  # GPT-2's byte <-> char table and files
    EOT_TEXT,
    _byte_alphabet,
    _read_package_file,
)
from stalepipe.training.models.hf import (
    ARCHITECTURES,
    HfFormatError,
    hf_architecture,
    hf_fields,
    hf_name,
)
from stalepipe.training.rundir.directory import locate_run_data
from stalepipe.training.tools.trained import load_trained

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30  # the shard size Hugging Face uses for large models
EXPORT_KIND = "export"  # the kind in an export directory's marker
# Everything an export writes: --overwrite replaces a directory only when it holds nothing else.
EXPORT_ENTRIES = (
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
EXPORT_FIX = "choose another --out"


# One error for both directions of the HF mapping (`models.hf`): what cannot be exported as HF
# (a Mixtral without room for shared experts) and what an export refuses (its --out, --dtype).
ExportError = HfFormatError


@dataclass
class ExportResult:
    out_dir: Path
    architecture: str
    files: list[str]
    tokenizer: str | None  # None when no tokenizer could be written (the reason is in `notes`)
    notes: list[str]


# --------------------------------------------------------------------------------------------
# config.json and parameter names (pure functions of the config)
# --------------------------------------------------------------------------------------------


def hf_config(cfg: ExperimentConfig, dtype: torch.dtype, eos_token_id: int | None) -> dict:
    """The `config.json` of the exported model."""
    m = cfg.model
    arch = hf_architecture(m)
    out = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch],
        **hf_fields(m),  # the shape, RoPE, norm and tie (one table, models.hf.HF_FIELDS)
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        # transformers < 5 reads rope_theta, >= 5 rope_parameters: write both
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "initializer_range": m.init_std,
        "attention_dropout": m.dropout,  # HF Llama has no residual dropout (inference: none)
        "bos_token_id": eos_token_id,  # documents start with eot (the llm.c convention)
        "eos_token_id": eos_token_id,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),  # the name before transformers 5
    }
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        out.update(
            # HF's balance loss is top_k times ours (see moe.load_balancing_loss)
            router_aux_loss_coef=m.aux_loss_weight / m.top_k,
            output_router_logits=False,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    return out


def hf_state_dict(
    state_dict: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Our checkpoint's tensors under HF names, contiguous, in `dtype` (tied head dropped)."""
    hf_architecture(cfg)
    out = {}
    for name, tensor in state_dict.items():
        target = hf_name(name, cfg)
        if target is not None:
            out[target] = tensor.detach().to(dtype=dtype).contiguous()
    return out


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _byte_level_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """A byte-level BPE `tokenizers.Tokenizer` with GPT-2's pre-tokenizer and decoder."""
    require("tokenizers", "the exported tokenizer.json")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # optional: required above

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_tokenizer():
    """Our byte tokenizer (id = UTF-8 byte) as a byte-level BPE with no merges: each byte is
    one character of GPT-2's byte alphabet, mapped to its byte value as id."""
    # optional (the tokenizers extra): require names it in one line when it is missing
    pre_tokenizers = require("tokenizers", "the exported tokenizer.json").pre_tokenizers
    vocab = {char: byte for char, byte in _byte_alphabet().items() if byte != 0}
    # Byte 0 is our eot (corpora strip NUL from text): name it as the special token, so HF tools
    # that need a bos/eos token (generation, lm-eval's prefix token) find it at id 0.
    vocab[EOT_TEXT] = 0
    tok = _byte_level_tokenizer(vocab, [])
    tok.add_special_tokens([EOT_TEXT])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return tok


def _gpt2_tokenizer():
    """GPT-2's BPE from the same packaged files our gpt2 tokenizer reads (no download)."""
    vocab = json.loads(_read_package_file("encoder.json"))
    lines = _read_package_file("vocab.bpe").decode("utf-8").split("\n")[1:-1]
    tok = _byte_level_tokenizer(vocab, [tuple(line.split(" ")) for line in lines])
    tok.add_special_tokens([EOT_TEXT])
    return tok


def _bpe_file(cfg: ExperimentConfig, run_dir: Path | None) -> Path:
    """Where the run's trained bpe tokenizer.json is (beside its token shards), found from any
    working directory (`rundir.locate_run_data`); the path as configured when not found."""
    data = locate_run_data(run_dir, cfg) or Path(cfg.data.resolved_dir())
    return data / "tokenizer.json"


def write_tokenizer(
    cfg: ExperimentConfig, out_dir: Path, run_dir: Path | None = None
) -> tuple[str | None, str]:
    """Write `tokenizer.json` + `tokenizer_config.json` for the run's tokenizer (`run_dir`: the
    run directory, whose records locate a bpe tokenizer's data directory).

    Returns (name of the tokenizer written or None, a note for the user)."""
    name = cfg.data.tokenizer
    builders: dict[str, Callable] = {"byte": _byte_tokenizer, "gpt2": _gpt2_tokenizer}
    if name in builders:
        tok = builders[name]()
    else:  # bpe: the trained tokenizer.json beside the run's token shards
        src = _bpe_file(cfg, run_dir)
        if not src.is_file():
            return None, (
                f"no tokenizer written: the run's bpe tokenizer {src} is not here (copy the "
                f"tokenizer.json of its data directory into {out_dir})"
            )
        tok = require("tokenizers", "the exported tokenizer.json").Tokenizer.from_file(str(src))
    tok.save(str(out_dir / "tokenizer.json"))
    special = "<|endoftext|>"
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.model.max_seq_len,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    tok_config.update(bos_token=special, eos_token=special)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return name, f"tokenizer: {name} (tokenizer.json)"


def _eos_token_id(cfg: ExperimentConfig, run_dir: Path | None = None) -> int | None:
    """The document separator id our shards use (byte: 0, gpt2: 50256, bpe: its eot)."""
    name = cfg.data.tokenizer
    if name == "byte":
        return 0
    if name == "gpt2":
        return 50256
    path = _bpe_file(cfg, run_dir)
    if path.is_file():
        tokenizers = require("tokenizers", "the exported tokenizer.json")
        return tokenizers.Tokenizer.from_file(str(path)).token_to_id("<|endoftext|>")
    return None


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def save_safetensors(
    tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int
) -> list[str]:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus the index HF reads
    when the weights exceed `max_shard_bytes`. Returns the file names."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        follow_umask(out_dir / "model.safetensors")
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        follow_umask(out_dir / fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*names, "model.safetensors.index.json"]


def export_hf(
    run: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ExportResult:
    """Export the newest checkpoint of `run` (or the checkpoint file `run`) to `out_dir`.

    `dtype`: float32 | bfloat16 | float16 (default: the run's training dtype). Refuses to write
    into a non-empty `out_dir`; `overwrite` replaces only an earlier export (marked, holding
    only export files). Nothing is written when the run cannot be exported: the files go into
    a hidden staging directory beside `out_dir` that is renamed into place at the end.
    """
    trained = load_trained(run)
    cfg = trained.config
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype or cfg.train.dtype]
    arch = hf_architecture(cfg.model)  # refuse before touching the file system
    out_dir = Path(out_dir)
    _check_out(out_dir, overwrite)
    run_dir = trained.path.parent
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out_dir.parent, prefix=f".{out_dir.name}.tmp-export-")
    try:
        mark_owned(tmp, EXPORT_KIND)
        files = save_safetensors(
            hf_state_dict(trained.state_dict, cfg.model, torch_dtype), tmp, max_shard_bytes
        )
        eos = _eos_token_id(cfg, run_dir)
        (tmp / "config.json").write_text(
            json.dumps(hf_config(cfg, torch_dtype, eos), indent=2) + "\n"
        )
        generation = {"bos_token_id": eos, "eos_token_id": eos}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        files += ["config.json", "generation_config.json"]
        tokenizer, note = write_tokenizer(cfg, tmp, run_dir)
        if tokenizer:
            files += ["tokenizer.json", "tokenizer_config.json"]
        _check_out(out_dir, overwrite)  # again: it may have changed while we wrote
        if out_dir.is_dir() and any(out_dir.iterdir()):
            remove_owned_dir(out_dir, EXPORT_KIND, EXPORT_ENTRIES, fix=EXPORT_FIX)
        elif out_dir.is_dir():
            os.rmdir(out_dir)  # empty, and not the working directory (_check_out)
        tmp.rename(out_dir)
    except BaseException:
        _remove_staging(tmp)
        raise
    notes = [f"from {trained.path} (step {trained.step})", note]
    return ExportResult(out_dir, arch, files, tokenizer, notes)


def _check_out(out_dir: Path, overwrite: bool) -> None:
    """Refuse (ExportError / NotOwnedError, nothing touched) an `out_dir` the export may not
    replace: a file, a non-empty directory without `overwrite`, one that is not an earlier
    export of ours, the working directory or a parent of it, a symbolic link (LinkError)."""
    check_writable(out_dir)  # renamed over at the end: never through a link
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a directory; {EXPORT_FIX}")
    if not any(out_dir.iterdir()):
        refuse_protected(out_dir, fix=EXPORT_FIX)
        return
    if not overwrite:
        if owned_kind(out_dir) == EXPORT_KIND:
            raise ExportError(f"{out_dir} exists and is not empty; pass --overwrite to replace it")
        raise ExportError(
            f"{out_dir} exists, is not empty and is not a stalepipe export; {EXPORT_FIX}"
        )
    check_removable(out_dir, EXPORT_KIND, EXPORT_ENTRIES, fix=EXPORT_FIX)


def _remove_staging(tmp: Path) -> None:
    """Delete this export's own staging directory (only the files it wrote there)."""
    for entry in tmp.iterdir():
        entry.unlink()
    tmp.rmdir()


# `stalepipe export --format NAME`: the function that writes each format.
EXPORTERS: dict[str, Callable[..., ExportResult]] = {"hf": export_hf}


def export_main(
    run: str, *, out: str, format: str = "hf", dtype: str | None = None, overwrite: bool = False
) -> str:
    """`stalepipe export` (its flags as keywords): export `run` to `out` in `format`; returns
    the text to print."""
    result = EXPORTERS[format](run, out, dtype=dtype, overwrite=overwrite)
    files = ", ".join(result.files)
    return "\n".join(
        [f"exported {result.architecture} to {result.out_dir}: {files}", *result.notes]
    )
