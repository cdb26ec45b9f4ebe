-- Run once by the postgres image when it initialises an empty data folder: the database of
-- MLflow's auth app (users and permissions), beside the tracking database POSTGRES_DB.
CREATE DATABASE mlflow_auth;
