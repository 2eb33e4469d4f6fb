#!/usr/bin/env bash
# Build llama.cpp's tools from the llama-cpp-python sdist (which vendors llama.cpp), export a DSpark drafter to GGUF
# with llama.cpp's own converter, and check it beside the SmolLM2 target GGUF (tools/check_llamacpp_dspark.py).
# Never part of CI; everything lands under $ROOT (default /work/envs/llamacpp), nothing in the repository.
#
#   tools/llamacpp_dspark.sh DRAFTER_DIR [extra check_llamacpp_dspark.py args]
#
# Environment: ROOT, PYTHON (this package's Python, default python3), JOBS (build jobs, default 2),
# LLAMA_CPP_PYTHON_VERSION (default 0.3.36), CPU_FLAGS (cmake flags of ggml's CPU backend, see below),
# LLAMAFILE (GGML_LLAMAFILE, default OFF) and LLAMA_ARGS (extra flags of both llama.cpp tools, default "-fa off"):
# the defaults make llama.cpp + drafter produce exactly llama.cpp's plain greedy output.
#
# The four-way table (llama.cpp and transformers, plain and + drafter, one run, a small JSON):
#   PYTHON=python tools/llamacpp_dspark.sh DRAFTER --transformers-drafter DRAFTER --threads 2 --json fourway.json
set -euo pipefail
DRAFTER=${1:?usage: $0 DRAFTER_DIR [check args]}
shift
ROOT=${ROOT:-/work/envs/llamacpp}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-2}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
SRC=$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp
mkdir -p "$ROOT"

# 1. llama.cpp source, as the registry ships it inside the llama-cpp-python sdist
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
    "$PYTHON" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$ROOT"
    tar xzf "$ROOT/llama_cpp_python-$VERSION.tar.gz" -C "$ROOT"
fi

# 2. the two tools the check needs (CPU only). Not GGML_NATIVE: on a CPU that reports AMX but whose OS or sandbox
# does not grant the AMX tile state, the native build dies with "Illegal instruction" in tinygemm_kernel_amx
# (seen here on a Xeon with amx_int8 in /proc/cpuinfo); AVX-512 without AMX runs.
# The AVX-512 extensions are switched on only where /proc/cpuinfo lists them (an AMD EPYC without avx512_vbmi and
# avx_vnni died with SIGILL in llama-completion when they were on).
has() { grep -qw "$1" /proc/cpuinfo 2>/dev/null && echo ON || echo OFF; }
CPU_FLAGS=${CPU_FLAGS:-"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512_vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni) \
    -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=$(has avx_vnni) \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"}
# Not llamafile's sgemm (GGML_LLAMAFILE=OFF): it serves matmuls of 2+ tokens only, so a token's logits would depend on
# how many tokens share its batch and speculative output could drift from plain greedy (docs/engines.md, "Identical
# to plain greedy"). Re-running cmake on an existing build only recompiles what changed.
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_LLAMAFILE="${LLAMAFILE:-OFF}" $CPU_FLAGS >/dev/null
nice -n 19 cmake --build "$ROOT/build" --target llama-speculative-simple llama-completion -j"$JOBS"

# 3. a Python for llama.cpp's converter (its requirements pin an older transformers than dspark-hf's)
if [ ! -x "$ROOT/venv/bin/python" ]; then
    python3 -m venv "$ROOT/venv"
    "$ROOT/venv/bin/pip" install torch==2.13.0 "numpy<2.5" "sentencepiece<0.3" "transformers<=5.19.0" \
        safetensors "protobuf<5" pyyaml tqdm requests
fi

# 4. export through llama.cpp's converter, then compare llama.cpp + drafter with llama.cpp plain greedy
"$PYTHON" -m dspark_hf.cli export --format gguf --drafter "$DRAFTER" --out "$ROOT/draft.gguf" --overwrite \
    --llamacpp "$SRC" --converter-python "$ROOT/venv/bin/python" --outtype f32
# -fa off: the CPU flash-attention kernel takes another path for 64+ queries (the prompt) than for a few (decode,
# verify); with it on, llama.cpp's own speculative output can differ from its plain greedy output
"$PYTHON" "$(dirname "$0")/check_llamacpp_dspark.py" --bin "$ROOT/build/bin" --draft "$ROOT/draft.gguf" \
    --llama-args "${LLAMA_ARGS--fa off}" "$@"
