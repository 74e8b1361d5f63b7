# The inference image: torch + transformers + gpu-watchdog, run as a non-root user.
# Build with `make images` (any of docker, podman, buildah), or from the repository root:
#   docker build -f docker/inference.Dockerfile -t gpu-watchdog-inference .
# BASE: any Debian-like image with python3 (>= 3.11) and python3-venv. For GPUs, build FROM an image
# with the CUDA runtime your torch build expects (e.g. nvidia/cuda:*-runtime plus python3), and let
# pip take PyPI's CUDA torch (no WHEELS folder).
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
# A local wheel folder (`make images WHEELS=...`), mounted at /wheels for the build only.
ARG PIP_FIND_LINKS=
# A TLS-intercepting proxy's CA, when `make images CA_BUNDLE=...` mounts one over the system bundle.
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
# Each half into its place under the one import root (in the checkout, links map them there).
COPY gpu_watchdog/*.py ./gpu_watchdog/
COPY inference ./gpu_watchdog/inference
COPY watchdog ./gpu_watchdog/watchdog
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install torch==2.13.0 \
 && /opt/venv/bin/pip install '.[inference]' \
 && /opt/venv/bin/pip uninstall -y pip setuptools \
 && rm -rf /opt/venv/bin/pip* /opt/venv/bin/activate* /opt/venv/bin/Activate.ps1

FROM ${BASE}
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/tmp
RUN groupadd --gid 10001 app && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin app
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["gpu-watchdog"]
CMD ["serve"]
