#!/usr/bin/env bash
# The IPVS VM tier: boots a pinned Debian kernel (which has ip_vs) under qemu with pure software
# emulation (TCG; the /dev/kvm here cannot boot a stock kernel, see shared/reference/ipvs-vm.md),
# with a tiny initramfs whose /init runs the agent's IPVS tests (backend::ipvs::tests::vm, a
# static test binary) against the real kernel, then powers off. The nftables modules are there
# for the mode-switch test (the agent's switch driver moving the node ipvs -> nftables -> ipvs
# under a client load), and with `sctp`, `xt_sctp`, `xt_nat` and `xt_statistic` the same binary runs
# the SCTP tests of the nftables and iptables backends (backend::sctp_vm_tests; the host kernel
# has no SCTP). The VM has no NIC: all traffic
# stays between network namespaces inside the guest.
#
# Cached under ~/.cache/switchyard/ipvs-vm (override: SWITCHYARD_IPVS_VM_CACHE): the kernel .deb
# and its extracted tree, the uncompressed vmlinux, and the base initramfs. Reruns only rebuild
# the test binary (cargo, incremental) and pack it.
#
# Exit status: the tests' (0 = all passed), or 125 with one "IPVS-VM FAILED: ..." line when the VM
# could not be prepared or booted. Needs root (apt-get for missing host tools).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${SWITCHYARD_IPVS_VM_CACHE:-$HOME/.cache/switchyard/ipvs-vm}
KVER=6.1.0-57-amd64
KPKG=linux-image-$KVER
KDEB_VERSION=6.1.192-3
# The whole VM run's bound, generous for a loaded machine (a hang bound, not a timing check): with
# other builds on 2 cores passing runs took 198 s and 242 s from boot to poweroff, and another was
# cut by the former 180 s bound; with the settings cases and five engineers building, a passing
# run took 512 s of the former 600 s bound.
TIMEOUT=${SWITCHYARD_IPVS_VM_TIMEOUT:-1200}
MEM=${SWITCHYARD_IPVS_VM_MEM:-512}
# libtest name filters, comma-separated (a test runs when its name contains any of them; only
# #[ignore]d tests run): the IPVS tests, the SCTP ones (nftables and iptables backends) and
# the runtime's strictARP sysctls.
FILTER=${SWITCHYARD_IPVS_VM_FILTER:-backend::ipvs::tests::vm::,backend::sctp_vm_tests::,runtime::sysctls::tests::vm_}

t0=$(date +%s.%N)
log() { echo "[ipvs-vm] $*" >&2; }
fail() {
  echo "IPVS-VM FAILED: $*"
  exit 125
}
elapsed() { awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

mkdir -p "$cache"

# --- host tools -------------------------------------------------------------------------------
need=()
for tool in qemu-system-x86_64:qemu-system-x86 depmod:kmod modprobe:kmod cpio:cpio ipvsadm:ipvsadm \
  ipset:ipset iptables-legacy:iptables ip:iproute2 strip:binutils python3:python3; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool#*:}")
done
[ -x /bin/busybox ] && dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } >"$cache/apt.log" 2>&1 ||
    fail "apt-get install ${need[*]} failed (see $cache/apt.log)"
fi

# --- kernel (pinned; the .deb is cached because old security builds leave the archive) --------
kroot=$cache/kroot
if [ ! -f "$kroot/boot/vmlinuz-$KVER" ] || [ ! -f "$kroot/lib/modules/$KVER/modules.dep" ]; then
  deb=$(ls "$cache/${KPKG}_${KDEB_VERSION}"_amd64.deb 2>/dev/null || true)
  if [ -z "$deb" ]; then
    log "apt-get download $KPKG=$KDEB_VERSION"
    (cd "$cache" && apt-get download "$KPKG=$KDEB_VERSION") >"$cache/download.log" 2>&1 ||
      (cd "$cache" && apt-get update -qq && apt-get download "$KPKG=$KDEB_VERSION") >>"$cache/download.log" 2>&1 ||
      fail "cannot download $KPKG $KDEB_VERSION (see $cache/download.log)"
    deb=$(ls "$cache/${KPKG}_${KDEB_VERSION}"_amd64.deb)
  fi
  rm -rf "$kroot"
  dpkg-deb -x "$deb" "$kroot" || fail "dpkg-deb -x $deb"
  depmod -b "$kroot" "$KVER" || fail "depmod"
fi
# The uncompressed vmlinux boots through qemu's PVH entry, skipping ~3.5 s of emulated xz.
vmlinux=$cache/vmlinux-$KVER
if [ ! -s "$vmlinux" ]; then
  python3 - "$kroot/boot/vmlinuz-$KVER" "$vmlinux" <<'EOF' || rm -f "$vmlinux"
import lzma, sys
data = open(sys.argv[1], "rb").read()
start = data.find(b"\xfd7zXZ\x00")
if start < 0:
    sys.exit(1)
out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[start:])
if out[:4] != b"\x7fELF":
    sys.exit(1)
open(sys.argv[2], "wb").write(out)
EOF
fi
kernel=$vmlinux
[ -s "$kernel" ] || kernel=$kroot/boot/vmlinuz-$KVER

# --- base initramfs (modules, busybox, ip, ipset, iptables-legacy, ipvsadm, /init) -------------
modules="ip_vs ip_vs_rr ip_vs_wrr ip_vs_lc ip_vs_wlc ip_vs_sh ip_vs_dh ip_vs_sed ip_vs_nq ip_vs_mh
  ip_vs_lblc ip_vs_lblcr ip_vs_fo ip_vs_ovf
  veth dummy ip_tables iptable_filter iptable_nat xt_MASQUERADE xt_mark xt_comment xt_conntrack
  xt_addrtype xt_set ipt_REJECT ip_set ip_set_hash_ip ip_set_hash_ipport ip_set_hash_ipportip
  ip_set_hash_ipportnet ip_set_bitmap_port nf_tables nft_chain_nat nft_nat nft_ct nft_masq nft_reject_ipv4
  nft_fib_ipv4 nft_numgen sctp xt_sctp xt_nat xt_statistic
  nft_fib_ipv6 nft_reject_ipv6 nft_reject_inet ip6_tables ip6table_filter ip6table_nat ip6t_REJECT"
key=$( (cat "$0"; echo "$KVER $modules") | md5sum | cut -c1-12)
base=$cache/base-$key.cpio.gz
if [ ! -s "$base" ]; then
  log "building the base initramfs"
  stage=$(mktemp -d "$cache/stage.XXXXXX")
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,run,tmp,var,lib/modules/$KVER}
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
  bins="$(command -v ip) $(command -v ipset) $(command -v ipvsadm) $(readlink -f "$(command -v iptables-legacy)")"
  for b in $bins; do
    mkdir -p "$stage$(dirname "$b")"
    cp -L "$b" "$stage$b"
  done
  multi=$(readlink -f "$(command -v iptables-legacy)")
  for name in iptables-legacy iptables-legacy-restore iptables-legacy-save \
    ip6tables-legacy ip6tables-legacy-restore ip6tables-legacy-save; do
    ln -sf "$(basename "$multi")" "$stage$(dirname "$multi")/$name"
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
  printf 'protocols: files\nservices: files\n' >"$stage/etc/nsswitch.conf"
  cat >"$stage/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs run /run
mount -t tmpfs tmp /tmp
mkdir -p /run/netns /var/lib
up() { cut -d' ' -f1 /proc/uptime; }
echo "VMTEST stage=init uptime=$(up)"
while read -r ko; do
  insmod "$ko" 2>/tmp/insmod.err || grep -qE 'No such device|File exists' /tmp/insmod.err ||
    echo "VMTEST insmod failed: $ko: $(cat /tmp/insmod.err)"
done </modules.order
echo "VMTEST stage=modules-loaded uptime=$(up)"
filter=$(sed -n 's/.*vmtest.filter=\([^ ]*\).*/\1/p' /proc/cmdline)
set -f
IFS=,
set -- $filter
unset IFS
set +f
SWITCHYARD_IPVS_VM=1 RUST_BACKTRACE=1 /payload --ignored --test-threads=1 --nocapture "$@"
rc=$?
echo "VMTEST mem $(grep MemAvailable /proc/meminfo)"
echo "VMTEST stage=done uptime=$(up)"
echo "VMTEST-DONE rc=$rc"
poweroff -f
EOF
  chmod +x "$stage/init"
  (cd "$stage" && find . | cpio -o -H newc --quiet | gzip -1) >"$base.tmp" && mv "$base.tmp" "$base"
  rm -rf "$stage"
  trap - EXIT
fi

# --- the static test binary -------------------------------------------------------------------
target=x86_64-unknown-linux-musl
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  rustup target add "$target" >/dev/null 2>&1 || true
fi
if ! command -v musl-gcc >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends musl-tools >/dev/null 2>&1 || true
fi
# Optimised (the benchmark measures the agent, not the debug build); a separate artifact set from
# the host's debug build because of the explicit --target.
export CARGO_PROFILE_DEV_OPT_LEVEL=${SWITCHYARD_IPVS_VM_OPT_LEVEL:-2}
build() {
  (cd "$repo" && cargo test -p switchyard-agent --lib --no-run --target "$1" --message-format=json 2>"$cache/build.log") |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable") \
            and m["target"]["name"] == "switchyard_agent" and "lib" in m["target"]["kind"]:
        print(m["executable"])'
}
exe=""
if rustup target list --installed 2>/dev/null | grep -qx "$target" && command -v musl-gcc >/dev/null 2>&1; then
  exe=$(CC_x86_64_unknown_linux_musl=musl-gcc build "$target" | tail -1) || true
fi
if [ -z "$exe" ]; then
  log "musl build unavailable; glibc +crt-static fallback"
  target=x86_64-unknown-linux-gnu
  exe=$(RUSTFLAGS="-C target-feature=+crt-static" build "$target" | tail -1) || true
fi
[ -n "$exe" ] && [ -x "$exe" ] || fail "cannot build the static test binary (see $cache/build.log: $(grep -m1 '^error' "$cache/build.log" || true))"
payload=$cache/payload
mkdir -p "$payload"
strip -o "$payload/payload" "$exe"
(cd "$payload" && echo payload | cpio -o -H newc --quiet) >"$cache/payload.cpio"
# The kernel only takes an uncompressed archive that starts 4-byte aligned: pad with zeros.
{ cat "$base"; head -c $(( (4 - $(stat -c %s "$base") % 4) % 4 )) /dev/zero; cat "$cache/payload.cpio"; } >"$cache/initramfs.img"
log "prepared in $(elapsed) s ($target test binary $(du -h "$payload/payload" | cut -f1)); booting $(basename "$kernel") under qemu TCG"

# --- boot -------------------------------------------------------------------------------------
console=$cache/console.log
boot0=$(date +%s.%N)
set +e
timeout --kill-after=5 "$TIMEOUT" qemu-system-x86_64 -nodefaults -no-user-config -machine pc \
  -accel tcg,tb-size=64 -cpu max -smp 1 -m "$MEM" -display none -serial stdio -no-reboot -net none \
  -kernel "$kernel" -initrd "$cache/initramfs.img" \
  -append "console=ttyS0 quiet panic=-1 mitigations=off vmtest.filter=$FILTER" </dev/null 2>&1 |
  tr -d '\r' | tee "$console"
qrc=${PIPESTATUS[0]}
set -e
boot=$(awk -v a="$boot0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
rc=$( (grep -a -o 'VMTEST-DONE rc=[0-9]*' "$console" || true) | tail -1 | cut -d= -f2)
if [ -z "$rc" ]; then
  fail "the VM did not finish (qemu exit $qrc after ${boot} s, no VMTEST-DONE marker; console in $console)"
fi
summary=$( (grep -a -E '^test result:' "$console" || true) | tail -1)
echo "IPVS-VM: tests exit $rc; ${summary:-no test summary}; boot-to-poweroff ${boot} s, total $(elapsed) s"
exit "$rc"
