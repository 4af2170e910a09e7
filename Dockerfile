# megatron-gspo on GPUs: NGC PyTorch (CUDA, NCCL, cuDNN), Transformer Engine, apex (built from
# source), megatron-core and this project for the trainer; SGLang in its own virtual environment
# for the rollout servers (it pins its own torch build, which must not replace the image's).
#
#   docker build -t megatron-gspo:0.1 .
#   docker run --gpus 1 --rm megatron-gspo:0.1 bash docker/smoke.sh   # checks the built image
#   enroot import dockerd://megatron-gspo:0.1      # a .sqsh for launch/submit.sh --container-image
#
# Pins (tests/test_image_pins.py checks them against the installed megatron-core and the client):
# - NGC PyTorch 25.11 (torch 2.10, CUDA 13.0, Python 3.12) is megatron-core 0.16.1's own CI base and
#   ships Transformer Engine 2.9.0, inside megatron-core's declared transformer-engine>=2.9,<2.12:
#   it is kept, not reinstalled; the build fails if the base image's TE is outside TE_VERSION's
#   major.minor.
# - apex at a commit that builds on CUDA 13 (the compute_70 flags of earlier commits do not).
# - SGLang 0.5.15.post1: the version the client (rollout/sglang/facade.py) targets; it has every
#   endpoint and field the client uses, return_routed_experts included (0.5.6 has none of the
#   routed-experts support; 0.5.21+ require /begin_weight_update before weight updates).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

ARG TE_VERSION=2.9.0
ARG APEX_COMMIT=26bba57d62553d268319b4a20cc3d8aa990249ec
ARG SGLANG_VERSION=0.5.15.post1
ARG SGLANG_ROUTER_VERSION=0.3.2
ARG MAX_JOBS=16

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    MG_SGLANG_PYTHON=/opt/sglang/bin/python

# Transformer Engine: the base image's own build, checked against the pin (metadata only: no GPU
# is visible while building).
RUN python -c "import importlib.metadata as m; v = m.version('transformer_engine'); \
assert v.split('+')[0].rsplit('.', 1)[0] == '${TE_VERSION}'.rsplit('.', 1)[0], \
f'base image has transformer_engine {v}, the image pins ${TE_VERSION}'; print('TE', v)"

# apex from source with its C++/CUDA extensions (fused kernels Megatron uses when present).
WORKDIR /opt/apex
RUN git clone https://github.com/NVIDIA/apex.git . \
    && git checkout "${APEX_COMMIT}" \
    && MAX_JOBS="${MAX_JOBS}" pip install --no-cache-dir --no-build-isolation \
       --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" . \
    && rm -rf /opt/apex/.git

# SGLang for the rollout servers (launch/sglang_server.sh runs $MG_SGLANG_PYTHON), in its own venv:
# it pins its own torch (2.11, CUDA 13), which the NGC constraint file must not apply to.
RUN python -m venv /opt/sglang \
    && PIP_CONSTRAINT="" /opt/sglang/bin/pip install --no-cache-dir "sglang==${SGLANG_VERSION}" \
       "sglang-router==${SGLANG_ROUTER_VERSION}"

# The project: pinned dependencies first (docker/requirements.txt), then the package itself. The
# base image's pip constraints hold for its GPU stack only (docker/constraints.sh): under all of
# them, pins that differ from the base image's versions could not install.
WORKDIR /workspace/megatron-gspo
COPY docker/requirements.txt docker/constraints.sh docker/
RUN bash docker/constraints.sh > /tmp/gpu-stack.txt \
    && PIP_CONSTRAINT=/tmp/gpu-stack.txt pip install --no-cache-dir --requirement docker/requirements.txt \
    && python -c "import torch; print('torch', torch.__version__)" \
    && rm /tmp/gpu-stack.txt
COPY setup.py README.md ./
COPY megatron_gspo ./megatron_gspo
COPY moe ./moe
COPY conf ./conf
RUN pip install --no-cache-dir --no-deps ./
COPY launch ./launch
COPY tools ./tools
COPY benchmarks ./benchmarks
COPY scripts ./scripts
COPY docker/smoke.sh docker/smoke.sh

# Ubuntu 24.04 images (NGC PyTorch 25.x) already hold a user "ubuntu" with UID 1000: it gives way.
RUN if getent passwd 1000 >/dev/null; then userdel "$(getent passwd 1000 | cut -d: -f1)"; fi \
    && useradd --create-home --uid 1000 --shell /bin/bash gspo \
    && chown -R gspo:gspo /workspace/megatron-gspo
USER 1000:1000
CMD ["python", "-m", "megatron_gspo", "--help"]
