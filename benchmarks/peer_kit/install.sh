#!/usr/bin/env bash
# On the GPU machine: stash the kit parts this call carried, and once all have arrived, check them
# (SHA256SUMS), unpack and install into /var/tmp/peers (kept while the machine stays warm).
#   bash benchmarks/peer_kit/install.sh [KIT]     (KIT: the carried folder, default .peer-kit)
# Then: export PYTHONPATH=/var/tmp/peers:$(cat /var/tmp/peers/.pth-paths):$PYTHONPATH. Exit 0 installed, 1 parts still missing, 2 error.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
KIT=${1:-.peer-kit}
STASH=${PEER_STASH:-/var/tmp/peer-kit}
TARGET=${PEER_TARGET:-/var/tmp/peers}
mkdir -p "$STASH"
[[ -d "$KIT" ]] && cp -f "$KIT"/* "$STASH"/ 2>/dev/null
python3 "$HERE/kit.py" missing "$STASH" || exit 1
if [[ -f "$TARGET/.installed" ]]; then echo "peers already installed in $TARGET"; exit 0; fi
rm -rf "$STASH/tree" && python3 "$HERE/kit.py" unpack "$STASH" "$STASH/tree" || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$TARGET" \
  "$STASH"/tree/wheels/*.whl || exit 2
cp -r "$STASH/tree/site/." "$TARGET/" && touch "$TARGET/.installed"
# --target installs do not run .pth files (the CuTe DSL puts its packages on the path with one): list the
# folders they name, for PYTHONPATH
python3 - "$TARGET" > "$TARGET/.pth-paths" <<'PYEOF'
import sys
from pathlib import Path
target = Path(sys.argv[1])
sys.path.insert(0, str(target))
before = list(sys.path)
for pth in sorted(target.glob("*.pth")):
    for line in pth.read_text().splitlines():
        line = line.strip()
        if line.startswith("import"):
            exec(line)  # what site.py does with such a line
        elif line and not line.startswith("#"):
            sys.path.append(str(target / line))
print(":".join(p for p in sys.path if p not in before))
PYEOF
echo "peers installed in $TARGET"
