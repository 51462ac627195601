# A CPU stand-in for the NGC PyTorch base (nvcr.io/nvidia/pytorch:25.09-py3: Python 3.12, torch,
# git, a user with uid 1000), for tests/image/run.sh. Its build context, made by run.sh:
#   python/  a CPython 3.12 (interpreter, libpython, standard library) for /usr/local
#   certs/   extra CA certificates of the build machine (a TLS-intercepting proxy before the
#            package index); may be empty
# FROM: a minimal Debian image with git, ca-certificates and the libraries that Python links.
ARG BASE_IMAGE=del-megatron-test/debian:bookworm
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.14.1
# A find-links URL holding torch's wheels (run.sh downloads them while it makes the base image, and
# serves them on 127.0.0.1); empty: from the package index.
ARG WHEELS_URL=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY python/ /usr/local/
COPY certs/ /usr/local/share/ca-certificates/
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
# Like Ubuntu 24.04 images, the stand-in already has a user with uid 1000 (`ubuntu`), so the
# project's Dockerfile must cope with that.
RUN ldconfig \
    && ln -s python3.12 /usr/local/bin/python3 && ln -s python3.12 /usr/local/bin/python \
    && update-ca-certificates \
    && python -m ensurepip --default-pip \
    && useradd --create-home --uid 1000 --user-group ubuntu \
    && if [ -n "${WHEELS_URL}" ]; then \
           pip install --no-index --find-links "${WHEELS_URL}" --trusted-host 127.0.0.1 \
               "torch==${TORCH_VERSION}" "numpy<2.5"; \
       else \
           pip install "torch==${TORCH_VERSION}" "numpy<2.5"; \
       fi \
    && python -c "import ssl, sqlite3, ctypes, bz2, lzma, torch; \
assert torch.distributed.is_gloo_available(); print('stand-in: torch', torch.__version__)"
