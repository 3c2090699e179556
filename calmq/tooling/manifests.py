"""One description of the Kubernetes manifests, read two ways: rendered here in Python
(`calmq k8s render`) and written out as the Helm chart's templates (deploy/helm/calmq).

A manifest is a tree of plain dicts, lists and scalars in which some places are
*expressions* (a value from the chart's values, a name made from a pool's key, the image
reference, a checksum) and some entries are *conditional* (``When``), *repeated*
(``Each``) or *spread* from a value (``Spread``: extra labels, extra env). ``resolve``
evaluates the tree against a values mapping; ``helm_template`` writes the same tree as a
Go template. Both follow Helm's rules where they could differ: maps are ranged in key
order, a value is "empty" as Go templates judge it, values are merged as ``helm -f``
merges them (``merge_values``), and a setting's text is what the chart's ``calmq.text``
helper prints (``setting_text``). tests/unit/test_chart.py holds ``helm template`` to the
Python render for three value sets, so where they still differed it would fail.

This module is the language's public face; its parts are in calmq/tooling/templating/
(expressions, structure, Go's view of values, the Python render, the Go templates).
"""

from __future__ import annotations

from calmq.tooling.templating.expressions import (
    Above,
    And,
    Checksum,
    Dashed,
    Default,
    Expr,
    Fail,
    FileText,
    FullName,
    Has,
    Image,
    Key,
    Namespace,
    Not,
    Or,
    Printf,
    Release,
    Required,
    Served,
    Text,
    Upper,
    Val,
    Without,
    fullname,
)
from calmq.tooling.templating.govalues import HELPERS, config_data, go_json, setting_text
from calmq.tooling.templating.helm import helm_template
from calmq.tooling.templating.resolve import documents, merge_values, resolve
from calmq.tooling.templating.structure import (
    Check,
    Context,
    Doc,
    Each,
    Entries,
    Spread,
    When,
)

__all__ = [
    "HELPERS",
    "Above",
    "And",
    "Check",
    "Checksum",
    "Context",
    "Dashed",
    "Default",
    "Doc",
    "Each",
    "Entries",
    "Expr",
    "Fail",
    "FileText",
    "FullName",
    "Has",
    "Image",
    "Key",
    "Namespace",
    "Not",
    "Or",
    "Printf",
    "Release",
    "Required",
    "Served",
    "Spread",
    "Text",
    "Upper",
    "Val",
    "When",
    "Without",
    "config_data",
    "documents",
    "fullname",
    "go_json",
    "helm_template",
    "merge_values",
    "resolve",
    "setting_text",
]
