#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kubectl and helm with Go from the Go module registry into a cache
# directory outside git (default ~/.cache/switchyard), reusing binaries already built; for the
# real-node test tier also kube-controller-manager, kube-scheduler, kubelet, containerd (with its
# runc shim and ctr), crictl and the pods' sandbox ("pause") binary.
# Prints the bin directory on its last line of stdout (helm and the node tier's binaries are linked
# into it).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"

cache=${SWITCHYARD_CACHE:-$HOME/.cache/switchyard}
# Bump RECIPE when the way binaries are built changes, so caches rebuild.
RECIPE=2
# Same for helm (bumping it rebuilds only helm).
HELM_RECIPE=1
# Same for the node tier's containerd, crictl and pause.
NODE_RECIPE=1
bin="$cache/bin/k8s-$KUBERNETES_VERSION-etcd-$ETCD_VERSION-r$RECIPE"
mkdir -p "$bin"
# One build at a time per cache (tests, CI and people may start this concurrently): a second run
# waits here, then finds the binaries built.
exec 9>"$cache/build.lock"
if ! flock -n 9; then
  echo "[build-control-plane $(date +%H:%M:%S)] waiting for another build in $cache" >&2
  flock 9
fi

if ! command -v go >/dev/null 2>&1; then
  for g in /usr/local/go/bin/go /usr/lib/go/bin/go; do [ -x "$g" ] && PATH="$(dirname "$g"):$PATH" && break; done
fi
command -v go >/dev/null 2>&1 || { echo "switchyard: Go toolchain not found: cannot build kube-apiserver/etcd for the test control plane (install Go >= 1.25)" >&2; exit 1; }

export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local
export GOPATH="$cache/go" GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build-cache"

# The control plane (apiserver, controller-manager, scheduler), kubectl, and the node tier's
# kubelet, and kube-proxy (the incumbent the takeover tests replace); one module set-up, so the
# shared packages compile once.
KUBE_COMMANDS="kube-apiserver kubectl kube-controller-manager kube-scheduler kubelet kube-proxy"

log() { echo "[build-control-plane $(date +%H:%M:%S)] $*" >&2; }
fail_registry() { echo "switchyard: cannot fetch $1 from the Go module registry (no network or registry unavailable): see $2" >&2; exit 1; }

build_etcd() {
  local out="$bin/etcd" dir="$cache/gobuild/etcd-$ETCD_VERSION"
  [ -x "$out" ] && return 0
  log "building etcd $ETCD_VERSION (cold builds take a few minutes)"
  mkdir -p "$dir"
  cat > "$dir/go.mod" <<MOD
module switchyard.local/etcd
go 1.25
require go.etcd.io/etcd/server/v3 $ETCD_VERSION
MOD
  (cd "$dir" && go mod download go.etcd.io/etcd/server/v3 >"$dir/download.log" 2>&1) || fail_registry "go.etcd.io/etcd/server/v3@$ETCD_VERSION" "$dir/download.log"
  # Not `build && mv`: a failed command before && does not stop a `set -e` script.
  (cd "$dir" && go build -trimpath -ldflags "-s -w" -o "$out.tmp" go.etcd.io/etcd/server/v3) \
    || { echo "switchyard: cannot build etcd $ETCD_VERSION" >&2; exit 1; }
  mv "$out.tmp" "$out"
  log "etcd ready: $out"
}

build_kube() {
  local dir="$cache/gobuild/kubernetes-$KUBERNETES_VERSION"
  local cmd missing=0
  for cmd in $KUBE_COMMANDS; do [ -x "$bin/$cmd" ] || missing=1; done
  [ "$missing" = 0 ] && return 0
  log "building $KUBE_COMMANDS $KUBERNETES_VERSION (cold build: 10+ minutes on 2 cores)"
  mkdir -p "$dir"
  local modfile
  modfile=$(cd "$dir" && printf 'module switchyard.local/x\ngo 1.25\n' > go.mod && go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" 2>"$dir/download.log" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p') || true
  [ -n "$modfile" ] && [ -f "$modfile" ] || fail_registry "k8s.io/kubernetes@$KUBERNETES_VERSION" "$dir/download.log"
  local staging="v0.${KUBERNETES_VERSION#v1.}"
  {
    echo "module switchyard.local/kubernetes"
    echo "go 1.25"
    echo "require k8s.io/kubernetes $KUBERNETES_VERSION"
    echo "replace ("
    # k8s.io/kubernetes replaces its staging modules with local paths; map each to its published version.
    sed -n '/^replace (/,/^)/p' "$modfile" | sed -n "s#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\t\1 => \1 $staging#p"
    echo ")"
  } > "$dir/go.mod"
  local minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
  local ldflags="-s -w" pkg pkgs=() out
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags="$ldflags -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  for cmd in $KUBE_COMMANDS; do [ -x "$bin/$cmd" ] || pkgs+=("k8s.io/kubernetes/cmd/$cmd"); done
  # One go build for all of them: their packages compile and the binaries link in parallel.
  out=$(mktemp -d "$bin/.build.XXXXXX")
  (cd "$dir" && go build -trimpath -ldflags "$ldflags" -o "$out/" "${pkgs[@]}") \
    || { rm -rf "$out"; echo "switchyard: cannot build $KUBE_COMMANDS $KUBERNETES_VERSION" >&2; exit 1; }
  for pkg in "${pkgs[@]}"; do
    cmd=${pkg##*/}
    mv "$out/$cmd" "$bin/$cmd"
    log "$cmd ready: $bin/$cmd"
  done
  rmdir "$out"
}

build_helm() {
  # helm lives in a directory of its own version and is linked into $bin, so bumping HELM_VERSION
  # rebuilds only helm, not the (slow) control plane.
  local hbin="$cache/bin/helm-$HELM_VERSION-r$HELM_RECIPE" dir="$cache/gobuild/helm-$HELM_VERSION"
  local out="$hbin/helm"
  if [ ! -x "$out" ]; then
    log "building helm $HELM_VERSION (cold build: a few minutes)"
    mkdir -p "$dir" "$hbin"
    cat > "$dir/go.mod" <<MOD
module switchyard.local/helm
go 1.25
require helm.sh/helm/${HELM_VERSION%%.*} $HELM_VERSION
MOD
    (cd "$dir" && go mod download "helm.sh/helm/${HELM_VERSION%%.*}" >"$dir/download.log" 2>&1) || fail_registry "helm.sh/helm/${HELM_VERSION%%.*}@$HELM_VERSION" "$dir/download.log"
    local pkg="helm.sh/helm/${HELM_VERSION%%.*}" ldflags client_go major minor
    # As helm's Makefile does: the default Kubernetes version of `helm template`/`lint` follows the
    # client-go helm was built with (client-go v0.N is Kubernetes v1.N).
    client_go=$(cd "$dir" && go list -f '{{.Version}}' -m k8s.io/client-go 2>>"$dir/download.log") || fail_registry "helm's k8s.io/client-go" "$dir/download.log"
    client_go=${client_go#v}; major=$(( ${client_go%%.*} + 1 )); minor=${client_go#*.}; minor=${minor%%.*}
    ldflags="-s -w -X $pkg/internal/version.version=$HELM_VERSION"
    for v in lint/rules chartutil; do
      ldflags="$ldflags -X $pkg/pkg/$v.k8sVersionMajor=$major -X $pkg/pkg/$v.k8sVersionMinor=$minor"
    done
    (cd "$dir" && go build -trimpath -ldflags "$ldflags" -o "$out.tmp" "$pkg/cmd/helm" >"$dir/build.log" 2>&1) \
      || { echo "switchyard: cannot build helm $HELM_VERSION with $(go version | cut -d' ' -f3): see $dir/build.log" >&2; exit 1; }
    mv "$out.tmp" "$out"
    log "helm ready: $out"
  fi
  [ "$(readlink "$bin/helm" 2>/dev/null)" = "$out" ] || ln -sfn "$out" "$bin/helm"
}

build_node() {
  # containerd, its runc shim, ctr and crictl (static, CGO off: the btrfs snapshotter, which needs
  # cgo, drops out by its build constraint), and the sandbox binary from scripts/pause; in a
  # directory of their own versions, linked into $bin like helm.
  local nbin="$cache/bin/node-containerd-$CONTAINERD_VERSION-crictl-$CRICTL_VERSION-r$NODE_RECIPE"
  local cdir="$cache/gobuild/containerd-$CONTAINERD_VERSION" xdir="$cache/gobuild/crictl-$CRICTL_VERSION"
  local names="containerd containerd-shim-runc-v2 ctr crictl swyt-pause" name missing=0
  for name in $names; do [ -x "$nbin/$name" ] || missing=1; done
  if [ "$missing" = 1 ]; then
    mkdir -p "$nbin" "$cdir" "$xdir"
    local pkg=github.com/containerd/containerd/v2
    if [ ! -x "$nbin/containerd" ] || [ ! -x "$nbin/containerd-shim-runc-v2" ] || [ ! -x "$nbin/ctr" ]; then
      log "building containerd $CONTAINERD_VERSION (containerd, containerd-shim-runc-v2, ctr; cold build: several minutes)"
      printf 'module switchyard.local/containerd\ngo 1.25\nrequire %s %s\n' "$pkg" "$CONTAINERD_VERSION" > "$cdir/go.mod"
      (cd "$cdir" && go mod download "$pkg" >"$cdir/download.log" 2>&1) || fail_registry "$pkg@$CONTAINERD_VERSION" "$cdir/download.log"
      local ld="-s -w -X $pkg/version.Version=$CONTAINERD_VERSION -X $pkg/version.Package=$pkg"
      local tags="urfave_cli_no_docs no_btrfs no_devmapper no_zfs"
      for name in containerd ctr; do
        (cd "$cdir" && go build -trimpath -tags "$tags" -ldflags "$ld" -o "$nbin/$name.tmp" "$pkg/cmd/$name" >"$cdir/build-$name.log" 2>&1) \
          || { echo "switchyard: cannot build $name $CONTAINERD_VERSION: see $cdir/build-$name.log" >&2; exit 1; }
        mv "$nbin/$name.tmp" "$nbin/$name"; log "$name ready: $nbin/$name"
      done
      (cd "$cdir" && go build -trimpath -tags "$tags no_grpc" -ldflags "$ld" -o "$nbin/containerd-shim-runc-v2.tmp" "$pkg/cmd/containerd-shim-runc-v2" >"$cdir/build-shim.log" 2>&1) \
        || { echo "switchyard: cannot build containerd-shim-runc-v2: see $cdir/build-shim.log" >&2; exit 1; }
      mv "$nbin/containerd-shim-runc-v2.tmp" "$nbin/containerd-shim-runc-v2"; log "containerd-shim-runc-v2 ready"
    fi
    if [ ! -x "$nbin/crictl" ]; then
      log "building crictl $CRICTL_VERSION"
      printf 'module switchyard.local/crictl\ngo 1.25\nrequire sigs.k8s.io/cri-tools %s\n' "$CRICTL_VERSION" > "$xdir/go.mod"
      (cd "$xdir" && go mod download sigs.k8s.io/cri-tools >"$xdir/download.log" 2>&1) || fail_registry "sigs.k8s.io/cri-tools@$CRICTL_VERSION" "$xdir/download.log"
      (cd "$xdir" && go build -trimpath -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" -o "$nbin/crictl.tmp" sigs.k8s.io/cri-tools/cmd/crictl >"$xdir/build.log" 2>&1) \
        || { echo "switchyard: cannot build crictl $CRICTL_VERSION: see $xdir/build.log" >&2; exit 1; }
      mv "$nbin/crictl.tmp" "$nbin/crictl"; log "crictl ready: $nbin/crictl"
    fi
    if [ ! -x "$nbin/swyt-pause" ]; then
      (cd "$here/pause" && go build -trimpath -ldflags "-s -w" -o "$nbin/swyt-pause.tmp" .) \
        || { echo "switchyard: cannot build the pause binary (scripts/pause)" >&2; exit 1; }
      mv "$nbin/swyt-pause.tmp" "$nbin/swyt-pause"
      log "swyt-pause ready: $nbin/swyt-pause"
    fi
  fi
  for name in $names; do
    [ "$(readlink "$bin/$name" 2>/dev/null)" = "$nbin/$name" ] || ln -sfn "$nbin/$name" "$bin/$name"
  done
}

build_etcd
build_kube
build_helm
build_node
echo "$bin"
