# ShardRL GPU learner image: the learn stage with `learner.backend.kind: deepspeed` (deepspeed
# extra). DeepSpeed is installed without pre-built ops (DS_BUILD_OPS=0) and the image has no CUDA
# compiler, so ZeRO runs with PyTorch's optimizer kernels rather than JIT-compiled fused ones.
# Build from the repository root:
#   docker build -f images/learner-deepspeed.Dockerfile -t REGISTRY/shardrl-learner-deepspeed:VERSION .
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
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_DISABLE_TELEMETRY=1 \
    DS_BUILD_OPS=0 \
    HOME=/home/shardrl
RUN useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin shardrl \
    && install -d -o 1000 -g 1000 /home/shardrl/.cache /home/shardrl/.cache/shardrl
# ~/.cache made here, the user's: the tasks mount their cache volume at ~/.cache/shardrl,
# and a missing parent of a mount point would be created as root, leaving the libraries
# (vLLM's compile cache, torch extensions) no ~/.cache to write to
# torch from PyPI (CUDA wheels) before DeepSpeed, whose setup reads the installed torch:
# DeepSpeed (an sdist) is built without pip's build isolation, as `make` installs it, since
# an isolated build would fetch another, unpinned torch to build against.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
COPY pyproject.toml images/requirements.py /tmp/build/
RUN python /tmp/build/requirements.py /tmp/build/pyproject.toml deepspeed > /tmp/build/requirements.txt \
    && grep -v '^deepspeed' /tmp/build/requirements.txt > /tmp/build/base.txt \
    && grep '^deepspeed' /tmp/build/requirements.txt > /tmp/build/deepspeed.txt \
    && pip install --no-cache-dir -r /tmp/build/base.txt setuptools wheel \
    && pip install --no-cache-dir --no-build-isolation -r /tmp/build/deepspeed.txt \
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
