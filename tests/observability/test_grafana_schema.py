"""The dashboard JSON type-checks as a `Dashboard` of Grafana's own schema (`@grafana/schema`).

.ci/install-test-services.sh installs `@grafana/schema` and `typescript`, pinned, from the
npm registry into build/grafana-schema/. The test writes the dashboard as an object literal
typed `Dashboard` into a small .ts file and runs `tsc --noEmit --strict` over it: an unknown
field (an object literal's excess property), a missing required one or a wrong type fails.
One tsc run checks the shipped dashboard and copies with a planted fault each, so the check
is shown to catch them.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess

import pytest

from tests.support.promql import DASHBOARD, REPO

SCHEMA_DIR = REPO / "build" / "grafana-schema"
INSTALLER = REPO / ".ci" / "install-test-services.sh"
# Grafana's enums (ThresholdsMode, FieldColorModeId, ...) are TypeScript string enums, which
# a JSON string cannot name: `Json<T>` accepts their values instead (`${Enum}`: the union of
# its strings) and keeps every other part of the type, excess-property checks included.
PRELUDE = """import type { Dashboard } from '@grafana/schema';
type Json<T> = T extends string ? `${T}` : T extends readonly (infer U)[] ? Json<U>[] : T extends object ? { [K in keyof T]: Json<T[K]> } : T;
export const dashboard: Json<Dashboard> = """


def pinned(name: str) -> str:
    match = re.search(rf"^{name}=(\S+)$", INSTALLER.read_text(), flags=re.M)
    assert match, f"{INSTALLER.name} pins no {name}"
    return match[1]


@pytest.fixture(scope="module")
def tsc():
    node = shutil.which("node")
    compiler = SCHEMA_DIR / "node_modules" / "typescript" / "bin" / "tsc"
    schema = SCHEMA_DIR / "node_modules" / "@grafana" / "schema" / "package.json"
    if node is None or not compiler.is_file() or not schema.is_file():
        pytest.fail("@grafana/schema and typescript are not installed: run .ci/install-test-services.sh (make test does)")
    for package, variable in ((schema, "GRAFANA_SCHEMA_VERSION"), (compiler.parents[1] / "package.json", "TYPESCRIPT_VERSION")):
        version = json.loads(package.read_text())["version"]
        assert version == pinned(variable), f"{package}: {version}, pinned {pinned(variable)}: run .ci/install-test-services.sh"
    return node, compiler


def typecheck(tsc, tmp_path, dashboards: dict[str, dict]) -> dict[str, list[str]]:
    """tsc's errors per dashboard, all checked in one compiler run."""
    node, compiler = tsc
    (tmp_path / "node_modules").symlink_to(SCHEMA_DIR / "node_modules", target_is_directory=True)
    for name, dashboard in dashboards.items():
        (tmp_path / f"{name}.ts").write_text(PRELUDE + json.dumps(dashboard, indent=1) + ";\n")
    proc = subprocess.run(
        [node, str(compiler), "--noEmit", "--strict", "--target", "es2020", "--module", "commonjs",
         "--moduleResolution", "node", *(f"{name}.ts" for name in dashboards)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    errors: dict[str, list[str]] = {name: [] for name in dashboards}
    for line in (proc.stdout + proc.stderr).splitlines():
        match = re.match(r"^(\w+)\.ts\(\d+,\d+\): error (.*)", line)
        if match and match[1] in errors:
            errors[match[1]].append(match[2])
        elif "error" in line and not line.startswith(" "):
            errors.setdefault("_other", []).append(line)
    assert proc.returncode == 0 or any(errors.values()), proc.stdout + proc.stderr
    return errors


def test_the_dashboard_is_a_grafana_dashboard_and_planted_faults_are_caught(tsc, tmp_path):
    shipped = json.loads(DASHBOARD.read_text())
    stat = next(i for i, p in enumerate(shipped["panels"]) if p["title"] == "Mismatching rooms")

    unknown_field = copy.deepcopy(shipped)
    unknown_field["panels"][stat]["gridPosition"] = unknown_field["panels"][stat]["gridPos"]
    variable_field = copy.deepcopy(shipped)  # what the old generator wrote: not in VariableModel
    variable_field["templating"]["list"][1]["definition"] = variable_field["templating"]["list"][1]["query"]["query"]
    bad_enum = copy.deepcopy(shipped)
    bad_enum["panels"][stat]["fieldConfig"]["defaults"]["thresholds"]["mode"] = "absolut"
    bad_type = copy.deepcopy(shipped)
    bad_type["schemaVersion"] = "39"

    errors = typecheck(tsc, tmp_path, {"shipped": shipped, "unknown_field": unknown_field, "variable_field": variable_field,
                                       "bad_enum": bad_enum, "bad_type": bad_type})
    assert not errors.get("_other"), errors.get("_other")
    assert errors.pop("shipped") == [], "the dashboard is not a Grafana Dashboard"
    assert any("gridPosition" in e for e in errors["unknown_field"]), errors["unknown_field"]
    assert any("definition" in e for e in errors["variable_field"]), errors["variable_field"]
    assert any("absolut" in e for e in errors["bad_enum"]), errors["bad_enum"]
    assert any("number" in e for e in errors["bad_type"]), errors["bad_type"]
