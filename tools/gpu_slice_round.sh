#!/usr/bin/env bash
# Issue 35's GPU targets in one device call: the sliced GPT-2-small shape (1×1024) and ViT-B/16 with its
# classification head (batch 64) at R = 0.25 against ORT's optimizer original, ORT CUDA, fp16 and fp32.
#
#   tools/gpu_slice_round.sh OUT            # on the GPU machine, from the repository root
#   DRY=1 tools/gpu_slice_round.sh OUT      # here: the same steps on the registry's small models, ORT CPU
#
# Steps: install the carried wheels (.whl/*.whl: normpass, onnx-ir >= 1.1; onnxruntime-gpu, over the 64 MiB a
# call carries, split into parts .whl/c*/onnxruntime_gpu.part* carried by earlier calls and joined here in
# name order; docs/benchmarks/slice.md says how), prepare each model
# in its own process on the CPU cores (`bench_gpu.py prepare --variants fold-opt slice-0.25`), merge their
# manifests, time them (`bench_gpu.py run`), and leave in OUT the records, the reports in one archive and
# the logs. Expected on a 16-core H100/H200 machine: 2–4 minutes to prepare (both models at once), 1–2 to
# time; 7–9 minutes of device time with the start and the calls that carry the wheel (docs/benchmarks/slice.md).
set -euo pipefail
OUT=${1:?give the output folder}
PY=${PYTHON:-python3}
CACHE=${CACHE:-/tmp/slice-cache}
RESULTS=${RESULTS:-/tmp/slice-results}
MODELS=${MODELS:-"gpt2-small-shape-4k vit-b16-shape-head"}  # MODELS=vit-b16-shape-head: one alone
DRY_RUN=${DRY:+--cpu-dry-run}
mkdir -p "$OUT" "$CACHE" "$RESULTS"

if [ -d .whl ] && [ -z "$DRY_RUN" ]; then
  wheels=(.whl/*.whl)
  parts=$(find .whl -name 'onnxruntime_gpu.part*' | sort)  # carried one folder a call: .whl/c0, .whl/c1, …
  if [ -n "$parts" ]; then
    wheel=/tmp/${ORT_WHEEL:-onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl}
    cat $parts > "$wheel"
    wheels+=("$wheel")
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
  export PYTHONPATH=/tmp/site
  # onnxruntime-gpu finds CUDA and cuDNN in the image's nvidia wheels (torch is imported before any session)
  LD_LIBRARY_PATH=$("$PY" -c "import glob, site; print(':'.join(glob.glob(site.getsitepackages()[0] + '/nvidia/**/lib', recursive=True)))")
  export LD_LIBRARY_PATH
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
fi
"$PY" -c "import onnxruntime as ort, normpass; print('onnxruntime', ort.__version__, ort.get_available_providers(), 'normpass', normpass.__version__)"

start=$(date +%s)
for model in $MODELS; do
  "$PY" tools/bench_gpu.py prepare $DRY_RUN --cache "$CACHE/$model" --models "$model" \
    --variants fold-opt slice-0.25 > "$RESULTS/prepare-$model.log" 2>&1 &
done
wait
echo "prepared in $(( $(date +%s) - start )) s"
"$PY" - "$CACHE" <<'EOF'
import json, pathlib, sys
cache = pathlib.Path(sys.argv[1])
manifest = {}
for part in sorted(cache.glob("*/manifest.json")):
    manifest |= json.loads(part.read_text())
(cache / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
print("models:", ", ".join(manifest))
EOF

start=$(date +%s)
"$PY" tools/bench_gpu.py run $DRY_RUN --cache "$CACHE" --out "$RESULTS" --models $MODELS --repeats 20 --budget 2 \
  2>&1 | grep -v -i warn | tee "$RESULTS/run.log"
echo "timed in $(( $(date +%s) - start )) s"
cp "$RESULTS/records.json" "$OUT/records-ort.json"
tar czf "$OUT/slice-round.tgz" -C "$RESULTS" .
