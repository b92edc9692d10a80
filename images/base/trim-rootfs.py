#!/usr/bin/env python3
# Copyright The Switchyard Authors. SPDX-License-Identifier: Apache-2.0
"""Cuts a root file system extracted by mmdebstrap down to an allow-list.

Usage: trim-rootfs.py ROOT RECIPE
ROOT is what `mmdebstrap --variant=extract --skip=cleanup/apt/cache` left in a directory (the
.debs still in its apt cache, so the shipped packages can be listed); run after mmdebstrap.

RECIPE lines (see agent.conf):
  package NAME   extracted by mmdebstrap (read by scripts/build-images.sh, ignored here)
  keep GLOB      a path inside ROOT to keep; symlinks are followed inside ROOT and every hop is kept;
                 ELF files pull in the shared libraries `ld.so --list` loads for them (chroot)
  post COMMAND   run in ROOT (chroot) after the cut, before the checks
  check COMMAND  run in ROOT (chroot) at the end; the build fails unless it exits 0

Kept as well: /usr/share/doc/<package>/copyright of every extracted package (licences of what the
image redistributes), and /usr/share/doc/switchyard-base/packages, the name and version of each.
Everything else is deleted (documentation, man pages, locales, gconv, debconf, perl, dpkg's
database, apt's cache and lists, libraries nothing kept loads). /dev, /proc and /sys are left
alone (the archive leaves /dev out); /tmp and /var/tmp stay as empty sticky directories; /run, /dev, /proc
and /sys exist, empty.
"""

import glob
import os
import shlex
import subprocess
import sys
import urllib.parse

ROOT, RECIPE = sys.argv[1], sys.argv[2]
# Not pruned here (scripts/build-images.sh leaves their contents out of the archive).
SKIP = {"dev", "proc", "sys"}
MOUNT_POINTS = SKIP | {"tmp", "run", "var/tmp"}


def recipe(kind):
    out = []
    with open(RECIPE, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith(kind + " "):
                out.append(line[len(kind) + 1 :].strip())
    return out


def hops(path):
    """Root-relative paths visited while resolving absolute `path` inside ROOT (each symlink, then
    the final target)."""
    visited = []
    parts = [p for p in path.split("/") if p]
    cur = ""
    for _ in range(256):
        if not parts:
            break
        p = parts.pop(0)
        if p == ".":
            continue
        if p == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = f"{cur}/{p}" if cur else p
        full = os.path.join(ROOT, nxt)
        if os.path.islink(full):
            visited.append(nxt)
            target = os.readlink(full)
            if target.startswith("/"):
                cur = ""
            parts = [t for t in target.split("/") if t] + parts
        else:
            cur = nxt
    else:
        sys.exit(f"trim-rootfs: symlink loop resolving {path}")
    visited.append(cur)
    return visited


def is_elf(rel):
    full = os.path.join(ROOT, rel)
    if not os.path.isfile(full) or os.path.islink(full):
        return False
    with open(full, "rb") as f:
        return f.read(4) == b"\x7fELF"


def libraries(rel):
    """Absolute in-root paths of what the dynamic loader of ROOT loads for `rel` (none if static)."""
    loader = "/lib64/ld-linux-x86-64.so.2"
    if not os.path.lexists(os.path.join(ROOT, loader.lstrip("/"))):
        return []
    out = subprocess.run(
        ["chroot", ROOT, loader, "--list", "/" + rel], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        if "not a dynamic executable" in (out.stdout + out.stderr):
            return []
        sys.exit(f"trim-rootfs: ld.so --list /{rel}: {out.stderr.strip() or out.stdout.strip()}")
    libs = []
    for line in out.stdout.splitlines():
        line = line.strip()
        if "not found" in line:
            sys.exit(f"trim-rootfs: /{rel}: {line}")
        path = line.split("=>")[-1].strip().split(" (")[0].strip()
        if path.startswith("/"):
            libs.append(path)
    return libs


keep = set()
todo = []
for pattern in recipe("keep"):
    matches = glob.glob(os.path.join(ROOT, pattern.lstrip("/")))
    if not matches:
        sys.exit(f"trim-rootfs: keep {pattern}: nothing matches")
    todo += ["/" + os.path.relpath(m, ROOT) for m in matches]

# Packages: the downloaded .debs (--skip=cleanup/apt/cache).
debs = sorted(glob.glob(os.path.join(ROOT, "var/cache/apt/archives/*.deb")))
if not debs:
    sys.exit("trim-rootfs: no .deb in var/cache/apt/archives: cannot list the packages")


def merged(path):
    """A package's path as it lies in a merged-/usr root."""
    path = path.lstrip("./")
    first, _, rest = path.partition("/")
    return f"usr/{first}/{rest}".rstrip("/") if first in ("bin", "sbin", "lib", "lib64") else path.rstrip("/")


contents = {}
for deb in debs:
    name, version, _arch = urllib.parse.unquote(os.path.basename(deb)[: -len(".deb")]).split("_")
    listing = subprocess.run(
        f"dpkg-deb --fsys-tarfile '{deb}' | tar -t", shell=True, capture_output=True, text=True, check=True
    ).stdout
    # Files and symlinks only: every package has directories (usr, usr/share/doc) that are kept.
    contents[(name, version)] = {merged(p) for p in listing.splitlines() if not p.endswith("/")}

seen = set()
while todo:
    path = todo.pop()
    if path in seen:
        continue
    seen.add(path)
    for rel in hops(path):
        keep.add(rel)
        if is_elf(rel):
            todo += libraries(rel)

# The packages that still have a file here, with their copyright files.
shipped = [pkg for pkg, files in contents.items() if files & keep]
for name, _ in shipped:
    for rel in hops(f"/usr/share/doc/{name}/copyright"):
        if os.path.lexists(os.path.join(ROOT, rel)):
            keep.add(rel)

# Delete bottom-up whatever is not kept (directories survive when something below is kept).
kept_dirs = {os.path.dirname(k) for k in keep}
for k in list(kept_dirs):
    while k:
        k = os.path.dirname(k)
        kept_dirs.add(k)
removed = 0
for dirpath, dirnames, filenames in os.walk(ROOT, topdown=False):
    rel_dir = os.path.relpath(dirpath, ROOT)
    rel_dir = "" if rel_dir == "." else rel_dir
    if rel_dir.split("/")[0] in SKIP:
        continue
    for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
        rel = f"{rel_dir}/{name}" if rel_dir else name
        if rel not in keep:
            os.unlink(os.path.join(dirpath, name))
            removed += 1
    for name in dirnames:
        full = os.path.join(dirpath, name)
        rel = f"{rel_dir}/{name}" if rel_dir else name
        if not os.path.lexists(full) or os.path.islink(full) or rel in keep or rel in kept_dirs or rel in MOUNT_POINTS:
            continue
        if not os.listdir(full):
            os.rmdir(full)

doc = os.path.join(ROOT, "usr/share/doc/switchyard-base")
os.makedirs(doc, exist_ok=True)
with open(os.path.join(doc, "packages"), "w", encoding="utf-8") as f:
    f.write("# The Debian 12 packages files of this root come from\n")
    for name, version in shipped:
        f.write(f"{name} {version}\n")
for d in ("tmp", "var/tmp"):
    os.makedirs(os.path.join(ROOT, d), exist_ok=True)
    os.chmod(os.path.join(ROOT, d), 0o1777)
# /run: iptables-legacy opens /run/xtables.lock (the chart mounts the host's there). /dev, /proc and
# /sys: empty mount points for the runtime (the archive holds no device nodes).
for d in ("run", "dev", "proc", "sys"):
    os.makedirs(os.path.join(ROOT, d), exist_ok=True)
# No ld.so.cache: Debian's loader searches /usr/lib/x86_64-linux-gnu by default (the checks below
# run without one), and the xtables extensions are opened by full path.

for command in recipe("post"):
    subprocess.run(["chroot", ROOT] + shlex.split(command), check=True, stdout=subprocess.DEVNULL)
for command in recipe("check"):
    out = subprocess.run(["chroot", ROOT] + shlex.split(command), capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"trim-rootfs: check `{command}` failed ({out.returncode}): {out.stderr.strip()}")
print(f"trim-rootfs: kept {len(keep)} paths of {len(shipped)} of {len(contents)} packages, removed {removed}")
