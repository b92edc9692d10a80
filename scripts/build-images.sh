#!/usr/bin/env bash
# Builds Switchyard's container images from Debian packages and the workspace's own binaries, on
# a machine whose only registries are package registries (no image registry is needed or used):
#
#   switchyard-agent     Debian 12 root cut down to the tools the agent executes + the static agent
#   switchyard-operator  empty base + the static (musl) operator
#   switchyard-testbox   Debian 12's static busybox + the static swy-echo (e2e test pods)
#
# Steps: apt-installs what is missing (mmdebstrap, buildah, musl-tools, binutils, python3), adds the
# musl Rust target; builds both binaries static in one cargo run (cargo build --release --locked
# --target x86_64-unknown-linux-musl: their dependencies compile once) unless --bin-dir names them; builds each base root with
# `mmdebstrap --variant=extract` + images/base/trim-rootfs.py into
# $CACHE/images/base/debian12-<base>-<recipe hash>.tar (rebuilt only when images/base/<base>.conf
# or trim-rootfs.py change) and imports it into containers storage as
# localhost/switchyard-<base>-base:debian12 (what the Containerfiles FROM); runs
# images/<component>/Containerfile with `buildah bud` (no RUN steps: no runtime, no network); and
# writes docker-archive files that keep the image reference:
#
#   $CACHE/images/switchyard-agent.tar     docker.io/library/switchyard-agent:<tag>
#   $CACHE/images/switchyard-operator.tar  docker.io/library/switchyard-operator:<tag>
#   $CACHE/images/switchyard-testbox.tar   docker.io/library/switchyard-testbox:<tag>
#
# <tag> is the chart's appVersion (helm/switchyard/Chart.yaml), which is what the chart's defaults
# (image.registry "", image.tag "" -> appVersion) resolve to. Import on a node with
#   ctr -n k8s.io images import $CACHE/images/switchyard-agent.tar
# An image is rebuilt only when its Containerfile, its binary or its base changed.
#
# Usage: scripts/build-images.sh [--bin-dir DIR] [--tag TAG] [--push REGISTRY] [--rebuild]
#   --bin-dir DIR    take switchyard-agent, switchyard-operator and swy-echo (all static) from
#                    DIR instead of building them
#   --tag TAG        image tag (default: the chart's appVersion)
#   --push REGISTRY  also push the three images to REGISTRY/<name>:<tag> (buildah push;
#                    SWITCHYARD_PUSH_TLS_VERIFY=false for a plain-HTTP registry)
#   --rebuild        rebuild the bases and the images even when the cache is current
# Environment: SWITCHYARD_CACHE (default ~/.cache/switchyard), CARGO_TARGET_DIR.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${SWITCHYARD_CACHE:-$HOME/.cache/switchyard}"
OUT="$CACHE/images"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
MUSL=x86_64-unknown-linux-musl
SUITE=bookworm
BIN_DIR=""
PUSH=""
REBUILD=0
TAG="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$ROOT/helm/switchyard/Chart.yaml")"

log() { printf '%s build-images: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --bin-dir) BIN_DIR="$(cd "$2" && pwd)"; shift 2 ;;
    --tag) TAG="$2"; shift 2 ;;
    --push) PUSH="${2%/}"; shift 2 ;;
    --rebuild) REBUILD=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[ -n "$TAG" ] || die "no appVersion in helm/switchyard/Chart.yaml"
[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap root mode, rootful buildah storage)"

START=$(date +%s)
mkdir -p "$OUT/base" "$OUT/context"
# One build at a time per cache (other users of the same machine).
exec 9>"$OUT/.lock"
flock 9

# --- tools --------------------------------------------------------------------------------------
missing=()
for tool in mmdebstrap:mmdebstrap buildah:buildah python3:python3 strip:binutils readelf:binutils \
            dpkg-deb:dpkg flock:util-linux; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if [ -z "$BIN_DIR" ]; then
  command -v musl-gcc >/dev/null || missing+=(musl-tools)
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null \
    || { apt-get update >/dev/null && \
         DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
fi

# --- binaries -----------------------------------------------------------------------------------
if [ -z "$BIN_DIR" ]; then
  if ! rustup target list --installed | grep -qx "$MUSL"; then
    log "rustup target add $MUSL"
    rustup target add "$MUSL"
  fi
  # One cargo run for both: the dependencies (kube, k8s-openapi, tokio, ...) compile once. The
  # agent allocates through mimalloc on musl (musl's own allocator is slow under many threads).
  # ring's C and assembly code is compiled with musl-gcc (musl-tools).
  log "cargo build --release --locked --target $MUSL --bin switchyard-agent --bin switchyard-operator"
  (cd "$ROOT" && CC_x86_64_unknown_linux_musl=musl-gcc \
    cargo build --release --locked --target "$MUSL" -p switchyard-agent -p switchyard-operator \
      --bin switchyard-agent --bin switchyard-operator)
  # swy-echo uses std only: compiled alone (building it through Cargo would build the whole e2e
  # crate, kube and all, for musl).
  echo_bin="$TARGET_DIR/$MUSL/release/swy-echo"
  if [ ! -x "$echo_bin" ] || [ "$ROOT/tests/src/bin/swy-echo.rs" -nt "$echo_bin" ]; then
    log "rustc --target $MUSL tests/src/bin/swy-echo.rs"
    mkdir -p "$(dirname "$echo_bin")"
    rustc --edition 2024 --crate-name swy_echo -C opt-level=3 --target "$MUSL" \
      -o "$echo_bin" "$ROOT/tests/src/bin/swy-echo.rs"
  fi
  agent_bin="$TARGET_DIR/$MUSL/release/switchyard-agent"
  operator_bin="$TARGET_DIR/$MUSL/release/switchyard-operator"
else
  agent_bin="$BIN_DIR/switchyard-agent"
  operator_bin="$BIN_DIR/switchyard-operator"
  echo_bin="$BIN_DIR/swy-echo"
fi
for b in "$agent_bin" "$operator_bin" "$echo_bin"; do [ -x "$b" ] || die "missing binary $b"; done
for b in "$agent_bin" "$operator_bin" "$echo_bin"; do
  # The listing first, then the match (a pipe into grep -q could end readelf early, and pipefail
  # would then read the match as a failure).
  headers="$(readelf -lW "$b")" || die "readelf cannot read $b"
  ! grep -q 'Requesting program interpreter' <<<"$headers" || die "$b is not static"
done

# Build contexts: copies without debug information (the release profile keeps line tables for
# the workspace's backtraces; the symbols stay), with the original's modification time.
context() { # component binary
  local dir="$OUT/context/$1" name
  name="$(basename "$2")"
  mkdir -p "$dir"
  if [ ! -f "$dir/$name" ] || [ "$2" -nt "$dir/$name" ] || [ "$dir/$name" -nt "$2" ]; then
    strip --strip-debug -o "$dir/$name.tmp" "$2"
    touch -r "$2" "$dir/$name.tmp"
    mv "$dir/$name.tmp" "$dir/$name"
  fi
}
context agent "$agent_bin"
context operator "$operator_bin"
context testbox "$echo_bin"

# --- bases --------------------------------------------------------------------------------------
# Timestamps (SOURCE_DATE_EPOCH for mmdebstrap and tar, buildah --timestamp): a base's is the time
# of the last commit that touched images/base, an image's the newest mtime of its build context, so
# equal inputs give equal image IDs and unrelated commits rebuild nothing.
SOURCE_DATE_EPOCH="$(git -C "$ROOT" log -1 --format=%ct -- images/base 2>/dev/null || true)"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-0}"

base() { # name -> imports localhost/switchyard-<name>-base:debian12
  local name="$1" conf="$ROOT/images/base/$1.conf" hash archive ref work packages trimmed
  hash="$( (echo "$SUITE extract merged-usr v1"; cat "$conf" "$ROOT/images/base/trim-rootfs.py") \
           | sha256sum | cut -c1-12)"
  archive="$OUT/base/debian12-$name-$hash.tar"
  ref="localhost/switchyard-$name-base:debian12"
  if [ "$REBUILD" = 1 ] || [ ! -f "$archive" ]; then
    packages="$(awk '$1 == "package" { printf "%s%s", sep, $2; sep = "," }' "$conf")"
    log "base $name: mmdebstrap --variant=extract $SUITE ($packages), recipe $hash"
    work="$(mktemp -d "$OUT/base/.root-$name.XXXXXX")"
    mmdebstrap --variant=extract --skip=cleanup/apt/cache \
      --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr --include="$packages" "$SUITE" "$work" \
      >"$OUT/base/mmdebstrap-$name.log" 2>&1 \
      || { tail -20 "$OUT/base/mmdebstrap-$name.log" >&2; die "mmdebstrap failed (log: $OUT/base/mmdebstrap-$name.log)"; }
    trimmed="$("$ROOT/images/base/trim-rootfs.py" "$work" "$conf")"
    log "base $name: $trimmed"
    tar --create --file "$archive.tmp" --directory "$work" --numeric-owner --sort=name \
      --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime --exclude='./dev/*' --exclude='./proc/*' \
      --exclude='./sys/*' .
    rm -rf "$work"
    mv "$archive.tmp" "$archive"
    find "$OUT/base" -name "debian12-$name-*.tar" ! -name "$(basename "$archive")" -delete
    log "base $name: $(du -h "$archive" | cut -f1) $(basename "$archive")"
  else
    log "base $name: cached $(basename "$archive")"
  fi
  if [ "$REBUILD" = 1 ] || [ "$(buildah inspect --type image \
       --format '{{index .OCIv1.Config.Labels "dev.switchyard.base.recipe"}}' "$ref" 2>/dev/null)" != "$hash" ]; then
    log "base $name: import as $ref"
    local ctr
    ctr="$(buildah from --quiet scratch)"
    buildah add --quiet "$ctr" "$archive" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --label "dev.switchyard.base.recipe=$hash" "$ctr"
    buildah commit --quiet --rm --timestamp "$SOURCE_DATE_EPOCH" "$ctr" "$ref-$hash" >/dev/null
    buildah tag "$ref-$hash" "$ref"
    # Earlier recipes' bases (their app images keep their layers until replaced).
    buildah images --noheading --format '{{.Name}}:{{.Tag}}' | grep "^localhost/switchyard-$name-base:" \
      | grep -v -e ":debian12$" -e ":debian12-$hash$" | xargs -r buildah rmi >/dev/null 2>&1 || true
  fi
}
base agent
base testbox

# --- images -------------------------------------------------------------------------------------
image() { # component
  local name="switchyard-$1" dir="$OUT/context/$1" ref inputs stamp archive from stamp_time
  ref="docker.io/library/$name:$TAG"
  archive="$OUT/$name.tar"
  stamp="$OUT/.$name.inputs"
  from="$(sed -n 's/^FROM \([^ ]*\).*/\1/p' "$ROOT/images/$1/Containerfile")"
  stamp_time="$(stat -c %Y "$dir"/* | sort -n | tail -1)"
  inputs="$( (echo "$TAG $stamp_time"; cat "$ROOT/images/$1/Containerfile"; \
              [ "$from" = scratch ] || buildah inspect --type image --format '{{.FromImageID}}' "$from"; \
              cd "$dir" && sha256sum -- *) | sha256sum | cut -c1-16)"
  if [ "$REBUILD" = 0 ] && [ -f "$archive" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ] \
     && buildah inspect --type image "$ref" >/dev/null 2>&1; then
    log "$name: cached ($ref)"
    return
  fi
  log "$name: buildah bud images/$1/Containerfile -> $ref"
  local old
  old="$(buildah inspect --type image --format '{{.FromImageID}}' "$ref" 2>/dev/null || true)"
  buildah bud --quiet --pull=never --timestamp "$stamp_time" --build-arg "VERSION=$TAG" \
    -f "$ROOT/images/$1/Containerfile" -t "$ref" "$dir" >/dev/null
  rm -f "$archive.tmp"
  buildah push --quiet "$ref" "docker-archive:$archive.tmp:$ref"
  mv "$archive.tmp" "$archive"
  # What it would weigh gzip-compressed (a registry's layers are): for the summary.
  gzip -6 -c "$archive" | wc -c >"$OUT/.$name.gzip-bytes"
  echo "$inputs" >"$stamp"
  # The image this one replaces, unless something else still names it.
  if [ -n "$old" ] && [ "$old" != "$(buildah inspect --type image --format '{{.FromImageID}}' "$ref")" ]; then
    buildah rmi "$old" >/dev/null 2>&1 || true
  fi
}
image agent
image operator
image testbox

if [ -n "$PUSH" ]; then
  for c in agent operator testbox; do
    log "push switchyard-$c:$TAG to $PUSH"
    buildah push --quiet --tls-verify="${SWITCHYARD_PUSH_TLS_VERIFY:-true}" \
      "docker.io/library/switchyard-$c:$TAG" "docker://$PUSH/switchyard-$c:$TAG"
  done
fi

# --- summary ------------------------------------------------------------------------------------
for c in agent operator testbox; do
  ref="docker.io/library/switchyard-$c:$TAG"
  size="$(buildah images --noheading --format '{{.Size}}' "$ref" | head -1)"
  log "$(printf '%-24s %6s KiB archive (%s KiB gzipped), %s unpacked: %s' "switchyard-$c.tar" \
        "$(( $(stat -c %s "$OUT/switchyard-$c.tar") / 1024 ))" \
        "$(( $(cat "$OUT/.switchyard-$c.gzip-bytes" 2>/dev/null || echo 0) / 1024 ))" "$size" "$ref")"
done
log "done in $(( $(date +%s) - START )) s; import with: ctr -n k8s.io images import $OUT/switchyard-<name>.tar"
