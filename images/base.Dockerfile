# ShardRL CPU image: runs every stage (hf engine, torch or DeepSpeed-on-CPU learner) and can
# submit pipelines from inside the cluster (`shardrl pipeline run`, kfp extra).
# Build from the repository root:
#   docker build -f images/base.Dockerfile -t REGISTRY/shardrl:VERSION .
ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY components ./components
COPY pipelines ./pipelines
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_DISABLE_TELEMETRY=1 \
    HOME=/home/shardrl
RUN useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin shardrl \
    && install -d -o 1000 -g 1000 /home/shardrl/.cache /home/shardrl/.cache/shardrl
# ~/.cache made here, the user's: the tasks mount their cache volume at ~/.cache/shardrl,
# and a missing parent of a mount point would be created as root, leaving the libraries
# (vLLM's compile cache, torch extensions) no ~/.cache to write to
# Layers from slowest- to fastest-changing: torch (CPU wheel), dependencies, the package.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml images/requirements.py /tmp/build/
RUN python /tmp/build/requirements.py /tmp/build/pyproject.toml kfp > /tmp/build/requirements.txt \
    && pip install --no-cache-dir -r /tmp/build/requirements.txt \
    && rm -rf /tmp/build
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels
# The source revision the image was built from (`make images` passes it): pipelines compiled
# inside the image refer to the images of this same revision.
ARG SHARDRL_GIT_REVISION=""
ENV SHARDRL_GIT_REVISION=${SHARDRL_GIT_REVISION}
USER 1000:1000
WORKDIR /home/shardrl
CMD ["shardrl", "--help"]
