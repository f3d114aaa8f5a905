#!/usr/bin/env bash
# AReaL's own StalenessManager tests (tests/test_staleness_manager.py), run unchanged against
# stalebound.runtime.StalenessManager — and, as a control, against AReaL's class from the same
# release — through a shim package `areal` whose areal.infra.staleness_manager re-exports the class.
#
# Everything happens in a temporary directory that is removed on exit; nothing of AReaL's is kept.
#   AREAL_VERSION  the release (default 1.0.4): its sdist is fetched from PyPI for AReaL's class
#   AREAL_TESTS    AReaL's test file, or a checkout of AReaL holding tests/test_staleness_manager.py;
#                  by default taken from the sdist if it ships it, else from the release's git tag;
#                  where neither can be had, the script says SKIPPED and exits 0
#   AREAL_REPEAT   runs of TestThreadSafety::test_concurrent_mixed_operations (default 200), all
#                  under sys.setswitchinterval(1e-6) so that the threads interleave finely
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-$PWD/.venv/bin/python}"
VERSION="${AREAL_VERSION:-1.0.4}"
REPEAT="${AREAL_REPEAT:-200}"
TEST=tests/test_staleness_manager.py
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The sdist, verified against the digest PyPI publishes for it.
"$PY" - "$VERSION" "$work/areal.tar.gz" <<'EOF'
import hashlib, json, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
name = f"areal-{version}.tar.gz"
index = urllib.request.Request(  # PyPI's simple index, as pip reads it (PEP 691)
    "https://pypi.org/simple/areal/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
)
with urllib.request.urlopen(index, timeout=60) as r:
    files = [f for f in json.load(r)["files"] if f["filename"] == name]
if not files:
    sys.exit(f"AREAL_VERSION={version}: PyPI has no {name}; pick a release with an sdist")
with urllib.request.urlopen(files[0]["url"], timeout=120) as r:
    data = r.read()
if hashlib.sha256(data).hexdigest() != files[0]["hashes"]["sha256"]:
    sys.exit(f"areal {version}: the downloaded sdist does not match PyPI's sha256; try again")
open(out, "wb").write(data)
EOF
top="areal-$VERSION"
tar -xzf "$work/areal.tar.gz" -C "$work" "$top/areal/infra/staleness_manager.py"

mkdir -p "$work/tests"
if [[ -n "${AREAL_TESTS:-}" ]]; then
  src="$AREAL_TESTS"
  [[ -d "$src" ]] && src="$src/$TEST"
  [[ -f "$src" ]] || { echo "AREAL_TESTS=$AREAL_TESTS: no such file (nor a directory holding $TEST)" >&2; exit 2; }
  cp "$src" "$work/$TEST"
elif tar -tzf "$work/areal.tar.gz" "$top/$TEST" >/dev/null 2>&1; then
  tar -xzf "$work/areal.tar.gz" -C "$work" "$top/$TEST" && mv "$work/$top/$TEST" "$work/$TEST"
else
  url="https://raw.githubusercontent.com/inclusionAI/AReaL/v$VERSION/$TEST"
  fetch='import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=30) as r:
    open(sys.argv[2], "wb").write(r.read())'
  "$PY" -c "$fetch" "$url" "$work/$TEST" 2>/dev/null || {
    # Not a failure of ours: the file is not to be had from here (no route to GitHub). Said
    # plainly, so a run without it is never mistaken for a pass.
    echo "SKIPPED: AReaL's $TEST was not run: areal $VERSION's sdist does not ship it and" \
      "$url could not be fetched; set AREAL_TESTS to the file or to a checkout of AReaL $VERSION"
    exit 0
  }
fi

# Fine interleaving and the repetitions, without touching the test file.
cat >"$work/tests/conftest.py" <<EOF
import sys

import pytest

sys.setswitchinterval(1e-6)


@pytest.fixture
def _repetition(request):
    return request.param


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_concurrent_mixed_operations" and $REPEAT > 1:
        metafunc.fixturenames.append("_repetition")
        metafunc.parametrize("_repetition", range($REPEAT), indirect=True)
EOF

# Two shim packages named areal: ours re-exports stalebound's class; the control holds AReaL's.
for kind in ours areal; do
  mkdir -p "$work/$kind/areal/infra" "$work/$kind/areal/api"
  touch "$work/$kind/areal/__init__.py" "$work/$kind/areal/infra/__init__.py"
  echo "from stalebound.core import RolloutStat  # AReaL's fields, in AReaL's order" \
    >"$work/$kind/areal/api/__init__.py"
done
cat >"$work/ours/areal/infra/staleness_manager.py" <<'EOF'
from stalebound.runtime.staleness_manager import RolloutStat, StalenessManager, VersionProvider

__all__ = ["RolloutStat", "StalenessManager", "VersionProvider"]
EOF
cp "$work/$top/areal/infra/staleness_manager.py" "$work/areal/areal/infra/staleness_manager.py"

status=0
for kind in areal ours; do
  label="stalebound's StalenessManager"
  [[ "$kind" == areal ]] && label="AReaL $VERSION's own StalenessManager (control)"
  echo "== $TEST of AReaL $VERSION against $label; test_concurrent_mixed_operations × $REPEAT"
  (cd "$work" && PYTHONPATH="$work/$kind" "$PY" -m pytest -q -p no:cacheprovider \
    -c /dev/null --rootdir "$work" "$TEST") || status=1
done
exit "$status"
