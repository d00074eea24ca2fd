#!/usr/bin/env bash
# Create .venv-peers: a benchmark-only environment holding the checkpointing systems that
# `unickpt bench` compares against. unickpt itself never depends on any of them.
#
# The environment reuses the interpreter's torch (--system-site-packages) and installs each peer
# with --no-deps, then its runtime needs, so that no other torch build is ever downloaded.
#
#   bash benchmarks/setup_peers.sh            # creates ./.venv-peers
#   VENV=/somewhere/else bash benchmarks/setup_peers.sh
#   unickpt bench --peers-python .venv-peers/bin/python
set -euo pipefail

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv-peers}"

TORCH_VERSION="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
echo "reusing torch ${TORCH_VERSION} from ${PYTHON}"

"$PYTHON" -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

# The peers, without their declared dependencies (bytecheckpoint pins torch<=2.5.0).
"${PIP[@]}" --no-deps \
    "bytecheckpoint==0.0.2" \
    "dlrover==0.6.1" \
    "megatron-core==0.16.1" \
    "torchsnapshot==0.1.0"

# Their runtime needs, and unickpt's (the benchmark jobs import it); torch is pinned to the
# version already installed.
"${PIP[@]}" \
    "torch==${TORCH_VERSION}" \
    -e "$(dirname "$0")/.." \
    cachetools "grpcio==1.69.0" "mmh3>=4.1.0,<=4.2.0" "protobuf==3.20.3" universal-pathlib \
    safetensors \
    deprecated psutil pynvml \
    aiofiles aiohttp importlib-metadata nest-asyncio

# DCP through fsspec/s3fs for `unickpt bench --storage s3://...`: s3fs's aiobotocore pins its
# own botocore, which may differ from the main environment's (boto3 of unickpt's s3 extra).
"${PIP[@]}" "torch==${TORCH_VERSION}" s3fs

"$VENV/bin/python" - <<'PY'
import importlib

for name in ("bytecheckpoint", "dlrover", "megatron.core.dist_checkpointing", "torchsnapshot", "s3fs"):
    try:
        importlib.import_module(name)
        print(f"ok        {name}")
    except Exception as exc:  # report and go on: each peer is optional
        print(f"missing   {name}: {exc}")
PY
echo "peers environment ready: $VENV/bin/python"
