"""Our model as a Hugging Face Llama / Mixtral model and back: parameter names and configs.

One table each way's rule is read from, so export (`tools/export.py`: our checkpoint ->
`LlamaForCausalLM` / `MixtralForCausalLM`) and import (`rundir/hf_checkpoint.py`: an HF
checkpoint directory -> our model, `train --init-from hf:DIR`, `generate`) cannot drift apart:
`hf_name` maps each of our parameter names to HF's, and the import inverts it over the model's
own names; `HF_FIELDS` maps the config fields that fix the weights' shapes and the logits.

The mapping needs no reshaping: our RoPE uses HF Llama's half-split (rotate_half) layout, our
norms and SwiGLU compute what HF's do, and expert weights use Mixtral's checkpoint names
(`block_sparse_moe.experts.{e}.w1/w2/w3`), which transformers 4 and 5 both read and write.
Torch-free: the CLI checks an HF directory's config.json before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stalepipe.config import ConfigError, ModelConfig
from stalepipe.errors import UserError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral"}
# Our ModelConfig field -> the config.json key holding it, for the fields that fix the weights'
# shapes or the logits (max_seq_len only bounds RoPE's table, init_std and dropout only training).
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}
DENSE_FIELDS = {"ffn_dim": "intermediate_size"}
MOE_FIELDS = {
    "num_experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
    "expert_ffn_dim": "intermediate_size",
}
_FIXED = {
    "lm_head.weight": "lm_head.weight",
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "block_sparse_moe.gate.weight",
}


class HfFormatError(UserError):
    """A model Hugging Face's Llama / Mixtral cannot express, or an HF checkpoint ours cannot
    hold; the message names why and what to do."""


def hf_architecture(cfg: ModelConfig) -> str:
    """'LlamaForCausalLM' or 'MixtralForCausalLM'; HfFormatError for what neither expresses."""
    if cfg.num_experts == 0:
        return "LlamaForCausalLM"
    unsupported = []
    if cfg.num_shared_experts:
        unsupported.append(f"model.num_shared_experts={cfg.num_shared_experts}")
    if cfg.num_dense_layers:
        unsupported.append(f"model.num_dense_layers={cfg.num_dense_layers}")
    if unsupported:
        raise HfFormatError(
            f"Mixtral (the Hugging Face MoE architecture we export to) has no shared experts or "
            f"dense layers, but this run uses {' and '.join(unsupported)}; only MoE runs with "
            f"both 0 can be exported as HF"
        )
    return "MixtralForCausalLM"


def hf_name(name: str, cfg: ModelConfig) -> str | None:
    """The HF parameter name of our global parameter `name`; None for a tied head."""
    if name == "lm_head.weight" and cfg.tie_embeddings:
        return None
    if name in _FIXED:
        return _FIXED[name]
    parts = name.split(".")
    assert parts[0] == "layers", f"unexpected parameter {name}"
    prefix, rest = f"model.layers.{parts[1]}", ".".join(parts[2:])
    if rest in _BLOCK:
        return f"{prefix}.{_BLOCK[rest]}"
    if rest.startswith("mlp.experts."):  # mlp.experts.{e}.w{1,2,3}.weight: Mixtral's own names
        return f"{prefix}.block_sparse_moe.{rest.removeprefix('mlp.')}"
    raise AssertionError(f"no Hugging Face name for parameter {name}")


def hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys that give `cfg`'s shapes and logits (HF_FIELDS and the MLP's)."""
    table = HF_FIELDS | (MOE_FIELDS if cfg.num_experts else DENSE_FIELDS)
    out = {key: getattr(cfg, field) for field, key in table.items()}
    if cfg.num_experts:
        out["intermediate_size"] = cfg.expert_hidden_dim
    return out


def _refusal(hf: dict[str, Any]) -> str | None:
    """Why an HF config.json is not one our model computes exactly; None when it is."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        return f"its architectures are {archs}; stalepipe loads {' or '.join(ARCHITECTURES)}"
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        rope = {"rope_type": rope}
    checks = [
        (hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r}"),
        (not hf.get("attention_bias") and not hf.get("mlp_bias"), "attention or MLP biases"),
        (rope.get("rope_type", "default") == "default", f"rope type {rope.get('rope_type')!r}"),
        (hf.get("sliding_window") is None, f"a sliding window of {hf.get('sliding_window')}"),
    ]
    heads, dim, head_dim = hf.get("num_attention_heads"), hf.get("hidden_size"), hf.get("head_dim")
    if head_dim is not None and type(heads) is type(dim) is int and heads > 0:
        checks.append((head_dim == dim // heads, f"head_dim {head_dim} != hidden_size / heads"))
    problems = [what for ok, what in checks if not ok]
    return f"it has {', '.join(problems)}, which stalepipe's model has not" if problems else None


def _hf_values(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's values under HF_FIELDS' keys, as transformers 4 and 5 spell them."""
    out = dict(hf)
    rope = hf.get("rope_parameters") or {}
    if "rope_theta" not in out and "rope_theta" in rope:  # transformers >= 5
        out["rope_theta"] = rope["rope_theta"]
    out.setdefault("rope_theta", 10000.0)  # both versions' default
    out.setdefault("tie_word_embeddings", False)  # Llama's and Mixtral's default
    out.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    return out


def _typed(key: str, value: Any, like: Any, where: str) -> Any:
    """`value` of config.json's `key` as the type of our field's default `like` (an int is a
    float's value too); HfFormatError for anything else (a string, a list, a bool for an int)."""
    if type(like) is float and type(value) in (int, float):
        return float(value)
    if type(value) is type(like):
        return value
    wanted = {int: "an integer", float: "a number", bool: "true or false"}[type(like)]
    raise HfFormatError(f"{where}: {key} is {value!r}, not {wanted}")


def model_config(hf: dict[str, Any], where: str, base: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig of an HF config.json (`hf`, read from `where`), each value checked for
    its type: `base`'s other fields (dropout, init, MoE loss weights, max_seq_len), or without a
    base the defaults and the checkpoint's max_position_embeddings."""
    if (why := _refusal(hf)) is not None:
        raise HfFormatError(f"{where}: {why}; give a Llama or Mixtral checkpoint directory")
    values = _hf_values(hf)
    moe = ARCHITECTURES[hf["architectures"][0]] == "mixtral"
    table = HF_FIELDS | (MOE_FIELDS if moe else DENSE_FIELDS)
    missing = [key for key in table.values() if values.get(key) is None]
    if missing:
        raise HfFormatError(f"{where} has no {', '.join(missing)}; it is not a complete config")
    defaults = ModelConfig()
    fields = {f: _typed(k, values[k], getattr(defaults, f), where) for f, k in table.items()}
    fields |= {"num_shared_experts": 0, "num_dense_layers": 0} | ({} if moe else {"num_experts": 0})
    if base is None:
        length = values.get("max_position_embeddings") or 2048
        fields["max_seq_len"] = _typed("max_position_embeddings", length, 1, where)
    try:
        return dataclasses.replace(base or ModelConfig(), **fields)
    except (ConfigError, TypeError) as e:
        raise HfFormatError(f"{where}: {e}") from None


def mismatch(cfg: ModelConfig, hf: dict[str, Any], where: str) -> str | None:
    """Why `cfg` cannot hold the HF checkpoint whose config.json is `hf`, as the flags that make
    it fit ('--model.dim 64 --model.num_layers 2'); None when it fits."""
    theirs = model_config(hf, where, cfg)
    fields = [*HF_FIELDS, "num_experts", "num_shared_experts", "num_dense_layers"]
    fields += [*MOE_FIELDS][1:] if theirs.num_experts else [*DENSE_FIELDS]
    flags = [
        f"--model.{field} {_flag(getattr(theirs, field))}"
        for field in fields
        if _norm(cfg, field) != _norm(theirs, field)
    ]
    return " ".join(flags) or None


def _norm(cfg: ModelConfig, field: str) -> Any:
    return cfg.expert_hidden_dim if field == "expert_ffn_dim" else getattr(cfg, field)


def _flag(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
