"""What others see of a job: metrics, loggers, TensorBoard scalars, the progress line, the Ray
dashboard's metadata and the Grafana dashboard. Called from every process; imports no process's room.
"""
