#!/usr/bin/env bash
# The kube-proxy takeover in IPVS mode, in the IPVS VM (the host kernel has no IPVS): boots the
# pinned Debian kernel of scripts/ipvs-vm.sh under qemu TCG with an initramfs whose /init
# (scripts/ipvs-vm-kube-proxy.init) runs the real kube-proxy in IPVS mode, a client load, and the
# Switchyard agent with --takeover-kube-proxy (tests/tests/ipvs_vm_takeover.rs asserts on it).
#
# The apiserver is the host test's (on 127.0.0.1:$SWITCHYARD_VM_APISERVER_PORT). The VM's only NIC
# is qemu user networking with restrict=on: the guest reaches no host or outside address, except
# the one forward 10.250.0.1:$PORT (guestfwd), for which qemu runs `socat` to the host loopback
# port per connection. Every 10.x address lives in the guest only.
#
# Inputs (environment): SWITCHYARD_VM_APISERVER_PORT, SWITCHYARD_VM_CFG (a directory put at /cfg in
# the guest: kube-proxy.yaml, its kubeconfig, the agent's kubeconfig and the certificates they
# name), SWITCHYARD_VM_KUBE_PROXY (the static kube-proxy binary).
#
# Cached under ~/.cache/switchyard/ipvs-vm (SWITCHYARD_IPVS_VM_CACHE), shared with
# scripts/ipvs-vm.sh: the kernel, and this mode's base initramfs (modules, tools, kube-proxy,
# /init; uncompressed: gunzip under TCG is slow). Reruns pack the agent (the static musl release
# build scripts/build-images.sh makes for the image) with the inputs.
#
# Exit status: the scenario's (0 = every check passed), or 125 with one "IPVS-VM-KP FAILED: ..."
# line when the VM could not be prepared or booted. Needs root (apt-get for missing host tools).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${SWITCHYARD_IPVS_VM_CACHE:-$HOME/.cache/switchyard/ipvs-vm}
# The whole VM run's bound: kube-proxy and the agent under TCG take tens of seconds each; the
# scenario's own waits are bounded below this.
TIMEOUT=${SWITCHYARD_IPVS_VM_KP_TIMEOUT:-900}
MEM=${SWITCHYARD_IPVS_VM_KP_MEM:-1024}
PORT=${SWITCHYARD_VM_APISERVER_PORT:?the host apiserver port}
CFG=${SWITCHYARD_VM_CFG:?the directory of the guest configuration}
KUBE_PROXY=${SWITCHYARD_VM_KUBE_PROXY:?the kube-proxy binary}

t0=$(date +%s.%N)
log() { echo "[ipvs-vm-kp] $*" >&2; }
fail() {
  echo "IPVS-VM-KP FAILED: $*"
  exit 125
}
elapsed() { awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

mkdir -p "$cache"
[ -x "$KUBE_PROXY" ] || fail "no kube-proxy binary at $KUBE_PROXY"
file -b "$KUBE_PROXY" 2>/dev/null | grep -q 'statically linked' || ! command -v file >/dev/null ||
  fail "$KUBE_PROXY is not statically linked (build it with CGO_ENABLED=0)"

# --- host tools -------------------------------------------------------------------------------
need=()
for tool in qemu-system-x86_64:qemu-system-x86 depmod:kmod modprobe:kmod cpio:cpio ipvsadm:ipvsadm \
  ipset:ipset iptables-legacy:iptables ip:iproute2 strip:binutils python3:python3 socat:socat \
  musl-gcc:musl-tools; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool#*:}")
done
[ -x /bin/busybox ] && dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } >"$cache/apt-kp.log" 2>&1 ||
    fail "apt-get install ${need[*]} failed (see $cache/apt-kp.log)"
fi

# shellcheck source=ipvs-vm-kernel.sh
. "$repo/scripts/ipvs-vm-kernel.sh"

# --- this mode's base initramfs ---------------------------------------------------------------
# kube-proxy's IPVS mode: ip_vs, ipsets of its types, iptables (filter, nat, mangle for its
# canary; both families), the dummy link; virtio_net for the NIC.
modules="ip_vs ip_vs_rr veth dummy virtio_net virtio_pci ip_tables iptable_filter iptable_nat
  iptable_mangle ip6_tables ip6table_filter ip6table_nat ip6table_mangle xt_MASQUERADE xt_mark
  xt_comment xt_conntrack xt_addrtype xt_set xt_tcpudp xt_multiport xt_nat ipt_REJECT ip6t_REJECT
  ip_set ip_set_hash_ip ip_set_hash_ipport ip_set_hash_ipportip ip_set_hash_ipportnet ip_set_hash_net
  ip_set_bitmap_port nf_tables"
key=$( (cat "$0" "$repo/scripts/ipvs-vm-kube-proxy.init"; echo "$KVER $modules"; stat -c '%s %Y' "$KUBE_PROXY") |
  md5sum | cut -c1-12)
base=$cache/kp-base-$key.cpio
if [ ! -s "$base" ]; then
  log "building the kube-proxy VM base initramfs"
  rm -f "$cache"/kp-base-*.cpio
  stage=$(mktemp -d "$cache/kp-stage.XXXXXX")
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,run,tmp,var,cfg,lib/modules/$KVER}
  : >"$stage/modules.order"
  for m in $modules; do
    modprobe -d "$kroot" -S "$KVER" --show-depends "$m" 2>/dev/null | awk '$1 == "insmod" { print $2 }'
  done | awk '!seen[$0]++' | while read -r path; do
    rel=${path#"$kroot"}
    mkdir -p "$stage$(dirname "$rel")"
    cp "$path" "$stage$rel"
    echo "$rel" >>"$stage/modules.order"
  done
  [ -s "$stage/modules.order" ] || fail "no kernel modules resolved from $kroot"
  cp /bin/busybox "$stage/bin/busybox"
  multi=$(readlink -f "$(command -v iptables-legacy)")
  bins="$(command -v ip) $(command -v ipset) $(command -v ipvsadm) $multi"
  for b in $bins; do
    mkdir -p "$stage$(dirname "$b")"
    cp -L "$b" "$stage$b"
  done
  # kube-proxy runs plain `iptables*`/`ip6tables*`: the legacy variant, as iptables-wrapper picks
  # on a node without nft rules; the agent finds the same variant.
  for name in iptables ip6tables; do
    for suffix in "" -save -restore; do
      for n in "$name$suffix" "$name-legacy$suffix"; do
        ln -sf "$(basename "$multi")" "$stage$(dirname "$multi")/$n"
        [ "$(dirname "$multi")" = /usr/sbin ] || ln -sf "$multi" "$stage/usr/sbin/$n"
      done
    done
  done
  xtlib=/usr/lib/x86_64-linux-gnu/xtables
  mkdir -p "$stage$xtlib"
  cp -L "$xtlib"/*.so "$stage$xtlib/"
  for f in $bins "$xtlib"/*.so; do ldd "$f" 2>/dev/null; done |
    awk '/=> \// { print $3 } /^\t\// { print $1 }' | sort -u | while read -r lib; do
    mkdir -p "$stage$(dirname "$lib")"
    cp -L "$lib" "$stage$lib"
  done
  cp /etc/protocols /etc/services "$stage/etc/"
  printf 'protocols: files\nservices: files\nhosts: files\n' >"$stage/etc/nsswitch.conf"
  printf '127.0.0.1 localhost vm-node\n' >"$stage/etc/hosts"
  echo vm-node >"$stage/etc/hostname"
  cp "$KUBE_PROXY" "$stage/kube-proxy"
  cp "$repo/scripts/ipvs-vm-kube-proxy.init" "$stage/init"
  chmod +x "$stage/init"
  (cd "$stage" && find . | cpio -o -H newc --quiet) >"$base.tmp" && mv "$base.tmp" "$base"
  rm -rf "$stage"
  trap - EXIT
fi

# --- the static agent and swy-echo ------------------------------------------------------------
target=x86_64-unknown-linux-musl
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  rustup target add "$target" >/dev/null 2>&1 || fail "rustup target add $target failed"
fi
# The image's agent: exactly scripts/build-images.sh's cargo command, so after it (as in CI) this
# is a no-op. SWITCHYARD_VM_AGENT_BIN names another static build instead.
agent=${SWITCHYARD_VM_AGENT_BIN:-}
if [ -z "$agent" ]; then
  log "cargo build --release --target $target (the image's agent)"
  (cd "$repo" && CC_x86_64_unknown_linux_musl=musl-gcc cargo build --release --locked --target "$target" \
    -p switchyard-agent -p switchyard-operator --bin switchyard-agent --bin switchyard-operator) \
    >"$cache/build-kp.log" 2>&1 ||
    fail "cannot build the static agent (see $cache/build-kp.log: $(grep -m1 '^error' "$cache/build-kp.log" || true))"
  agent=${CARGO_TARGET_DIR:-$repo/target}/$target/release/switchyard-agent
fi
file -b "$agent" 2>/dev/null | grep -q 'static' || ! command -v file >/dev/null ||
  fail "$agent is not a static binary"
echo_bin=$cache/swy-echo
if [ ! -x "$echo_bin" ] || [ "$repo/tests/src/bin/swy-echo.rs" -nt "$echo_bin" ]; then
  rustc --edition 2024 --crate-name swy_echo -C opt-level=3 --target "$target" -o "$echo_bin.tmp" \
    "$repo/tests/src/bin/swy-echo.rs" 2>"$cache/build-echo.log" || fail "cannot build swy-echo (see $cache/build-echo.log)"
  mv "$echo_bin.tmp" "$echo_bin"
fi
run=$(mktemp -d "$cache/kp-run.XXXXXX")
trap 'rm -rf "$run"' EXIT
strip -o "$run/switchyard-agent" "$agent"
cp "$echo_bin" "$run/swy-echo"
mkdir -p "$run/cfg"
cp -r "$CFG"/. "$run/cfg/"
(cd "$run" && find switchyard-agent swy-echo cfg | cpio -o -H newc --quiet) >"$run/extra.cpio"
# The kernel only takes an archive that starts 4-byte aligned: pad with zeros.
{ cat "$base"; head -c $(( (4 - $(stat -c %s "$base") % 4) % 4 )) /dev/zero; cat "$run/extra.cpio"; } >"$run/initramfs.img"
log "prepared in $(elapsed) s (agent $(du -h "$run/switchyard-agent" | cut -f1), initramfs $(du -h "$run/initramfs.img" | cut -f1)); booting under qemu TCG"

# --- boot -------------------------------------------------------------------------------------
console=$cache/console-kp.log
boot0=$(date +%s.%N)
set +e
timeout --kill-after=5 "$TIMEOUT" qemu-system-x86_64 -nodefaults -no-user-config -machine pc \
  -accel tcg,tb-size=64 -cpu max -smp 1 -m "$MEM" -display none -serial stdio -no-reboot \
  -netdev "user,id=n0,restrict=on,net=10.250.0.0/24,host=10.250.0.2,dns=10.250.0.3,guestfwd=tcp:10.250.0.1:$PORT-cmd:socat - TCP:127.0.0.1:$PORT" \
  -device virtio-net-pci,netdev=n0,romfile= \
  -kernel "$kernel" -initrd "$run/initramfs.img" \
  -append "console=ttyS0 quiet panic=-1 mitigations=off" </dev/null 2>&1 |
  tr -d '\r' | tee "$console"
qrc=${PIPESTATUS[0]}
set -e
boot=$(awk -v a="$boot0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
rc=$( (grep -a -o 'VMTEST-DONE rc=[0-9]*' "$console" || true) | tail -1 | cut -d= -f2)
if [ -z "$rc" ]; then
  fail "the VM did not finish (qemu exit $qrc after ${boot} s, no VMTEST-DONE marker; console in $console)"
fi
echo "IPVS-VM-KP: scenario exit $rc; boot-to-poweroff ${boot} s, total $(elapsed) s"
exit "$rc"
