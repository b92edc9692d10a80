# Sourced by the IPVS VM scripts: the pinned Debian kernel (which has ip_vs and the netfilter
# modules as modules), fetched once into the shared cache ($cache, set by the caller) exactly as
# scripts/ipvs-vm.sh lays it out, so either script reuses what the other fetched. Needs `fail`
# and `log` from the caller. Sets KVER, kroot and kernel (the uncompressed vmlinux when it could
# be extracted: PVH boot skips ~3.5 s of emulated xz; the bzImage otherwise).
KVER=6.1.0-57-amd64
KPKG=linux-image-$KVER
KDEB_VERSION=6.1.192-3

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
