#!/bin/bash
# Plain decoding against llama.cpp on the same GGUF files, each LocalSpec run between two
# llama.cpp runs (a shared machine's speed drifts over minutes), plus this machine's read
# bandwidth and each native kernel's share of it.
#
#   LLAMA_BIN=/path/to/llama.cpp/build/bin scripts/bench_vs_llamacpp.sh PRESET=FILE.gguf ...
#
# PRESET is a preset whose target is FILE (e.g. one made by `localspec models drafters FILE
# --make-preset NAME`). llama.cpp's source ships in the llama-cpp-python sdist (vendor/llama.cpp):
# cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-bench.
set -euo pipefail
: "${LLAMA_BIN:?set LLAMA_BIN to the build/bin folder of llama.cpp}"
threads=${THREADS:-$(nproc)}
echo "== $(date -u) $(lscpu | grep 'Model name' | tr -s ' ') threads $threads"
python3 -m localspec bench --bandwidth 2>/dev/null
for pair in "$@"; do
  preset=${pair%%=*}
  file=${pair#*=}
  echo "== $preset: $file ($(stat -c %s "$file") bytes)"
  "$LLAMA_BIN/llama-bench" -m "$file" -t "$threads" -p 0 -n 128 -r 3 2>/dev/null | grep tg128
  python3 -m localspec bench --preset "$preset" --methods none --repeats 3 2>/dev/null | head -2
  "$LLAMA_BIN/llama-bench" -m "$file" -t "$threads" -p 0 -n 128 -r 3 2>/dev/null | grep tg128
done
