#!/usr/bin/env bash
# Export a git revision's build inputs into .ab/base (git-ignored), the "base" side of a same-machine A/B:
#
#   scripts/ab-base.sh HEAD~1            # here, before the device call
#   scripts/device-run.sh --ab .ab/base -b exl3_moe -B "--ts 1,4 --ks 2"   # there; carry [".ab"]
#
#   scripts/ab-base.sh HEAD views /tmp/views.patch   # .ab/views: HEAD with a patch applied (a third side:
#   scripts/device-run.sh --ab ".ab/base .ab/views" ...   # every tree is built and timed in the same call)
#
# device-run.sh then builds both trees in the same call and runs each benchmark on both, alternating, so the
# comparison does not depend on which machine or clock state a call got (METHOD.md: compare within one run).
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: scripts/ab-base.sh REV [NAME [PATCH]] (a commit, branch or tag to compare the working tree against)}"
name="${2:-base}" patch="${3:-}"
if [[ ! "$name" =~ ^[A-Za-z0-9_-]+$ ]] || [ "$name" = new ]; then
  echo "ab-base.sh: NAME '$name' must be letters, digits, _ or - and not 'new' (it names .ab/NAME and the bench log" \
    "sections; 'new' is the working tree's)." >&2
  exit 2
fi
if [ -n "$patch" ] && [ ! -f "$patch" ]; then
  echo "ab-base.sh: patch '$patch' is not a file; give a 'git diff' output to apply on top of $rev." >&2
  exit 2
fi
if ! git rev-parse --verify --quiet "$rev^{commit}" >/dev/null; then
  echo "ab-base.sh: '$rev' is not a commit in this repository; give a commit, branch or tag (git log --oneline)." >&2
  exit 2
fi
tmp=".ab/$name.tmp.$$"
rm -rf "$tmp" && mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
git archive "$rev" CMakeLists.txt pyproject.toml README.md cuda python bench | tar -x -C "$tmp"
rm -rf "$tmp/bench/results"  # logs and plots: not build inputs, and they count towards the 64 MiB a call carries
desc=$(git rev-parse --short "$rev")
if [ -n "$patch" ]; then
  git apply --directory="$tmp" "$patch" || { echo "ab-base.sh: $patch does not apply on $rev." >&2; exit 2; }
  desc="$desc+$(basename "$patch")"
fi
echo "$desc" > "$tmp/AB_REV"
rm -rf ".ab/$name" && mv "$tmp" ".ab/$name"
trap - EXIT
echo "ab-base.sh: .ab/$name holds $desc ($(du -sh ".ab/$name" | cut -f1)); name \".ab\" in the device call's carry"
