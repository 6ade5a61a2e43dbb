"""Per-GPU memory by term (sim/memory.py, issue 52 item 2): the per-layer activations of a
Llama block by hand, the state per optimizer and ZeRO stage, and the table of published
measured peaks in docs/verdict.md as benchmarks/validation/memory_published.py computes it now,
each row within 15 % except the ones the docs name as misses."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from stalepipe.lab.sim.cluster import CLUSTERS
from stalepipe.lab.sim.memory import (
    gpu_memory,
    layer_bytes_per_token_dim,
    logits_bytes,
    state_bytes,
)
from stalepipe.lab.sim.models import model_config

ROOT = Path(__file__).resolve().parents[2]
MISSES = {"Table 4: 70B, FSDP 32 x TP 8, local batch 16, full AC"}  # named in docs/verdict.md


def _benchmark():
    path = ROOT / "benchmarks" / "validation" / "memory_published.py"
    spec = importlib.util.spec_from_file_location("memory_published", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_llama_layer_keeps_41_bytes_a_token_a_dim_without_recomputation():
    cfg = model_config("llama3-8b")  # g = 8 / 32, F / h = 14336 / 4096 = 3.5
    assert layer_bytes_per_token_dim(cfg) == pytest.approx((8 + 4 * 0.25) + (4 + 8 * 3.5))
    assert layer_bytes_per_token_dim(cfg) == pytest.approx(41.0)
    assert layer_bytes_per_token_dim(cfg, "selective") == pytest.approx(8 + 0.5 + 7)
    assert layer_bytes_per_token_dim(cfg, "full") == 2.0
    # 8,192 x 2 tokens of fp32 logits, three copies, 128,256 entries: 25.2 GB
    assert logits_bytes(cfg, 16384) == pytest.approx(12 * 16384 * 128256)


def test_state_per_optimizer_and_zero_stage():
    assert state_bytes("adamw") == 2 + 4 + 4 + 8  # bf16 weights, fp32 grads, master, 2 moments
    assert state_bytes("muon") == 2 + 4 + 4 + 4  # one momentum
    assert state_bytes("muon", ef=True, versions=2) == 4 + 4 + 4 + 4 + 4  # EF's buffer, 2BW's
    assert state_bytes("adamw", zero=1, dp=8) == pytest.approx(2 + 4 + 12 / 8)
    assert state_bytes("adamw", zero=2, dp=8) == pytest.approx(2 + 16 / 8)
    assert state_bytes("adamw", zero=3, dp=8) == pytest.approx(18 / 8)


def test_llama3_8b_fsdp_at_microbatch_2_needs_recomputation_on_80_gb():
    """Issue 52: the old model let llama3-8b 'fit' FSDP x64 at microbatch 2 with 78.2 GB and no
    recomputation; by term it is over 80 GB, and the cluster model then recomputes."""
    cfg = model_config("llama3-8b")
    none = gpu_memory(cfg, seq_len=8192, microbatch=2, dp=64, zero=3)
    assert none.total > 80e9 and none.activations > 80e9
    from stalepipe.lab.sim.parallel import Workload, data_parallel
    from stalepipe.lab.sim.replicas import flat_step

    w, c = Workload(cfg, 8192, 128, 64), CLUSTERS["h100-ib"]
    assert flat_step(w, c, "fsdp", 1, 2, "none")[2] > 80e9
    assert flat_step(w, c, "fsdp", 1, 2, "selective")[2] < 80e9
    o = data_parallel(w, c, sharded=True)
    assert o is not None and o.fits and (o.microbatch_size, o.recompute) != (2, "none")


def test_the_published_memory_table_in_the_docs_is_recomputed():
    doc = (ROOT / "docs" / "verdict.md").read_text()
    shown = re.search(r"<!-- memory_published: begin -->\n(.*)\n<!-- memory_published: end -->",
                      doc, re.S)  # fmt: skip
    assert shown, "docs/verdict.md lost its memory_published markers"
    assert shown.group(1).strip() == _benchmark().table().strip()


def test_each_published_peak_within_15_percent_but_the_named_misses():
    b = _benchmark()
    assert len(b.ROWS) >= 4
    for r in b.ROWS:
        ratio = r.predicted().total / 2**30 / r.published_gib
        missed = abs(ratio - 1) > b.WITHIN
        assert missed == any(r.what.startswith(m) for m in MISSES), (r.what, ratio)
    # torchtitan's A100 page: Llama 2 70B at local batch 2 ran out of memory, batch 1 ran
    assert b.OOM.predicted().total > 80e9 > b.FITS.predicted().total
