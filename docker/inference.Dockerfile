# The inference image: torch + transformers + gpu-watchdog, run as a non-root user.
# Build from the repository root: docker build -f docker/inference.Dockerfile -t gpu-watchdog-inference .
# For GPUs, start FROM an image with the CUDA runtime your torch build expects (e.g. nvidia/cuda:*-runtime)
# and install the matching torch wheel instead of the pinned one.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY inference ./inference
COPY watchdog ./watchdog
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir torch==2.13.0 \
 && /opt/venv/bin/pip install --no-cache-dir '.[inference]'

FROM python:3.11-slim
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
