#!/usr/bin/env bash
# Makes .snap/ (git-ignored): the committed tree (git archive HEAD) plus a link to .device, so
# a device call runs exactly what is committed even while the working tree is being edited:
#   bash tools/device_snapshot.sh   then, with the device tool, carry [".device", ".snap"] and
#   cd .snap && bash tools/device_run.sh tests kernels ...
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qxF '/.snap/' .git/info/exclude 2>/dev/null || echo '/.snap/' >> .git/info/exclude
rm -rf .snap
mkdir .snap
git archive HEAD | tar -x -C .snap
ln -s ../.device .snap/.device
echo ".snap = $(git rev-parse --short HEAD) ($(du -sh .snap | cut -f1))"
