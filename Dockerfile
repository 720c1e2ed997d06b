# The shadowd collector image: the package with its postgres extra, no torch (the collector needs no GPU).
#   docker build -t shadowd-collector .      (docker-compose.yml builds it for you)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shadowd ./shadowd
COPY migrations ./migrations
COPY kernel ./kernel
RUN pip install ".[postgres]" && rm -rf /src

RUN useradd --system --uid 10001 --home-dir /data --create-home shadowd
USER shadowd
WORKDIR /data

EXPOSE 8787
# liveness only: /readiness answers 503 until the candidate is READY and must never be a health check
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8787/healthz', timeout=4).status != 200)"

ENTRYPOINT ["shadowd"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8787", "--upgrade"]
