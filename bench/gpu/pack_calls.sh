#!/usr/bin/env bash
# Split a bundle (../shared/gpu/v0_3x/build_bundle.sh OUT) into the two carried folders
# of the two install calls, each under the 64 MiB a device call carries together with
# the repo's own files (tracked + untracked, not ignored):
#   bash bench/gpu/pack_calls.sh BUNDLE_DIR [OVERLAY_DIR]
# -> .gpu-b1/ (install_remote.sh, SHA256SUMS, VLLM_VERSION, the first bytes as aa1) and
#    .gpu-b2/ (the rest as aa2, part_ab); the overlay (make_overlay.py) rides in call 2.
# On the device:  call 1 (carry .gpu-b1): mkdir -p /tmp/vbparts && cp .gpu-b1/* /tmp/vbparts/
#                 call 2 (carry .gpu-b2 and the overlay): bash bench/gpu/device_install_and_run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=${1:?usage: pack_calls.sh BUNDLE_DIR [OVERLAY_DIR]}
overlay=${2:-}
limit=$((64 * 1024 * 1024 - 512 * 1024))   # a little headroom
repo=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1 || true)  # deleted tracked files: du complains, the sum holds
ov=0; [ -n "$overlay" ] && ov=$(du -sb "$overlay" | cut -f1)
for f in part_aa part_ab SHA256SUMS VLLM_VERSION install_remote.sh; do
  [ -f "$bundle/$f" ] || { echo "pack_calls: $bundle/$f missing" >&2; exit 2; }
done
aa=$(stat -c %s "$bundle/part_aa"); ab=$(stat -c %s "$bundle/part_ab")
first=$((limit - repo - 64 * 1024))
rest=$((aa - first))
if [ $((rest + ab + ov + repo)) -gt "$limit" ]; then
  echo "pack_calls: does not fit in two calls (repo $repo B, overlay $ov B)" >&2; exit 2
fi
rm -rf .gpu-b1 .gpu-b2 && mkdir .gpu-b1 .gpu-b2
cp "$bundle"/{install_remote.sh,SHA256SUMS,VLLM_VERSION} .gpu-b1/
head -c "$first" "$bundle/part_aa" > .gpu-b1/aa1
tail -c +"$((first + 1))" "$bundle/part_aa" > .gpu-b2/aa2
cp "$bundle/part_ab" .gpu-b2/
cat .gpu-b1/aa1 .gpu-b2/aa2 | cmp -s - "$bundle/part_aa" || { echo "pack_calls: split mismatch" >&2; exit 1; }
du -sh .gpu-b1 .gpu-b2
