#!/usr/bin/env bash
# The carried vLLM 0.26.0 bundle made ready for a campaign's serve steps, on the lent H200: the `vllm-site`
# script step of the serve plans (the runner itself carries nothing).
#
# The bundle (shared/device/vllm/build-carry.sh) travels in parts, one per device call, each within a call's
# 64 MiB with the working tree; every call that carries one copies it out of the tree, which the next call
# deletes, to /var/tmp/vl, which persists while the machine stays warm:
#     carry [".vllm-carry/vllm026-site.tgz.part-00"]   command: mkdir -p /var/tmp/vl && cp .vllm-carry/*.part-* /var/tmp/vl/
# The campaign's call carries the last part with .vllm-carry/SHA256SUMS and .whl. This step copies what the
# call carried, checks every part and the whole archive against SHA256SUMS, unpacks it once into
# /var/tmp/vl/site, and makes tunekit's vLLM plugin visible there through a two-file dist-info (the code still
# loads from the checkout). With .vllm-carry/serve-wheels carried (benchmarks/serve_wheels.txt: what
# `vllm serve` needs beyond the bundle) it installs those into /var/tmp/vl/serve-site. The serve steps put
# /var/tmp/vl/serve-site:/var/tmp/vl/site on PYTHONPATH.
set -euo pipefail
vl=${VLLM_CARRY_DIR:-/var/tmp/vl}
mkdir -p "$vl"
cp .vllm-carry/*.part-* .vllm-carry/SHA256SUMS "$vl/" 2>/dev/null || true
if [ ! -d "$vl/site/vllm" ]; then
  if ! (cd "$vl" && sha256sum -c --ignore-missing SHA256SUMS >/dev/null &&
        test "$(cat ./*.part-* | sha256sum | cut -c1-64)" = "$(grep ' vllm026-site.tgz$' SHA256SUMS | cut -c1-64)"); then
    echo "vllm-site: the bundle's parts in $vl are incomplete or do not match SHA256SUMS; carry the missing" \
      "parts first (one per call)" >&2
    ls -l "$vl" >&2
    exit 1
  fi
  rm -rf "$vl/site" "$vl/site.tmp"
  mkdir -p "$vl/site.tmp"
  cat "$vl"/*.part-* | tar -xzf - -C "$vl/site.tmp"
  mv "$vl/site.tmp" "$vl/site"
fi
d=$vl/site/tunekit-0.1.0.dist-info
mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: tunekit\nVersion: 0.1.0\n' >"$d/METADATA"
printf '[vllm.general_plugins]\ntunekit = tunekit.integrations.vllm.plugin:register\n' >"$d/entry_points.txt"
if compgen -G ".vllm-carry/serve-wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$vl/serve-site" \
    .vllm-carry/serve-wheels/*.whl
fi
PYTHONPATH=$vl/site:${PYTHONPATH:-} python3 -c "import vllm; print('vllm-site: vllm', vllm.__version__, 'in $vl/site')"
