#!/usr/bin/env bash
# Export a git revision's build inputs into .ab/base (git-ignored), the "base" side of a same-machine A/B:
#
#   scripts/ab-base.sh HEAD~1            # here, before the device call
#   scripts/device-run.sh --ab .ab/base -b exl3_moe -B "--ts 1,4 --ks 2"   # there; carry [".ab"]
#
# device-run.sh then builds both trees in the same call and runs each benchmark on both, alternating, so the
# comparison does not depend on which machine or clock state a call got (METHOD.md: compare within one run).
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: scripts/ab-base.sh REV (a commit, branch or tag to compare the working tree against)}"
if ! git rev-parse --verify --quiet "$rev^{commit}" >/dev/null; then
  echo "ab-base.sh: '$rev' is not a commit in this repository; give a commit, branch or tag (git log --oneline)." >&2
  exit 2
fi
tmp=".ab/base.tmp.$$"
rm -rf "$tmp" && mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
git archive "$rev" CMakeLists.txt pyproject.toml README.md cuda python bench | tar -x -C "$tmp"
rm -rf "$tmp/bench/results"  # logs and plots: not build inputs, and they count towards the 64 MiB a call carries
git rev-parse --short "$rev" > "$tmp/AB_REV"
rm -rf .ab/base && mv "$tmp" .ab/base
trap - EXIT
echo "ab-base.sh: .ab/base holds $(cat .ab/base/AB_REV) ($(du -sh .ab/base | cut -f1)); name \".ab\" in the device call's carry"
