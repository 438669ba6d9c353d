# One device call: wheels, the card and its matmul rate, then benchmarks/speculators_live.py (issue 37)
# with the worker and both trainers on the same GPU; the benchmark stops by second END_S of the command.
set -o pipefail
start=$SECONDS
cd .m2/src || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu --format=csv; nproc; df -h /dev/shm | tail -1; } > $OUT/machine.txt
python3 - >> $OUT/machine.txt 2>&1 <<'PY'
import torch, transformers, datasets, pyarrow, speculators, hs_connectors
from importlib.metadata import version
from layertap.worker.bench.measure import matmul_rate
rate = matmul_rate(torch.device("cuda"))
print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda, "transformers",
      transformers.__version__, "datasets", datasets.__version__, "pyarrow", pyarrow.__version__,
      "speculators", version("speculators"), "hs-connectors", version("hs-connectors"))
print(f"matmul bf16 8192^3: {rate / 1e12:.1f} TFLOP/s (layertap.worker.bench.measure.matmul_rate, median of 10)")
PY
cat $OUT/machine.txt
left=$(( ${END_S:-580} - (SECONDS - start) ))
echo "benchmark limit: ${left} s"; date -u +%T
timeout -k 8 $left python3 benchmarks/speculators_live.py --model shape:qwen3-8b --compile --rows 512 --min-len 128 \
  --max-len 2047 --work /dev/shm/spec-live --out $OUT/speculators-live.json > $OUT/run.log 2>&1
echo "rc=$?"; date -u +%T
grep -v "Saving the dataset" $OUT/run.log | tail -c 6000
cd /dev/shm/spec-live && tar czf $OUT/logs.tar.gz worker.log trainer-files.log trainer-live.log files-steps.jsonl live-steps.jsonl
ls -la $OUT
