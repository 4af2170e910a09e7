#!/usr/bin/env bash
# The GPU stack's lines of the base image's pip constraints, on stdout.
#
#   bash docker/constraints.sh [CONSTRAINTS] > gpu-stack.txt
#
# NGC PyTorch (25.03 and later) pins every Python package it ships in a constraint file that pip
# applies to every install (CONSTRAINTS defaults to $PIP_CONSTRAINT, else
# /etc/pip/constraint.txt). Installing docker/requirements.txt under all of it fails wherever one
# of its pins, or a dependency of one (transformers wants newer click, regex, huggingface-hub than
# an image may hold), differs from the base image's version. With this file as PIP_CONSTRAINT the
# base image's builds of torch and its kin, their CUDA libraries, numpy, Transformer Engine, apex
# and flash-attn stay as they are, and pip resolves everything else from the requirements.
# No constraint file: nothing to print.
set -euo pipefail
constraints=${1:-${PIP_CONSTRAINT:-/etc/pip/constraint.txt}}
[ -f "$constraints" ] || exit 0
# names compared as pip does: case aside, runs of -, _ and . alike
sep='[-_.]+'
stack="torch|torch${sep}[a-z0-9._-]+|torch(vision|audio|data|ao)|triton|pytorch${sep}triton"
stack+="|numpy|nvidia${sep}[a-z0-9._-]+|cuda${sep}[a-z0-9._-]+|cupy[a-z0-9._-]*"
stack+="|transformer${sep}engine[a-z0-9._-]*|apex|flash${sep}attn[a-z0-9._-]*|nvfuser[a-z0-9._-]*"
stack+="|tensorrt[a-z0-9._-]*"
grep -i -E "^[[:space:]]*(${stack})[[:space:]]*(==|===|<|>|~=|!=|@|;|\[)" "$constraints" || true
