# The sidecar image: the base install only (no torch), run as a non-root user.
# Build from the repository root: docker build -f docker/watchdog.Dockerfile -t gpu-watchdog-watchdog .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY inference ./inference
COPY watchdog ./watchdog
RUN python -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir .

FROM python:3.11-slim
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
RUN groupadd --gid 10001 app && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin app
USER 10001:10001
WORKDIR /tmp
EXPOSE 9402
ENTRYPOINT ["gpu-watchdog"]
CMD ["run", "--config", "/etc/gpu-watchdog/config.yaml"]
