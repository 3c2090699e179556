"""The pieces of calmq/tooling/kubernetes.py's renderer, each module named after what it
renders: values.py the chart's values, secrets.py the secret settings and files, objects.py
what every object is built of, then jobs.py, api.py, workers.py, monitoring.py and
cluster.py the objects themselves."""
