# kvatlas image for docker-compose.yml: every kvatlas service (prefill, decode, router) runs it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# torch pinned to the CPU build first: an unpinned torch from PyPI pulls a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvatlas kvatlas
COPY index index
COPY bootstrap bootstrap
COPY transfer transfer
COPY engine engine
COPY router router
RUN pip install .

# Unprivileged: nothing in the cluster needs root.
RUN useradd --create-home --uid 10001 kvatlas
USER kvatlas

# Each compose service gives its own `kvatlas ...` command.
CMD ["kvatlas", "--help"]
