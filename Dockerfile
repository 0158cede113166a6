# pagedllm on an NVIDIA GPU: `pagedllm serve` on port 8000.
#
#   docker build -t pagedllm .
#   docker run --runtime nvidia --gpus all --ipc=host -p 8000:8000 \
#       -v ~/.cache/huggingface:/var/cache/huggingface pagedllm Qwen/Qwen2.5-7B-Instruct
#
# Arguments after the image name are `pagedllm serve` arguments (docs/deploy.md).
# Stage 1 builds a virtual environment with the CUDA build of torch and pagedllm; stage 2
# copies it onto the CUDA runtime image, without the source tree or the build's caches.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# DL3008 (apt versions unpinned): the base image's release fixes them, and pins would break
# the build at every Ubuntu security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/pagedllm
ENV PATH=/opt/pagedllm/bin:$PATH
# torch first, in its own layer: it is most of the image and changes least often.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pagedllm ./pagedllm
RUN pip install --no-cache-dir .

FROM ${CUDA_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small C launcher for each kernel at run time: it needs a C compiler
# and Python's headers. DL3008: apt versions unpinned, as in the build stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# A numeric user, so Kubernetes' runAsNonRoot can check it.
RUN useradd --create-home --uid 1001 --user-group --shell /usr/sbin/nologin pagedllm \
    && mkdir -p /var/cache/huggingface \
    && chown 1001:1001 /var/cache/huggingface
COPY --from=build /opt/pagedllm /opt/pagedllm
ENV PATH=/opt/pagedllm/bin:$PATH \
    HF_HOME=/var/cache/huggingface \
    PYTHONUNBUFFERED=1
# Model downloads land in the volume, so a restarted container does not fetch them again.
VOLUME ["/var/cache/huggingface"]
USER 1001:1001
WORKDIR /home/pagedllm
EXPOSE 8000
# /health answers 200 once the model is loaded; the start period covers loading a model.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["pagedllm", "serve"]
