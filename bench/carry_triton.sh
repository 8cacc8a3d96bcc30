#!/usr/bin/env bash
# Carry another Triton release to an offline GPU machine, to run the tests and the benchmark on it.
#
# Here (needs the package index; a few minutes of xz):
#   bash bench/carry_triton.sh prepare 3.9.0 .triton-3.9       # .triton-3.9/part1, .triton-3.9/part2, ~30 MB each
# On the GPU machine, two calls in a row on the same warm machine:
#   call 1, carrying .triton-3.9/part1:  bash bench/carry_triton.sh stage 1 .triton-3.9
#   call 2, carrying .triton-3.9/part2:  bash bench/carry_triton.sh stage 2 .triton-3.9
#   then: PYTHONPATH=/tmp/triton-site:$PWD python3 -m pytest ...   (or python3 -m flashtile.bench ...)
#
# The wheel (~290 MB) is over one call's carry limit, so it travels slimmed and in two xz parts: only
# the nvidia backend, libtriton stripped of debug info (192 MB instead of 477), no profiler, and the
# backend entry points narrowed to nvidia to match. The wheel is cp312-abi3: it must be the one for the
# GPU machine's Python (3.12); a cp311 build there crashes on import.
set -euo pipefail
cmd=${1:?usage: carry_triton.sh prepare VERSION DEST | stage 1|2 DEST}
site=/tmp/triton-site
case "$cmd" in
  prepare)
    version=${2:?version}; dest=${3:?dest}
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      -d "$tmp" "triton==$version"
    mkdir "$tmp/site" && (cd "$tmp/site" && python3 -m zipfile -e "$tmp"/triton-*.whl .)
    t="$tmp/site/triton"
    rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" \
           "$t/FileCheck" "$t/instrumentation" "$t/profiler" "$t/_C/libproton.so"
    # sm90 is assembled by ptxas-blackwell from 3.9 on, by ptxas before: keep the one this release uses.
    if [ "$(printf '%s\n' "$version" 3.9 | sort -V | head -1)" = 3.9 ]; then rm -f "$t/backends/nvidia/bin/ptxas"; fi
    strip --strip-unneeded "$t/_C/libtriton.so"
    chmod +x "$t"/backends/nvidia/bin/*
    printf '[triton.backends]\nnvidia = triton.backends.nvidia\n' > "$tmp"/site/triton-*.dist-info/entry_points.txt
    mkdir -p "$dest/part1" "$dest/part2"
    (cd "$tmp/site" && tar -cf - . | xz -6 -T2) > "$tmp/site.tar.xz"
    half=$(( ($(stat -c %s "$tmp/site.tar.xz") + 1) / 2 ))
    split -b "$half" "$tmp/site.tar.xz" "$tmp/part."
    mv "$tmp/part.aa" "$dest/part1/" && mv "$tmp/part.ab" "$dest/part2/"
    rm -rf "$tmp"
    du -sh "$dest"/part1 "$dest"/part2 ;;
  stage)
    part=${2:?part}; dest=${3:?dest}
    case "$part" in
      1) mkdir -p /tmp/triton-parts && cp "$dest/part1/part.aa" /tmp/triton-parts/ && echo "stage 1 done" ;;
      2) [ -f /tmp/triton-parts/part.aa ] || { echo "stage 1 is not on this machine (it went cold): run it again" >&2; exit 3; }
         mkdir -p "$site" && cat /tmp/triton-parts/part.aa "$dest/part2/part.ab" | xz -d | tar -xf - -C "$site"
         echo "stage 2 done: triton $(PYTHONPATH=$site python3 -c 'import triton; print(triton.__version__)') in $site" ;;
    esac ;;
esac
