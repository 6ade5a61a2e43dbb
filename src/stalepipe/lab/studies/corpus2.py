"""The `corpus2` study: the headline claims on a second corpus (issue 34)."""

from __future__ import annotations

from stalepipe.lab.studies.mitigations import claim_ef_recovers_gap
from stalepipe.lab.studies.optimizers import claim_adamw_gap_exceeds_muon
from stalepipe.lab.studies.scales import REGIME, SYNC, TWO_BW, TWO_BW_EF, optimizer_axis
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle

# The second corpus (issue 34): the 617 pages of Django 5.2's documentation (technical prose with
# code; the `django-docs` corpus, docs/experiments.md "Corpora") at a byte-level BPE of 2048
# trained on the train split, 15% of the pages held out (301,816 validation tokens).
CORPUS2: Bundle = (
    "django-bpe2048",
    {
        "data.corpus": "django-docs",
        "data.tokenizer": "bpe",
        "data.bpe_vocab_size": "2048",
        "data.val_fraction": "0.15",
        "model.vocab_size": "2048",
    },
)


def study_corpus2(scale: str) -> list[list[list[Bundle]]]:
    """The headline claims on the second corpus: AdamW and Muon, sync / 2bw / 2bw+EF, at the
    scale's model and LRs (tuned on Shakespeare bytes: untuned here)."""
    return [[optimizer_axis(scale, ("adamw", "muon")), [CORPUS2], [SYNC, TWO_BW, TWO_BW_EF]]]


STUDY = Study(
    name="corpus2",
    grids=study_corpus2,
    about="AdamW & Muon sync / 2bw / 2bw+EF on Django's docs at a 2048 BPE",
    order=150,
    scales=REGIME,
    claims=(claim_adamw_gap_exceeds_muon, claim_ef_recovers_gap),
)
