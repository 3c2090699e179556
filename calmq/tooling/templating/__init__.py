"""The template language behind calmq/tooling/manifests.py, a module per part:
expressions.py (the values an object computes), structure.py (conditional, repeated and
spread entries, documents, the context), govalues.py (how Go templates print and judge a
value), resolve.py (the Python render) and helm.py (the chart's Go templates)."""
