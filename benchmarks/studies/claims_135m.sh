#!/usr/bin/env bash
# The paper's first two claims at 135M parameters on one GPU (issue 17): AdamW and Muon under
# sync / 2bw / 2bw+EF, 3 seeds each (18 runs of SmolLM-135M, 10k steps of 256 x 1024 GPT-2
# tokens), then the report (gaps, Welch tests, token overhead, EF's share) and the verdict.
#
#   benchmarks/studies/claims_135m.sh DATA_DIR [OUT] [more `stalepipe sweep` flags]
#
# DATA_DIR holds GPT-2 token shards in the llm.c format, e.g. FineWeb-edu from llm.c's
# dev/data/fineweb.py or modded-nanogpt's data/cached_fineweb10B.py (*_train_*.bin and
# *_val_*.bin; docs/experiments.md, "GPU scale"). About 30 GPU-hours on one H100 at 40% MFU
# (`--dry-run` prints the estimate for the flags given); the sweep resumes where it stopped, so
# rerun the same command after an interruption. Shorter: `--set train.num_steps=2500`.
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
data=$1
out=${2:-runs/claims-135m}
shift $(($# < 2 ? $# : 2))
if ! compgen -G "$data/*train*.bin" > /dev/null || ! compgen -G "$data/*val*.bin" > /dev/null; then
    echo "claims_135m.sh: $data has no *train*.bin and *val*.bin token shards; see docs/experiments.md (GPU scale)" >&2
    exit 2
fi
stalepipe="${STALEPIPE:-stalepipe}"

"$stalepipe" sweep optimizers --scale 135m --only optim.name=adamw,muon --seeds 3 \
    --set data.data_dir="$data" \
    --out "$out" "$@"
if [[ " $* " == *" --dry-run "* ]]; then
    exit 0
fi
"$stalepipe" report "$out"
"$stalepipe" verdict "$out" --model smollm-135m --stages 8 --microbatches 16 --device h100
