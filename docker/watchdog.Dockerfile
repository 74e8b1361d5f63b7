# The sidecar image: the base install only (no torch), run as a non-root user.
# Build with `make images`, or from the repository root:
#   docker build -f docker/watchdog.Dockerfile -t gpu-watchdog-watchdog .
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
# A local wheel folder (`make images WHEELS=...`), mounted at /wheels for the build only.
ARG PIP_FIND_LINKS=
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
# Only the sidecar: no inference/, no benchmarks/.
# Each half into its place under the one import root (in the checkout, links map them there).
COPY gpu_watchdog/*.py ./gpu_watchdog/
COPY watchdog ./gpu_watchdog/watchdog
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install . \
 && /opt/venv/bin/pip uninstall -y pip setuptools \
 && rm -rf /opt/venv/bin/pip* /opt/venv/bin/activate* /opt/venv/bin/Activate.ps1

FROM ${BASE}
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
RUN groupadd --gid 10001 app && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin app
USER 10001:10001
WORKDIR /tmp
EXPOSE 9402
ENTRYPOINT ["gpu-watchdog"]
CMD ["run", "--config", "/etc/gpu-watchdog/config.yaml"]
