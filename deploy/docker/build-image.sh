#!/usr/bin/env bash
# Builds the gasloc container image from this machine's own files: nothing is pulled (there
# may be no registry at all). The image is `FROM scratch` holding exactly what the two
# binaries load: gasloc-node and gasloc-bootstrap, the CPU part of libtorch from the
# checkout's .venv, and the C and C++ runtime libraries of this machine.
#
#   deploy/docker/build-image.sh [bin dir] [Dockerfile]
#     bin dir     where gasloc-node and gasloc-bootstrap are (default target/release)
#     Dockerfile  deploy/docker/Dockerfile.scratch (default) or deploy/docker/Dockerfile
#                 (FROM debian:bookworm-slim: for a machine with a registry)
#   environment: IMAGE (repository name, default gasloc)
#
# Idempotent and cached: the image is tagged with a hash of everything that goes into it
# (binaries, libraries, Dockerfile, this script); when that tag exists nothing is rebuilt.
# Either way `$IMAGE:latest` names the result, older tags of `$IMAGE` are removed, and the
# last line printed is `image=<tag>`.
#
# CUDA is not in the image (docs/operations.md, "Container image"): the PyPI wheel's CUDA
# libraries are 2.7 GB, and a GPU host has its own driver to match them to. The staged
# binaries and libtorch.so have libtorch_cuda.so removed from their needed libraries, so the
# image runs on CPU; the small CUDA runtime stubs libtorch_cpu.so itself links
# (libcudart, libcupti) are in it.
set -euo pipefail
self=$(realpath "$0")
repo=$(cd "$(dirname "$self")/../.." && pwd)
bin=${1:-$repo/target/release}
dockerfile=${2:-$repo/deploy/docker/Dockerfile.scratch}
image=${IMAGE:-gasloc}

die() { echo "build-image: $*" >&2; exit 1; }
for b in gasloc-node gasloc-bootstrap; do
  [ -x "$bin/$b" ] || die "$bin/$b is not built (cargo build --release --workspace, or make image)"
done
[ -f "$dockerfile" ] || die "no Dockerfile at $dockerfile"
docker info >/dev/null 2>&1 || die "no Docker engine answers (docker info failed)"
for tool in patchelf objcopy; do
  command -v "$tool" >/dev/null || die "$tool is missing (make image installs it)"
done

stage="$repo/target/docker-stage"
rm -rf "$stage"
root="$stage/rootfs"
lib="$root/usr/local/lib/gasloc"
mkdir -p "$root/usr/local/bin" "$lib" "$root/tmp" "$root/home/gasloc" "$root/data" "$root/run/gasloc"
chmod 1777 "$root/tmp"

# The binaries, without their debug sections (the image runs them, nobody debugs there).
for b in gasloc-node gasloc-bootstrap; do
  objcopy --strip-debug "$bin/$b" "$root/usr/local/bin/$b"
done

# Every library the binaries load, as the dynamic loader resolves them here, except CUDA's.
is_cuda() {
  case "$1" in
    */libcudart.so* | */libcupti.so*) return 1 ;; # linked by libtorch_cpu.so itself
    */nvidia/* | *libtorch_cuda* | *libc10_cuda* | *libcaffe2_nvrtc* | *libtorch_nvshmem*) return 0 ;;
    *) return 1 ;;
  esac
}
libs=$(ldd "$bin/gasloc-node" "$bin/gasloc-bootstrap" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $1 !~ /:$/ {print $1}' | sort -u)
for path in $libs; do
  if is_cuda "$path"; then
    continue
  elif [[ $path == "$repo"/* || $path == */site-packages/* ]]; then
    cp -L "$path" "$lib/" # libtorch and its companions (libc10, libgomp, libcudart, …)
  else
    mkdir -p "$root$(dirname "$path")"
    cp -L "$path" "$root$path" # the C and C++ runtime, where the loader looks for it
  fi
done
[ -f "$lib/libtorch_cpu.so" ] || die "libtorch_cpu.so was not among the libraries ldd found"
for f in "$root/usr/local/bin/gasloc-node" "$root/usr/local/bin/gasloc-bootstrap" "$lib"/*.so*; do
  if patchelf --print-needed "$f" | grep -qx 'libtorch_cuda.so'; then
    patchelf --remove-needed libtorch_cuda.so "$f"
  fi
done
# Nothing left may need a library the image lacks.
missing=$(cd "$root" && for f in usr/local/bin/* usr/local/lib/gasloc/*; do
  patchelf --print-needed "$f"
done | sort -u | while read -r need; do
  [ -n "$(find "$root" -name "$need" -print -quit)" ] || echo "$need"
done)
[ -z "$missing" ] || die "the staged image would lack: $missing"

cp "$dockerfile" "$stage/Dockerfile"
hash=$( (cd "$stage" && find . -type f -print0 | sort -z | xargs -0 sha256sum; sha256sum <"$self") | sha256sum | cut -c1-16)
tag="$image:$hash"
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "build-image: $tag is up to date"
else
  echo "build-image: building $tag from $(du -sh "$root" | cut -f1) of staged files"
  docker build -t "$tag" "$stage" >"$stage.log" 2>&1 || { cat "$stage.log" >&2; die "docker build failed"; }
fi
docker tag "$tag" "$image:latest"
# Older builds of this repository would pile up (half a gigabyte each): keep only this one.
docker image ls "$image" --format '{{.Repository}}:{{.Tag}}' | while read -r old; do
  [ "$old" = "$tag" ] || [ "$old" = "$image:latest" ] || docker rmi "$old" >/dev/null 2>&1 || true
done
rm -rf "$stage" "$stage.log"
echo "build-image: $(docker image inspect "$tag" --format '{{.Size}}' | awk '{printf "%.0f MB", $1 / 1e6}')"
echo "image=$tag"
