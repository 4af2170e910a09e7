# megatron-gspo on GPUs: NGC PyTorch (CUDA, NCCL, cuDNN), Transformer Engine, apex (built from
# source), megatron-core and this project for the trainer; SGLang in its own virtual environment
# for the rollout servers (it pins its own torch build, which must not replace the image's).
#
#   docker build -t megatron-gspo:0.1 .
#   enroot import dockerd://megatron-gspo:0.1      # a .sqsh for launch/submit.sh --container-image
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.04-py3
FROM ${BASE_IMAGE}

ARG TE_VERSION=2.4.0
ARG APEX_COMMIT=810ffae374a2b9cb4b5c5e28eaeca7d7998fca0c
ARG SGLANG_VERSION=0.5.6
ARG MAX_JOBS=16

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    MG_SGLANG_PYTHON=/opt/sglang/bin/python

# Transformer Engine, pinned (the image ships one; this makes the version explicit).
RUN pip install --no-cache-dir --no-build-isolation "transformer-engine[pytorch]==${TE_VERSION}"

# apex from source with its C++/CUDA extensions (fused kernels Megatron uses when present).
WORKDIR /opt/apex
RUN git clone https://github.com/NVIDIA/apex.git . \
    && git checkout "${APEX_COMMIT}" \
    && MAX_JOBS="${MAX_JOBS}" pip install --no-cache-dir --no-build-isolation \
       --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" . \
    && rm -rf /opt/apex/.git

# SGLang for the rollout servers (launch/sglang_server.sh runs $MG_SGLANG_PYTHON).
RUN python -m venv /opt/sglang \
    && /opt/sglang/bin/pip install --no-cache-dir "sglang[all]==${SGLANG_VERSION}" \
       "sglang-router==0.2.2"

# The project: pinned dependencies first (docker/requirements.txt), then the package itself.
WORKDIR /workspace/megatron-gspo
COPY docker/requirements.txt docker/requirements.txt
RUN pip install --no-cache-dir --requirement docker/requirements.txt
COPY setup.py README.md ./
COPY megatron_gspo ./megatron_gspo
COPY moe ./moe
RUN pip install --no-cache-dir --no-deps ./
COPY conf ./conf
COPY launch ./launch
COPY tools ./tools
COPY benchmarks ./benchmarks
COPY scripts ./scripts

RUN useradd --create-home --uid 1000 --shell /bin/bash gspo \
    && chown -R gspo:gspo /workspace/megatron-gspo
USER 1000:1000
CMD ["python", "-m", "megatron_gspo", "--help"]
