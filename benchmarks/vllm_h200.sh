#!/usr/bin/env bash
# vLLM on one H200 (Python 3.12, torch 2.11.0+cu130, transformers 5.17, no network): the
# product's entry points with rollout.name=vllm, and the measurements beside hf_fast.
#
# The machine lacks vLLM, DeepSpeed, flytekit and pandera. They come as one xz tarball of a
# `pip install --no-deps --target` tree made on another machine for Python 3.12 /
# manylinux x86_64: vLLM 0.26.0 without its FlashAttention-2 and MoE kernel libraries and its
# Rust server frontend (Hopper uses FlashAttention 3; a dense model runs no MoE kernel), the
# small dependencies vLLM imports that the image lacks, DeepSpeed 0.19.8 (DS_BUILD_OPS=0),
# pandera, gguf (and, for the pyflyte step, flytekit 1.16.31 with the kfpytorch and pandera
# plugins, great-tables, botocore, kubernetes: 30 MB more). The SmolLM2-135M
# GGUF file comes beside it. Both arrive in parts under /tmp/up (site.tar.xz.NN, gguf.NN)
# with their sha256 in SHA256SUMS.
#
#   bash benchmarks/vllm_h200.sh site                # join, check and unpack the tree into /tmp/site
#   bash benchmarks/vllm_h200.sh site-rm             # or site_rm.tar.xz (--real-model), for realmodel only
#   bash benchmarks/vllm_h200.sh gguf                # join and check the GGUF file
#   bash benchmarks/vllm_h200.sh smoke OUT           # benchmarks/vllm_smoke.py
#   bash benchmarks/vllm_h200.sh train OUT ROUNDS [key=value ...]  # python -m rlhf.train --cfg examples/...
#   bash benchmarks/vllm_h200.sh mismatch OUT [--eager]  # SmolLM2: vLLM's log-probs against the trainer's
#   bash benchmarks/vllm_h200.sh pyflyte OUT ROUNDS  # pyflyte run workflows/ppo.py ppo_pipeline --cfg ...
#   bash benchmarks/vllm_h200.sh throughput OUT      # 1.5B shape: vllm against hf_fast, one call
#   bash benchmarks/vllm_h200.sh rounds OUT DRIVER   # 1.5B rounds with vLLM (real_scale.py), 10 rounds
#   bash benchmarks/vllm_h200.sh scale OUT SHAPE RANK DRIVERS ROUNDS  # real_scale.py rounds, LoRA of RANK (0: none)
#   bash benchmarks/vllm_h200.sh realmodel OUT TASK SEED LANES [real_model.py args]  # SmolLM2 learning lanes
#   bash benchmarks/vllm_h200.sh heldout OUT TASK SEED  # its held-out table, after a run with --no-heldout
#
# The tree itself is made on a machine with PyPI by benchmarks/offline_site.py.
set -o pipefail
UP=/tmp/up SITE=/tmp/site GGUF=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 DS_BUILD_OPS=0 \
  RLHF_MODEL_CACHE=/tmp/models
step=$1 out=${2:-/tmp/out}
mkdir -p "$out"
smol_cfg() {  # the example config with vLLM and ROUNDS rounds, for pyflyte (which takes a file)
  python3 - "$1" "$2" "$3" <<'EOF'
import sys, yaml
cfg = yaml.safe_load(open("examples/smollm2_gsm8k_1gpu.yaml"))
cfg["model"]["path"] = sys.argv[3]
cfg["rollout"]["name"] = "vllm"
cfg["trainer"].update(total_rounds=int(sys.argv[2]), test_freq=int(sys.argv[2]), save_freq=int(sys.argv[2]),
                      output_dir="/tmp/o_pyflyte", rounds_per_segment=int(sys.argv[2]))
yaml.safe_dump(cfg, open(sys.argv[1], "w"))
EOF
}
case $step in
  site)  # site.tar.xz, and site2.tar.xz (MLflow's client for the pyflyte step) where it came
    for t in site site2; do
      ls $UP/$t.tar.xz.* > /dev/null 2>&1 || continue
      cat $UP/$t.tar.xz.* > /tmp/$t.tar.xz && (cd /tmp && grep " $t.tar.xz" $UP/SHA256SUMS | sha256sum -c) &&
        mkdir -p $SITE && tar xJf /tmp/$t.tar.xz -C $SITE --strip-components=1 && rm /tmp/$t.tar.xz || exit 1
    done
    python3 -c "import vllm, deepspeed, pandera; print(vllm.__version__, deepspeed.__version__)" ;;
  site-rm)  # site_rm.tar.xz (offline_site.py --real-model): enough for the realmodel step, in one part
    (cd $UP && grep " site_rm.tar.xz" SHA256SUMS | sha256sum -c) && mkdir -p $SITE &&
      tar xJf $UP/site_rm.tar.xz -C $SITE --strip-components=1 || exit 1
    python3 -c "import trl, deepspeed, gguf, pandera; print(trl.__version__, deepspeed.__version__)" ;;
  gguf)
    mkdir -p /tmp/model && cat $UP/gguf.* > $GGUF && (cd /tmp/model && grep gguf $UP/SHA256SUMS | sha256sum -c) ;;
  smoke)
    timeout 240 python3 benchmarks/vllm_smoke.py --out "$out/vllm_smoke.json" 2>&1 | tee "$out/smoke.log" ;;
  train)
    python3 -m rlhf.data.word_problems --output data/word_problems > /dev/null
    timeout 300 python3 -m rlhf.train --cfg examples/smollm2_gsm8k_1gpu.yaml rollout.name=vllm model.path=$GGUF \
      trainer.total_rounds=${3:-4} trainer.test_freq=2 trainer.save_freq=2 trainer.output_dir=/tmp/o_train \
      "${@:4}" --summary-json "$out/train_summary.json" 2>&1 | tee "$out/train.log" ;;
  mismatch)
    timeout 180 python3 benchmarks/vllm_rollout.py --model-dir $GGUF --prompts-file data/word_problems/train.parquet \
      --cfg examples/smollm2_gsm8k_1gpu.yaml --rows 64 --rollout-n 4 --out "$out/vllm_mismatch_smollm2_h200.json" \
      "${@:3}" 2>&1 | tail -40 > "$out/mismatch.log" ;;
  pyflyte)
    python3 -m rlhf.data.word_problems --output data/word_problems > /dev/null
    smol_cfg /tmp/pyflyte_cfg.yaml "${3:-3}" $GGUF && cp /tmp/pyflyte_cfg.yaml "$out/pyflyte_cfg.yaml"
    # pyflyte itself, with the engine's close reports (free GPU memory, what still holds it) shown
    timeout 300 python3 - <<'EOF' 2>&1 | tee "$out/pyflyte.log"
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logging.getLogger("rlhf.rollout.vllm").setLevel(logging.INFO)
from flytekit.clis.sdk_in_container.pyflyte import main
sys.argv = ["pyflyte", "run", "workflows/ppo.py", "ppo_pipeline", "--cfg", "/tmp/pyflyte_cfg.yaml"]
main()
EOF
    ;;
  throughput)
    timeout 300 python3 benchmarks/rollout_throughput.py --engines vllm,fast --no-diagnostics \
      --out "$out/rollout_vllm_vs_fast_h200.json" 2>&1 | tail -60 > "$out/throughput.log" ;;
  rounds)
    timeout ${ROUNDS_TIMEOUT:-560} python3 benchmarks/real_scale.py --rounds 10 --drivers "${3:-in_process}" --rollout vllm \
      --ckpt-dir /dev/shm/rs --one-checkpoint --out "$out/real_scale_vllm_${3:-in_process}_h200.json" 2>&1 |
      grep -v "INFO\|WARNING" | tail -60 > "$out/rounds_${3:-in_process}.log" ;;
  scale)
    tag=${3}_lora${4}_${5//,/_}
    timeout ${ROUNDS_TIMEOUT:-560} python3 benchmarks/real_scale.py --shape "$3" --lora-rank "$4" --drivers "$5" \
      --rounds "$6" --ckpt-dir /dev/shm/rs --one-checkpoint --out "$out/real_scale_${tag}_h200.json" 2>&1 |
      grep -v "INFO\|WARNING" | tail -80 > "$out/scale_${tag}.log" ;;
  realmodel)  # the run directory stays here; what comes back (at most 8 files): results, table, plot, logs
    run=/tmp/rm/$3/seed$4
    echo "realmodel $3 seed $4 from $(date +%T)"
    timeout ${ROUNDS_TIMEOUT:-560} python3 benchmarks/real_model.py --task "$3" --seed "$4" --lanes "$5" --gguf $GGUF \
      --trl-site $SITE --out "$run" "${@:6}" 2>&1 | grep -v "INFO\|WARNING" | tail -60
    for f in results.json results.md curve.png; do cp "$run/$f" "$out/real_model_$3_seed$4_$f" 2>/dev/null; done
    (cd "$run" && tar cJf "$out/real_model_$3_seed$4_lanes.tar.xz" *.log *.json 2>/dev/null) ;;
  heldout)  # the held-out table of a realmodel run made with --no-heldout, and its files again
    run=/tmp/rm/$3/seed$4
    echo "heldout $3 seed $4 from $(date +%T)"
    python3 benchmarks/real_model_heldout.py "$run" --device cuda 2>&1 | grep -v "INFO\|WARNING" | tail -12
    echo "heldout $3 seed $4 to $(date +%T)"
    for f in results.json results.md curve.png; do cp "$run/$f" "$out/real_model_$3_seed$4_$f" 2>/dev/null; done ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
