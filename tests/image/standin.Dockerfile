# A CPU stand-in for the NGC PyTorch base (nvcr.io/nvidia/pytorch), for tests/image/run.sh only.
# FROM: a Debian trixie (Python 3.13) image that run.sh makes with mmdebstrap + docker import.
# torch from the package index (the CUDA build; it runs on CPU). Like Ubuntu 24.04 images, the
# stand-in already has a user with uid 1000, so the project's Dockerfile must cope with that.
ARG BASE_IMAGE=del-megatron-test/debian:trixie
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.14.1
# A find-links URL holding torch's wheels (tests/image/run.sh downloads them while it makes the base
# image, and serves them on 127.0.0.1); empty: from the package index.
ARG WHEELS_URL=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Extra CA certificates of the build machine (a TLS-intercepting proxy before the package index);
# the folder may be empty.
COPY certs/ /usr/local/share/ca-certificates/
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN update-ca-certificates \
    && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED \
    && useradd --create-home --uid 1000 ubuntu \
    && if [ -n "${WHEELS_URL}" ]; then \
           pip install --no-index --find-links "${WHEELS_URL}" --trusted-host 127.0.0.1 \
               "torch==${TORCH_VERSION}" "numpy<2.5"; \
       else \
           pip install "torch==${TORCH_VERSION}" "numpy<2.5"; \
       fi \
    && python -c "import torch; assert torch.distributed.is_gloo_available(); print('torch', torch.__version__)"
