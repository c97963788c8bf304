# The serving image: python -m sdnet_trainer.serve (FastAPI on uvicorn), with a CPU build of
# PyTorch and onnxruntime for backend=onnx.
#
#   docker build -t sdnet-serve .
#   docker run --rm -p 8000:8000 -v "$PWD/outputs/quickstart/RUN/checkpoints:/models:ro" sdnet-serve
#   curl -F file=@cat.png http://127.0.0.1:8000/v1/predict        # the API: /docs
#
# The model is mounted at /models: a run's checkpoint directory, one step_* folder or a folder
# written by python -m sdnet_trainer.export. Arguments after the image name replace CMD
# (e.g. `checkpoint=/models/export backend=onnx workers=2`); host and port are set by the
# ENTRYPOINT. A CUDA build: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126, run
# with --gpus all (device=auto picks the GPU).

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# PyTorch first, from the index of the build wanted: the largest layer and the one that changes
# least. The package's own requirement (torch>=2.6) is then already met.
RUN pip install --index-url "${TORCH_INDEX}" torch torchvision
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sdnet_trainer sdnet_trainer
COPY configs configs
COPY recipes recipes
COPY hydra_plugins hydra_plugins
# tokenizers: language models trained with data.tokenizer encode their prompts with it.
RUN pip install ".[serve,export]" tokenizers

FROM python:${PYTHON_VERSION}-slim
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 10001 serve
USER 10001
WORKDIR /home/serve
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s CMD \
    python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/healthz', timeout=3)" \
    || exit 1
ENTRYPOINT ["python", "-m", "sdnet_trainer.serve", "host=0.0.0.0", "port=8000"]
CMD ["checkpoint=/models"]
