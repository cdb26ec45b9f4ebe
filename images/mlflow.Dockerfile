# MLflow tracking server for the cluster (manifests/): basic auth (mlflow's auth extra),
# PostgreSQL backend store, artifacts proxied to S3. mlflow is pinned to the version in
# pyproject.toml (the stages' client).
# Build from the repository root:
#   docker build -f images/mlflow.Dockerfile -t REGISTRY/shardrl-mlflow:VERSION .
ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

FROM ${PYTHON_IMAGE}
ARG MLFLOW_VERSION=3.17.2
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_DISABLE_TELEMETRY=1 \
    HOME=/home/mlflow
RUN useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin mlflow
RUN pip install --no-cache-dir "mlflow[auth]==${MLFLOW_VERSION}" "boto3==1.44.5" "psycopg2-binary==2.9.13"
USER 1000:1000
WORKDIR /home/mlflow
EXPOSE 5000
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
