"""A Hugging Face Llama / Mixtral checkpoint directory, read without trusting it.

`stalepipe train --init-from hf:DIR` starts a run from such a directory (what `stalepipe
export` writes, or a SmolLM / Llama / Mixtral download: `config.json` and `model.safetensors`,
or shards named by `model.safetensors.index.json`), and `stalepipe generate` samples from one.
It is read as a checkpoint of our own is (`rundir/verified.py`; docs/failures.md, 'Sharing
runs'): nothing is unpickled (safetensors only, no `.bin`), every safetensors header is parsed
and bounded by its file before anything is allocated (`verified.read_header`), every file opened
stays inside the directory (`verified.inside`), the JSON files are size-capped, and every
tensor's name and shape is checked against the model the run builds (`models.hf`'s names)
before a byte of weights is read. There are no digests to check: the files are someone
else's, so the bounded parser and the shape checks are the defence.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalepipe.config import ModelConfig
from stalepipe.errors import CheckpointError
from stalepipe.training.models import Transformer
from stalepipe.training.models.hf import HfFormatError, hf_name, mismatch, model_config
from stalepipe.training.rundir.verified import SMALL_MAX, Entry, Verifier, inside, read_header

PREFIX = "hf:"  # `--init-from hf:DIR`
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.safetensors")  # a file beside the index
_IGNORED = ("rotary_emb.inv_freq",)  # buffers older transformers saved: recomputed, not read


class _HfVerifier(Verifier):
    """`Verifier`'s bounded reads, with the failure worded for an HF directory."""

    def damaged(self, rel: str, what: str) -> CheckpointError:
        return CheckpointError(
            f"HF checkpoint file {self.ckpt / rel} {what}; export or download it again"
        )


@dataclass(frozen=True)
class HfCheckpoint:
    """An HF model directory: its path and its (checked) config.json."""

    path: Path
    config: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{PREFIX}{self.path}"

    def model_config(self, base: ModelConfig | None = None) -> ModelConfig:
        """Our ModelConfig for it (`base`'s other fields; `models.hf.model_config`)."""
        return model_config(self.config, f"{self.path / CONFIG}", base)

    def check_fits(self, cfg: ModelConfig) -> None:
        """HfFormatError, one line with the flags that fix it, when `cfg` cannot hold it."""
        if (flags := mismatch(cfg, self.config, f"{self.path / CONFIG}")) is not None:
            raise HfFormatError(
                f"--init-from {self.where} is another model than this run's; pass {flags} "
                f"(its config.json's shape)"
            )

    def read(self, cfg: ModelConfig, wanted: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Our parameters `wanted` (global names; all of `cfg`'s model when None, a tied head
        included) from the directory, in the dtype stored. Every tensor of the files is checked
        against `cfg`'s model first (name and shape: none missing, none unknown)."""
        self.check_fits(cfg)
        verifier = _HfVerifier(self.path, {})
        verifier.data = False  # no digests recorded: bounds and shapes are the checks
        found = self._entries(verifier)
        shapes = _shapes(cfg)
        want = {name: hf_name(name, cfg) or hf_name("tok_emb.weight", cfg) for name in shapes}
        for name, key in want.items():
            if key not in found:
                raise verifier.damaged(self._files_of(found), f"has no tensor {key}")
            if found[key][1].shape != shapes[name]:
                got = found[key][1].shape
                raise verifier.damaged(found[key][0], f"holds {key} as {got}, not {shapes[name]}")
        known = set(want.values()) | ({"lm_head.weight"} if cfg.tie_embeddings else set())
        unknown = sorted(k for k in found if k not in known and not k.endswith(_IGNORED))
        if unknown:
            raise verifier.damaged(
                found[unknown[0]][0],
                f"holds {unknown[0]}, which stalepipe's model has no place for",
            )
        return {name: _read(verifier, *found[want[name]]) for name in (wanted or list(shapes))}

    def _entries(self, verifier: Verifier) -> dict[str, tuple[str, Entry]]:
        files = [WEIGHTS]
        if (self.path / INDEX).is_file():
            index = _read_json(verifier, INDEX)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and _SHARD.fullmatch(f) for f in weight_map.values()
            ):
                raise verifier.damaged(INDEX, "has no weight_map of safetensors file names")
            files = sorted(set(weight_map.values()))
        elif not (self.path / WEIGHTS).is_file():
            raise CheckpointError(
                f"{self.path} holds no {WEIGHTS} (nor {INDEX}); give a directory saved by "
                f"`save_pretrained(..., safe_serialization=True)` or `stalepipe export`"
            )
        found: dict[str, tuple[str, Entry]] = {}
        for rel in files:
            for key, entry in read_header(verifier, rel).items():
                if key in found:
                    raise verifier.damaged(rel, f"holds {key}, which {found[key][0]} holds too")
                found[key] = (rel, entry)
        return found

    @staticmethod
    def _files_of(found: dict[str, tuple[str, Entry]]) -> str:
        return ", ".join(sorted({rel for rel, _ in found.values()})) or WEIGHTS


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of `cfg`'s model by global name (a tied head too), built on meta."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def _read(verifier: Verifier, rel: str, entry: Entry) -> torch.Tensor:
    """One tensor's bytes, read straight into a tensor of its checked dtype and shape."""
    out = torch.empty(entry.shape, dtype=entry.dtype)
    if entry.length:
        buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(inside(verifier.ckpt, rel), "rb") as f:
            f.seek(entry.offset)
            if f.readinto(buf) != entry.length:
                raise verifier.damaged(rel, "is shorter than its header says")
    return out


def _read_json(verifier: Verifier, rel: str) -> Any:
    size = verifier.actual_size(rel)  # `inside`: a link out of the directory is refused
    if size is None or size > SMALL_MAX:
        raise verifier.damaged(rel, "is missing" if size is None else f"is {size} bytes")
    try:
        return json.loads(verifier.read_range(rel, 0, size))
    except ValueError:
        raise verifier.damaged(rel, "is not JSON") from None


def open_hf(spec: str | Path) -> HfCheckpoint:
    """The HF directory `spec` names (`hf:DIR` or DIR), its config.json read and checked
    (a Llama or Mixtral our model computes exactly: `models.hf`)."""
    path = Path(str(spec).removeprefix(PREFIX))
    if not path.is_dir() or not (path / CONFIG).is_file():
        raise CheckpointError(
            f"{PREFIX}{path} is not a Hugging Face model directory (no {CONFIG}); give the "
            f"directory `save_pretrained` or `stalepipe export` wrote"
        )
    verifier = _HfVerifier(path, {})
    config = _read_json(verifier, CONFIG)
    if not isinstance(config, dict):
        raise verifier.damaged(CONFIG, "is not a JSON object")
    checkpoint = HfCheckpoint(path, config)
    checkpoint.model_config()  # refuses what our model cannot compute, in one line
    return checkpoint


def load_hf_weights(params: dict[str, torch.nn.Parameter], cfg: ModelConfig, path: Path) -> None:
    """Copy the HF checkpoint at `path` into `params` (ours, by global name: a whole model's,
    or one pipeline process's stages', a tied head included), converting the dtype."""
    weights = open_hf(path).read(cfg, list(params))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
